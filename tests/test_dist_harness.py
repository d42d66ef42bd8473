from __future__ import annotations

import gc
import os
import time

import pytest
import torch
import torch.distributed as dist

from fsdp_offload_cfg.testing.dist import run_workers

pytestmark = pytest.mark.distributed  # every test here starts real gloo ranks


def _allreduce(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("boom on rank 1")


def _abort_on_rank0(rank: int, world_size: int, stderr_path: str) -> str:
    if rank == 0:
        os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT), 2)  # this rank's stderr, where the test can read it
        os.abort()  # as glibc does on a corrupted heap ("malloc(): unaligned tcache chunk detected")
    return "done"


def test_a_rank_killed_by_a_signal_leaves_its_python_stack(tmp_path):
    """A rank of the tied-weights fixture died once of SIGABRT from glibc's heap check, and all the
    failure said was "exit codes [-6]": no Python line to start from."""
    stderr_path = tmp_path / "rank0.stderr"
    with pytest.raises(AssertionError, match=r"exit codes \[-6\], a negative one the signal"):
        run_workers(_abort_on_rank0, 2, str(stderr_path), timeout=120)
    text = stderr_path.read_text()
    assert "Fatal Python error: Aborted" in text, text
    assert "in _abort_on_rank0" in text and "test_dist_harness.py" in text, text


def test_gloo_allreduce_is_real():
    assert run_workers(_allreduce, 2) == [3.0, 3.0]


def test_rank_error_is_reported():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_workers(_fail_on_rank1, 2)


def _devices_seen(rank: int, world_size: int) -> tuple[str | None, int]:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count()


def test_gloo_ranks_see_no_gpu_whatever_the_machine_has():
    """on a GPU machine the gloo ranks put FSDP2's default mesh on CUDA and died
    (SIGSEGV) or hung; they are CPU ranks, and the parent's own view is left as it was."""
    import os

    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    assert run_workers(_devices_seen, 2) == [("", 0), ("", 0)]
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before


def test_ranks_starting_further_apart_than_the_collective_timeout_still_meet():
    """on the GPU machine, with 12 test workers beside it, rank 1 started more than the 2 s
    a test gave as its collective timeout after rank 0, and the rendezvous, which
    init_process_group bounds by that same timeout, failed both ranks before the test began. The
    collective timeout is the test's subject; the rendezvous must wait out a slow start."""
    pg_timeout = 1.0  # rank 0 hosts the store: before, it waited this long for rank 1, then failed
    assert run_workers(_allreduce, 2, pg_timeout=pg_timeout, start_gap=pg_timeout + 3.0, timeout=60) == [3.0, 3.0]


def test_ranks_joining_the_group_further_apart_than_the_collective_timeout_still_meet():
    """After the store, init_process_group connects gloo's full mesh, bounded by the timeout it is
    given: with the test's short collective timeout there, a rank that joined the group more than
    that after the other (a loaded machine between the two steps) failed both before the test began."""
    pg_timeout = 1.0
    assert run_workers(_allreduce, 2, pg_timeout=pg_timeout, connect_gap=pg_timeout + 3.0, timeout=60) == [3.0, 3.0]


def _allreduce_late_on_rank0(rank: int, world_size: int, delay: float) -> tuple[str, float]:
    if rank == 0:
        time.sleep(delay)
    start = time.monotonic()
    try:
        _allreduce(rank, world_size)
    except RuntimeError:  # gloo's timeout (rank 1), or its peer gone (rank 0); wording differs by torch
        return "failed", time.monotonic() - start
    return "done", time.monotonic() - start


def test_the_collective_timeout_still_bounds_the_collectives():
    """The short timeout a test gives is set on the group after it is made: a collective that one
    rank enters far later still fails on the other after about that long, not after the run's."""
    delay = 10.0
    status, waited = run_workers(_allreduce_late_on_rank0, 2, delay, pg_timeout=2.0, timeout=60)[1]
    assert status == "failed" and waited < delay / 2, (status, waited)


def _heap_walked(rank, world_size):
    walked = gc.get_objects()  # what a full collection walks
    return gc.get_freeze_count(), len(walked), any(o is torch.__dict__ for o in walked)


def test_a_rank_leaves_the_heap_it_inherits_out_of_its_collections():
    """The warm server's imports (torch, transformers: hundreds of thousands of objects) are
    never garbage; a rank's full collections walk only what the rank made since."""
    for frozen, walked, walks_torch in run_workers(_heap_walked, 2):
        assert frozen > 100_000 and walked < frozen and not walks_torch, (frozen, walked)


def test_the_suites_own_process_leaves_what_collection_imported_out_of_its_collections():
    """As its ranks do: torch (imported by this module at collection) is never walked again."""
    assert gc.get_freeze_count() > 50_000
    assert all(o is not torch.__dict__ for o in gc.get_objects())


def _master_port(rank: int, world_size: int) -> str:
    return os.environ["MASTER_PORT"]


def test_the_stores_port_is_bound_by_the_store_not_picked_before(monkeypatch: pytest.MonkeyPatch):
    """A port picked free (`free_port`) and bound later by rank 0's store was taken in between,
    once in CI, by another leg's process: rank 0 failed with EADDRINUSE and rank 1 waited out its
    300 s. Here the port `free_port` gives is held the whole time, as that other process held it:
    the ranks still meet, on the port rank 0's store bound."""
    import socket

    from fsdp_offload_cfg.testing import dist as harness

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held = taken.getsockname()[1]
        monkeypatch.setattr(harness, "free_port", lambda: held)
        ports = run_workers(_master_port, 2, timeout=60)
    assert ports[0] == ports[1] and int(ports[0]) not in (0, held), ports


def test_a_launchers_port_comes_from_outside_the_kernels_own_picks():
    """The kernel hands out ports from its ephemeral range to every socket bound to port 0 or
    connecting out (gloo's, another leg's), and one it picked for a launcher was taken before the
    launcher bound it. `free_port` picks outside that range, and never a launcher's default."""
    from fsdp_offload_cfg.testing.dist import _ephemeral_range, free_port

    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(20)]
    assert all(not low <= p <= high and not 29400 <= p <= 29500 for p in ports), (ports, low, high)
    assert len(set(ports)) == len(ports)


def test_a_port_given_to_one_test_process_is_not_given_to_another_while_it_lives():
    """CI runs its legs side by side: a port `free_port` gave one pytest process, not yet bound
    by its launcher, is passed over by another's, and is free for others once the first has ended."""
    from fsdp_offload_cfg.testing.dist import free_port

    held = free_port()
    spare = _child_port("free_port()")
    assert _child_port(f"free_port([{held}, {spare}])") == spare  # this process holds `held`
    assert _child_port(f"free_port([{spare}])") == spare  # the child that held `spare` has ended


def _child_port(call: str) -> int:
    import subprocess
    import sys

    code = f"from fsdp_offload_cfg.testing.dist import free_port; print({call})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return int(done.stdout.strip())
