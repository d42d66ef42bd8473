"""CPU tests stay CPU tests when the machine has a GPU.

The suite's first run on a GPU machine failed four in-process tests of `patch()` that assumed a
machine without one (the CPU-FSDP patches, the FSDP1 `sync_module_states` refusal): they read
`torch.cuda.is_available()` through the launch context. Such tests pin the machine they model;
this runs them with a GPU visible (faked for availability checks only), so CI, which has no GPU,
keeps them honest.
"""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(__file__)


def test_patch_tests_pass_with_a_gpu_visible():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_gpu_visible",
         os.path.join(HERE, "test_patching.py"),
         # its tests that check in a child Python would see no GPU there (the fake is in-process)
         "-m", "not fresh_python"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
