"""Small object collectives that keep every rank's control flow in step.

The rule the loader follows: a rank never raises alone. Each step that can fail on some ranks is
followed by `raise_if_any_failed`, so every rank raises together, naming the cause, instead of
the healthy ranks waiting in the next collective until the process-group timeout.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


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
