"""Run a function on N real gloo ranks (no mocked process group) and collect what each returns.

Each rank is a fresh `spawn`ed interpreter with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set exactly
as torchrun would set them, and a gloo process group already initialised. A rank that raises
reports its traceback; a rank that hangs is killed after `timeout` seconds and the test fails
naming it, so a broken collective can never wedge the suite.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    env: dict[str, str],
    local_world_size: int,
    pg_timeout: float | None,
    rendezvous_timeout: float,
    connect_gap: float,
    queue: Any,
) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank % local_world_size),
            "LOCAL_WORLD_SIZE": str(local_world_size),
            "GROUP_RANK": str(rank // local_world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    try:
        # The store is made here, and the group made with the run's timeout, not the test's short
        # collective one: init_process_group's timeout also bounds the rendezvous and gloo's
        # full-mesh connect, and a short one (a test's 2 s) failed whenever the ranks started more
        # than that apart (spawned interpreters importing torch on a loaded machine). `pg_timeout`
        # is set on the group once it exists, so it bounds the collectives only.
        run_timeout = timedelta(seconds=rendezvous_timeout)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=run_timeout)
        time.sleep(connect_gap * rank)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=run_timeout)
        collective_timeout = dist.default_pg_timeout if pg_timeout is None else timedelta(seconds=pg_timeout)
        dist.distributed_c10d._set_pg_timeout(collective_timeout)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def _cpu_only_children() -> Iterator[None]:
    """The ranks are gloo CPU ranks whatever this machine has: they start with no GPU visible,
    so that nothing in them (FSDP2's default mesh takes the accelerator when one is visible) puts
    tensors on a device gloo cannot serve. A spawned interpreter takes the parent's environment
    when it starts, before it imports torch."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def run_workers(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
    local_world_size: int | None = None,
    expect_errors: bool = False,
    pg_timeout: float | None = None,
    start_gap: float = 0.0,
    connect_gap: float = 0.0,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return results by rank.

    `pg_timeout` (seconds) is the process group's collective timeout (gloo's default otherwise).
    `start_gap` (seconds) passes between starting one rank and the next, as on a loaded machine;
    `connect_gap` (seconds, times the rank) between a rank meeting the others at the store and
    joining the process group.

    With `expect_errors=True` a rank's traceback string is returned in its slot instead of
    failing the test (for failure-propagation tests); a hang still fails.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, dict(env or {}), local_world_size or world_size, pg_timeout,
                  timeout, connect_gap, queue),
            daemon=False,
        )
        for r in range(world_size)
    ]
    with _cpu_only_children():
        for r, p in enumerate(procs):
            time.sleep(start_gap if r else 0.0)
            p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world_size and time.monotonic() < deadline:
        if not queue.empty():
            rank, status, payload = queue.get()
            results[rank] = (status, payload)
            continue
        if all(not p.is_alive() for p in procs) and queue.empty():
            break
        time.sleep(0.05)
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()) if len(results) == world_size else 0)
        if p.is_alive():
            p.kill()
            p.join()
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise AssertionError(
            f"ranks {missing} did not report within {timeout:.0f}s (hung or crashed; exit codes "
            f"{[procs[r].exitcode for r in missing]}); reported: "
            + "; ".join(f"rank {r}: {s}" for r, (s, _) in sorted(results.items()))
            + "".join(f"\n--- rank {r} ---\n{p}" for r, (s, p) in sorted(results.items()) if s == "error")
        )
    errors = {r: p for r, (s, p) in results.items() if s == "error"}
    if errors and not expect_errors:
        raise AssertionError("".join(f"\n--- rank {r} raised ---\n{tb}" for r, tb in sorted(errors.items())))
    return [results[r][1] for r in range(world_size)]
