"""`benchmarks/launcher_patch.py`: what `patch()` costs a launcher process, run as a user runs it.
Never a figure (CPU-seconds need an idle machine): the rows it prints, and that a row whose child
was not patched as asked stops the script instead of printing a figure for the wrong thing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "launcher_patch.py"

pytestmark = pytest.mark.own_code


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_OFFLOAD_CFG", "PYTEST_ADDOPTS"))}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env)


def test_each_launcher_is_measured_without_the_plugin_and_patched_and_the_patched_one_holds_no_heavy_module():
    proc = _run("--repeat", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith(("| torchrun", "| accelerate"))]
    assert [(r[0], r[1].split(" from ")[0]) for r in rows] == [
        ("| torchrun", "none"), ("| torchrun", "`patch()`"), ("| accelerate launch", "none"),
        ("| accelerate launch", "`patch()`")], proc.stdout
    assert all(r[-1] == "none of them |" for r in rows), proc.stdout  # models, dynamo, FSDP2: none


def test_a_checkout_whose_plugin_does_not_patch_stops_the_script(tmp_path: Path):
    proc = _run("--repeat", "1", "--checkout", str(tmp_path))  # no _bootstrap there: nothing patches
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "the child importing torch.distributed.run was not patched" in proc.stderr, proc.stderr[-3000:]
    assert "| torchrun |" not in proc.stdout
