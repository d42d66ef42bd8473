"""Every run that succeeded exits 0: the gloo exit-abort race (see `fsdp_offload_cfg.clean_exit`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _dist import free_port, run_workers
from fsdp_offload_cfg.clean_exit import wait_for_idle_gloo_workers

HERE = Path(__file__).parent
PROBE = HERE / "scripts" / "exit_race_probe.py"


def _torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), str(PROBE), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=HERE.parent)


@pytest.mark.distributed
def test_exit_while_a_gloo_worker_still_holds_a_collective_is_clean():
    control = _torchrun("--no-patch")
    if control.returncode == 0:
        pytest.skip("this torch no longer aborts when a gloo worker outlives the script: nothing to guard")
    assert "terminate called without an active exception" in control.stderr, control.stderr[-3000:]

    guarded = _torchrun()
    output = guarded.stdout + guarded.stderr
    assert guarded.returncode == 0, output[-3000:]
    assert "terminate called" not in output


def test_wait_returns_at_once_without_gloo_workers():
    assert wait_for_idle_gloo_workers(max_wait=0.0)


def _idle_after_collectives(rank: int, world_size: int) -> bool:
    import torch
    import torch.distributed as dist

    for _ in range(3):
        dist.all_reduce(torch.ones(4))
    return wait_for_idle_gloo_workers()


@pytest.mark.distributed
def test_workers_of_a_live_group_are_found_idle_after_its_collectives():
    assert run_workers(_idle_after_collectives, 2) == [True, True]
