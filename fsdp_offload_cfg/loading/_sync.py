"""Small object collectives that keep every rank's control flow in step.

The rule the loader follows: a rank never raises alone. Each step that can fail on some ranks is
followed by `raise_if_any_failed`, so every rank raises together, naming the cause, instead of
the healthy ranks waiting in the next collective until the process-group timeout.
"""

from __future__ import annotations

import itertools
import logging
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")

logger = logging.getLogger("fsdp_offload_cfg.loading")

WAIT_LOG_EVERY_S = 60.0
_rank0_waits = itertools.count()  # every rank calls `wait_for_rank0` in the same order


def distributed_ready() -> bool:
    """True when a process group with more than one rank is up (otherwise there is nothing to share)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def describe_error(exc: BaseException) -> str:
    """One line naming the exception and where it was raised (the last frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def attempt(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """Run `fn`, returning (result, None) or (None, exception); KeyboardInterrupt still propagates."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then re-raised
        return None, exc


def wait_for_rank0(what: str) -> None:
    """Rank 0: announce that it is done with `what`. Other ranks: wait until it is.

    Why not just the collective that follows: rank 0 may take longer than the process group's
    timeout (10 min for NCCL, 30 for gloo by default) to read a large checkpoint or to initialise
    a large model, and a rank waiting in a collective that long is killed by the watchdog. The
    wait goes through the process group's store instead, which has no such limit (if rank 0 dies,
    torchrun stops every rank). Rank 1 logs every minute that the ranks are still waiting. Rank 0
    must call this whether its work failed or not: its error travels in the next collective.
    """
    key = f"fsdp_offload_cfg/rank0_done/{next(_rank0_waits)}"
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        store.set(key, "1")
        return
    start = time.monotonic()
    next_log = start + WAIT_LOG_EVERY_S
    pause = 0.001
    while not _check(store, key, what):
        time.sleep(pause)
        pause = min(2 * pause, 0.5)
        if time.monotonic() >= next_log:
            next_log += WAIT_LOG_EVERY_S
            if dist.get_rank() == 1:
                logger.info("ranks 1-%d still waiting for rank 0 to %s (%.0fs)",
                            dist.get_world_size() - 1, what, time.monotonic() - start)  # fmt: skip


def _check(store: dist.Store, key: str, what: str) -> bool:
    try:
        return store.check([key])
    except Exception as exc:
        raise RuntimeError(
            f"rank {dist.get_rank()} lost contact with rank 0 while waiting for it to {what} "
            f"(did rank 0 crash, e.g. killed for lack of host memory?): {type(exc).__name__}: {exc}"
        ) from exc


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (picklable objects only)."""
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def raise_if_any_failed(error: BaseException | None, what: str) -> None:
    """Tell every rank whether any rank failed at `what`; if one did, raise on all of them.

    The failing rank re-raises its own exception (chained to a RuntimeError naming all failures)
    so its traceback stays intact; the others raise a RuntimeError naming the rank and cause.
    """
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, describe_error(error) if error is not None else None)
    failed = [(rank, msg) for rank, msg in enumerate(errors) if msg is not None]
    if not failed:
        return
    summary = f"{what} failed on " + "; ".join(f"rank {rank}: {msg}" for rank, msg in failed)
    raise RuntimeError(summary) from error
