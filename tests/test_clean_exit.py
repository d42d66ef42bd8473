"""The exit guard's idleness check (`fsdp_offload_cfg.clean_exit`). The race it closes is forced
end to end, on real torchrun ranks, in `test_launch.py::test_exit_while_a_gloo_worker_still_holds_a_collective_is_clean`.
"""

from __future__ import annotations

import pytest

from fsdp_offload_cfg.clean_exit import wait_for_idle_gloo_workers
from fsdp_offload_cfg.testing.dist import run_workers


def test_wait_returns_at_once_without_gloo_workers(monkeypatch: pytest.MonkeyPatch):
    """No gloo worker thread in this process: idle at once, without a single quiet window slept
    (with `max_wait=0` it could not have waited anyway; here it may wait a minute and must not)."""
    import fsdp_offload_cfg.clean_exit as clean_exit

    slept: list[float] = []
    monkeypatch.setattr(clean_exit.time, "sleep", slept.append)
    assert clean_exit._worker_activity() == {}
    assert wait_for_idle_gloo_workers(max_wait=60.0)
    assert slept == []


def _idle_after_collectives(rank: int, world_size: int) -> bool:
    import torch
    import torch.distributed as dist

    for _ in range(3):
        dist.all_reduce(torch.ones(4))
    return wait_for_idle_gloo_workers()


@pytest.mark.distributed
def test_workers_of_a_live_group_are_found_idle_after_its_collectives():
    assert run_workers(_idle_after_collectives, 2) == [True, True]
