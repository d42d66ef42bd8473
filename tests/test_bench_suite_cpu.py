"""`benchmarks/suite_cpu.py`: the machine's busy CPU per test and per file, the table CI's time
is planned from (`docs/compatibility.md`). Checked on a suite of two tests written here, run by the
script as a user runs it; never a figure that needs an idle machine (CI runs two lanes at once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "suite_cpu.py"

SUITE = '''
import json, os, time

def test_burns():
    start = time.process_time()
    while time.process_time() - start < 0.4:
        pass
    with open(os.environ["OWN_CPU"], "w") as f:
        json.dump(time.process_time() - start, f)

def test_sleeps():
    time.sleep(0.3)
'''

pytestmark = pytest.mark.own_code


def test_each_test_is_counted_at_least_the_cpu_its_own_process_took_and_the_files_are_summed(tmp_path: Path):
    """The machine's busy count includes the test's own process, so it can be no less than what
    that process took (less a clock tick at each end); the file's row is its tests' sum."""
    (tmp_path / "test_two.py").write_text(SUITE)
    rows_file, own = tmp_path / "rows.json", tmp_path / "own.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json", str(rows_file), "--top", "5", "-q",
                           "-p", "no:cacheprovider", "test_two.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**_env(), "OWN_CPU": str(own)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {node: (cpu, wall) for node, cpu, wall in json.loads(rows_file.read_text())}
    assert set(rows) == {"test_two.py::test_burns", "test_two.py::test_sleeps"}, rows
    assert rows["test_two.py::test_burns"][0] >= json.loads(own.read_text()) - 0.05, rows
    assert rows["test_two.py::test_sleeps"][1] >= 0.3, rows
    total = sum(cpu for cpu, _ in rows.values())
    assert f"| test_two.py | {total:.1f} | 100% |" in proc.stdout, proc.stdout
    assert "| test_two.py::test_burns |" in proc.stdout and "2 tests:" in proc.stdout, proc.stdout


def test_pytest_stopping_before_any_test_says_so_with_its_status(tmp_path: Path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "-q", "-p", "no:cacheprovider", "no_such_file.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's "usage error": the file is not there
    assert "pytest exited 4 before any test ran: no table" in proc.stderr, proc.stderr


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
