"""The code passes the linter the project configures (`[tool.ruff]` in pyproject.toml): 22
findings had piled up where nothing ran it. Pinned in the test extra, so that a ruff release that
adds a rule to a selected family changes nothing here until the pin moves. `own_code`: no library
version changes what it checks (CI runs it on the newest leg only)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.own_code
def test_ruff_finds_nothing() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is not installed: it is in the test extra (pip install -e '.[test]')"
    result = subprocess.run([ruff, "check", "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
