"""Small object collectives that keep every rank's control flow in step, and the store mailbox.

The rule `load_into_sharded` follows: a rank never raises alone. Each step that can fail on some
ranks is followed by `raise_if_any_failed`, so every rank raises together, naming the cause,
instead of the healthy ranks waiting in the next collective until the process-group timeout.
`from_pretrained` makes no collective at all (`Rank0Mailbox`): a load that only some ranks make
must behave like a plain load on them, and a rank that fails there raises alone, before any
collective that could leave another rank waiting.
"""

from __future__ import annotations

import itertools
import pickle
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fsdp_offload_cfg._logging import get_logger

T = TypeVar("T")

logger = get_logger("fsdp_offload_cfg.loading")

WAIT_LOG_EVERY_S = 60.0
_calls: dict[str, itertools.count] = {}  # per mailbox key: how often this rank made that call


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


class Rank0Mailbox:
    """Rank 0 hands the other ranks one result through the process group's store: no collective.

    Why not a collective: (1) a load that only some ranks make (`if is_main_process:
    from_pretrained(...)`) must behave like a plain load on the ranks that make it, so rank 0
    never waits for the others; (2) rank 0 may take longer than the process-group timeout (10
    min for NCCL, 30 for gloo by default) to read a large checkpoint, and a rank waiting in a
    collective that long is killed by the watchdog. The store has no such limit.

    One mailbox per call: its slot is the call's `key` (the same on every rank for the same
    call: `pairing.LoadCall.digest` of class, checkpoint and shaping arguments, never object ids)
    plus how many times this rank has made that call before, so repeats of one call keep their
    order and a load with other arguments never takes this call's slot. Rank 0 marks the slot
    started before its work and fills it after, error or not; a waiting rank gives up when
    rank 0 has not even started within the process-group timeout (it is not making this call).
    """

    def __init__(self, key: str, what: str) -> None:
        self.what = what
        self.repeat = next(_calls.setdefault(key, itertools.count()))  # earlier calls with this key on this rank
        self.slot = f"fsdp_offload_cfg/rank0/{key}/{self.repeat}"
        self.store = dist.distributed_c10d._get_default_store()

    def start(self) -> None:
        """Rank 0: tell the waiting ranks that this call is under way."""
        self.store.set(f"{self.slot}/started", "1")

    def post(self, obj: Any) -> BaseException | None:
        """Rank 0: fill the slot; returns the pickling error (the slot then carries its message)."""
        try:
            data = pickle.dumps(obj)
            error = None
        except Exception as exc:  # noqa: BLE001 - the waiting ranks must hear of it too
            error = exc
            data = pickle.dumps((describe_error(exc), None))
        self.store.set(f"{self.slot}/done", data)
        return error

    def receive(self, hint: str) -> Any:
        """Other ranks: wait for rank 0's `post` and return the object. Raises, with `hint`, when
        rank 0 does not start this call within the process-group timeout."""
        done, started = f"{self.slot}/done", f"{self.slot}/started"
        start = time.monotonic()
        deadline = start + process_group_timeout()
        next_log = start + WAIT_LOG_EVERY_S
        pause = 0.001
        rank0_started = False
        while not self._has(done):
            rank0_started = rank0_started or self._has(started)
            now = time.monotonic()
            if not rank0_started and now >= deadline:
                raise RuntimeError(
                    f"rank {dist.get_rank()} waited {now - start:.0f}s for rank 0 to {self.what}, and rank 0 never "
                    f"started it: this call was made on some ranks only. {hint}"
                )
            if now >= next_log:
                next_log += WAIT_LOG_EVERY_S
                self._log_wait(rank0_started, now - start, hint)
            time.sleep(pause)
            pause = min(2 * pause, 0.5)
        return pickle.loads(self.store.get(done))

    def _log_wait(self, rank0_started: bool, waited: float, hint: str) -> None:
        if rank0_started:
            if dist.get_rank() == 1:  # one line per minute for all waiting ranks
                logger.info("ranks 1-%d still waiting for rank 0 to %s (%.0fs)",
                            dist.get_world_size() - 1, self.what, waited)  # fmt: skip
        else:
            logger.warning("rank %d has waited %.0fs for rank 0 to %s, and rank 0 has not started it. %s",
                           dist.get_rank(), waited, self.what, hint)  # fmt: skip

    def _has(self, key: str) -> bool:
        try:
            return self.store.check([key])
        except Exception as exc:
            raise RuntimeError(
                f"rank {dist.get_rank()} lost contact with rank 0 while waiting for it to {self.what} "
                f"(did rank 0 crash, e.g. killed for lack of host memory?): {type(exc).__name__}: {exc}"
            ) from exc


def process_group_timeout() -> float:
    """The default process group's collective timeout in seconds (gloo's or NCCL's default if unknown)."""
    group = dist.distributed_c10d._get_default_group()
    for device in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 - no backend for this device type, or no `options`
            continue
    return dist.default_pg_timeout.total_seconds()


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (picklable objects only)."""
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any rank: one decision, taken from every rank's data."""
    flags: list[bool | None] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(flag))
    return any(flags)


def raise_if_any_failed(error: BaseException | None, what: str) -> None:
    """Tell every rank whether any rank failed at `what`; if one did, raise on all of them.

    The failing rank re-raises its own exception (chained to a RuntimeError naming all failures)
    so its traceback stays intact; the others raise a RuntimeError naming the rank and cause.
    When every failure is a `ConfigError` (a config the run cannot honour, such as a budget no
    plan meets) every rank raises a `ConfigError` instead, with no chain: it is the user's to fix,
    and under a launcher it prints as one message per rank, not three chained tracebacks.
    """
    from fsdp_offload_cfg.config.model import ConfigError

    errors: list[tuple[str, str | None] | None] = [None] * dist.get_world_size()
    mine = None if error is None else (describe_error(error), str(error) if isinstance(error, ConfigError) else None)
    dist.all_gather_object(errors, mine)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if not failed:
        return
    if all(config_text is not None for _, (_, config_text) in failed):
        if isinstance(error, ConfigError):
            raise error.with_traceback(None) from None
        rank, (_, config_text) = failed[0]
        raise ConfigError(f"{what} failed on rank {rank}:\n{config_text}") from None
    summary = f"{what} failed on " + "; ".join(f"rank {rank}: {msg}" for rank, (msg, _) in failed)
    raise RuntimeError(summary) from error


def agreed(what: str, fn: Callable[[], T]) -> T:
    """Run the step `fn` on every rank, then agree: if it failed on any rank, every rank raises
    (`raise_if_any_failed`, naming the step as `what` and each failing rank). The one way a step
    that can fail on some ranks runs between two collectives."""
    result, error = attempt(fn)
    raise_if_any_failed(error, what)
    return result  # type: ignore[return-value]

