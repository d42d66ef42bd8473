"""Rank 0 hands the other ranks one result through the store: `from_pretrained` under rank-0 loading.

A load that only some ranks make must behave like a plain load on them, so this path makes no
collective at all, and a rank that fails here raises alone, before any collective that could leave
another rank waiting (the package's agreement rule is `ranks.py`).
"""

from __future__ import annotations

import itertools
import pickle
import time
from typing import Any

import torch.distributed as dist

from fsdp_offload_cfg._logging import get_logger
from fsdp_offload_cfg.ranks import describe_error, process_group_timeout

logger = get_logger("fsdp_offload_cfg.loading")

WAIT_LOG_EVERY_S = 60.0
_calls: dict[str, itertools.count] = {}  # per mailbox key: how often this rank made that call


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
