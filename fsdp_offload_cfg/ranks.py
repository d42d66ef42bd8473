"""What every rank must agree on, and the one way a step that can fail on some ranks runs.

The package's rule, wherever a collective follows: a rank never raises alone. Each step that can
fail on some ranks is followed by `raise_if_any_failed` (or runs inside `agreed`), so every rank
raises together, naming the cause, instead of the healthy ranks waiting in the next collective
until the process-group timeout. Decisions that choose between two collective paths are taken
from every rank's data (`any_rank`, `max_over_ranks`, `min_over_ranks`), so every rank takes the
same path. Loading, the budget's planner and the integrations all follow it; without a process
group of several ranks each helper is the plain local step. A step that has no collective by
design (a load, which some ranks may make alone) can still fail on one rank: the error that ends
that rank's process leaves a note in the store (`say_this_rank_is_gone`), and the meeting the
others come to next (`every_rank_comes`) stops on it instead of waiting out the timeout.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from fsdp_offload_cfg._logging import get_logger

T = TypeVar("T")

logger = get_logger("fsdp_offload_cfg")
_meetings: dict[str, itertools.count] = {}  # per meeting name: how often this rank has come to it
MEETING_LOG_EVERY_S = 60.0
NOTE_READ_WAIT_S = 60.0  # the most the store's host, gone at a load, stays for its peers to read why
# store keys: `{_GONE}/rank{r}` = why rank r left; `{_GONE}/ranks`, `{_GONE}/readers` = "r,r," (those that
# left a note; those that read one, for which the store's host may stay: `stay_while_the_note_is_unread`)
_GONE = "fsdp_offload_cfg/gone"
_STEP_NOTE = "_fsdp_offload_cfg_failed_step"  # on an error: the step it failed (`remember_failed_step`)


def distributed_ready() -> bool:
    """True when a process group with more than one rank is up (otherwise there is nothing to share)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def node_name() -> str:
    """This rank's node, as the launcher numbers it (torchrun's `GROUP_RANK`: "node 1"), else the
    host's name: what a log line names when it says which node got what."""
    group = os.environ.get("GROUP_RANK")
    return f"node {group}" if group not in (None, "") else socket.gethostname()


def rank_ranges(ranks: Sequence[int]) -> str:
    """"0-1, 4" for [0, 1, 4]: ranks as a person reads them in a log line."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def named_ranks(ranks: Sequence[int]) -> str:
    """"rank 1", "ranks 1-3": `rank_ranges` with the noun a log line reads with it."""
    return ("rank " if len(set(ranks)) == 1 else "ranks ") + rank_ranges(ranks)


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
    that can fail on some ranks runs between two collectives. Without several ranks: `fn()`."""
    if not distributed_ready():
        return fn()
    result, error = attempt(fn)
    raise_if_any_failed(error, what)
    return result  # type: ignore[return-value]


def host_group() -> Any:
    """A gloo group for agreements made every step (a few integers): on NCCL they would
    round-trip through the device and stall the host on it. Its own group on every backend,
    gloo included, so that the CPU tests run the GPU's path. Made where every rank is (it is a
    collective); None without a process group of several ranks."""
    return dist.new_group(backend="gloo") if distributed_ready() else None


def max_over_ranks(values: Sequence[int], group: Any = None) -> list[int]:
    """Each integer's maximum over the ranks (the values themselves without several ranks)."""
    return _reduced(values, torch.int64, dist.ReduceOp.MAX, group)


def min_over_ranks(values: Sequence[float], group: Any = None) -> list[float]:
    """Each number's minimum over the ranks (the values themselves without several ranks)."""
    return _reduced(values, torch.float64, dist.ReduceOp.MIN, group)


def every_rank(values: Sequence[int], group: Any = None) -> list[list[int]]:
    """Every rank's integers, in rank order, on every rank ([values] without several ranks)."""
    if not distributed_ready():
        return [list(values)]
    mine = torch.tensor(list(values), dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [t.tolist() for t in gathered]


def _reduced(values: Sequence[Any], dtype: torch.dtype, op: Any, group: Any) -> list[Any]:
    if not distributed_ready():
        return list(values)
    tensor = torch.tensor(list(values), dtype=dtype)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.tolist()


def remember_failed_step(what: str, error: BaseException) -> None:
    """Before this rank raises out of a step its peers pass without it (a model built from rank
    0's description, or its own meta build: no collective there, by design): mark `error` with
    what it was doing, so that the note it leaves if the error ends the process, itself or as
    the cause of another (`say_this_rank_is_gone`), names the step, not only the exception."""
    setattr(error, _STEP_NOTE, f"failed to {what}: {describe_error(error)}")  # on the error: it goes where it goes


def say_this_rank_is_gone(error: BaseException) -> None:
    """Called for an exception nobody caught (the process ends with it; `patch()` installs the
    excepthook that calls this): leave a note in the store, so that the peers' next meeting
    (`every_rank_comes`, which `prepare` opens with) stops at once and names this rank and why,
    instead of waiting out the process-group timeout in a collective for a rank that is gone.
    torchrun stops the job when a rank exits with an error; a launcher that starts each rank
    itself (`srun python train.py`, `mpirun`) does not, and on NCCL the peers waited for the whole
    timeout (10 minutes by default; on gloo the dead peer's socket failed them, with a message
    about connections). Only an uncaught exception counts: a script that catches a failed load
    and loads again is not gone. Never raises, and never waits: the process is ending anyway, and
    its store's host may no longer answer (a hung node; rank 0 stopped). So the note is written
    with the store's two requests that await no reply, `set` and `append` (an `add` waited for
    the host, however long, whatever `set_timeout` said): the kernel delivers them as the process
    exits, or when the host answers again."""
    try:
        if not distributed_ready():
            return
        note = _failed_step(error) or f"exited on an uncaught {describe_error(error)}"
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_GONE}/rank{dist.get_rank()}", note)
        store.append(f"{_GONE}/ranks", f"{dist.get_rank()},")  # after the note: a rank listed has one
    except Exception:  # noqa: BLE001 - the store gone with rank 0: the peers fail on it themselves
        pass


def stay_while_the_note_is_unread(error: BaseException) -> None:
    """Called after `say_this_rank_is_gone`, the error printed: where this rank hosts the store
    (rank 0 started without torchrun, whose agent hosts it instead) and failed a step its peers go
    on from (`remember_failed_step`: a load, which they follow with prepare's meeting), keep the
    process, and with it the store and the note, until every other rank has read the note or
    left one itself, at most NOTE_READ_WAIT_S. Otherwise a peer that comes to prepare after this
    process ended finds no store and can only say so (`StoreLost`), not why this rank stopped."""
    try:
        if not (distributed_ready() and _hosts_the_store() and _failed_step(error) is not None):
            return
        store, world = dist.distributed_c10d._get_default_store(), dist.get_world_size()
        logger.warning("rank 0 hosts the process group's store: it stays up to %.0fs for the other ranks to read "
                       "why it stopped when they come to prepare", NOTE_READ_WAIT_S)  # fmt: skip
        deadline = time.monotonic() + NOTE_READ_WAIT_S
        while (_listed(store, "readers") | _listed(store, "ranks")) < set(range(world)) and time.monotonic() < deadline:
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the process is ending anyway
        pass


def _hosts_the_store() -> bool:
    """Whether this process hosts the default store: rank 0, unless torchrun's agent hosts it."""
    return dist.get_rank() == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def _failed_step(error: BaseException) -> str | None:
    """The step note (`remember_failed_step`) on `error` or on one of the errors it was raised from."""
    link: BaseException | None = error
    for _ in range(32):  # bounded: a chain set by hand may loop
        if link is None or hasattr(link, _STEP_NOTE):
            break
        link = link.__cause__ or link.__context__
    return getattr(link, _STEP_NOTE, None)


class StoreLost(RuntimeError):
    """The store a meeting is held in is gone: the process that hosted it has exited."""


def _why_absent(absent: Sequence[int]) -> str:
    """Why `absent` did not come to a meeting: each gone rank's note, and the timeout for the rest."""
    if not absent:
        return "this rank came after the others had stopped waiting for it"
    store = dist.distributed_c10d._get_default_store()
    gone = _notes(store, absent) if _any_gone(store) else {}
    if gone:  # the store's host may be staying for this (`stay_while_the_note_is_unread`)
        store.append(f"{_GONE}/readers", f"{dist.get_rank()},")
    silent = [r for r in absent if r not in gone]
    reasons = [f"rank {r} {note}" for r, note in gone.items()]
    if silent:
        reasons.append(f"{named_ranks(silent)} did not come within the process-group timeout "
                       f"({process_group_timeout():.0f}s)")  # fmt: skip
    return "; ".join(reasons)


def _any_gone(store: Any) -> bool:
    """One round trip, where no rank has left (the usual case) the only one."""
    return store.check([f"{_GONE}/ranks"])


def _listed(store: Any, which: str) -> set[int]:
    """The ranks in `{_GONE}/{which}`: "ranks", those that left a note; "readers", those that read one."""
    key = f"{_GONE}/{which}"
    return {int(r) for r in store.get(key).decode().split(",") if r} if store.check([key]) else set()


def _notes(store: Any, ranks: Sequence[int]) -> dict[int, str]:
    """Of `ranks`, those that left a note (`say_this_rank_is_gone`), with why."""
    return {r: store.get(f"{_GONE}/rank{r}").decode() for r in ranks if store.check([f"{_GONE}/rank{r}"])}


class Meeting(NamedTuple):
    """How a meeting ended (`every_rank_comes`)."""

    everyone: bool  # every rank came: they go on together into the collectives that follow
    absent: list[int]  # the ranks that never came ([] on a rank that came after the others stopped)
    why: str  # why not ("" where everyone came): each gone rank's note, the timeout, or this rank late


def every_rank_comes(name: str, what: str) -> Meeting:
    """Whether every rank makes this call, agreed through the store, not a collective.

    Returns Meeting(True, [], "") on every rank when all came: they go on together into the
    collectives that follow. Otherwise, after the process-group timeout, Meeting(False, the ranks
    that never came, why) on every rank that came, a late one included: all skip. `why` is read
    here, with the decision, so that a store lost at either read raises the same `StoreLost`.
    Why not a barrier: a step that became collective here, where stock code made none (`if trainer.is_world_process_zero():
    trainer.save_model()`), would leave the calling ranks in it until the watchdog kills the job;
    here they wait as long and go on. One decision per meeting, taken once (`compare_set`): the
    last rank to come says "go", a rank whose wait ran out says "stop", whichever is first. A rank
    that is gone (`say_this_rank_is_gone`) is not waited for: the first to see its note says "stop".
    A store that is gone raises `StoreLost` (its host exited: where no agent hosts it, rank 0).
    """
    try:
        everyone, absent = _meet(name, what)
        return Meeting(everyone, absent, "" if everyone else _why_absent(absent))
    except dist.DistNetworkError as exc:
        raise StoreLost(f"rank {dist.get_rank()} lost the process group's store{_store_address()} while it waited "
                        f"for every rank to {what}: the process that hosts it has exited. Started without "
                        f"torchrun (srun, mpirun, plain python), that is rank 0, whose own output says why it "
                        f"stopped") from exc  # fmt: skip


def _store_address() -> str:
    """" (host:port)" of the default store where it is a TCPStore, else ""."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return f" ({store.host}:{store.port})" if isinstance(store, dist.TCPStore) else ""


def _meet(name: str, what: str) -> tuple[bool, list[int]]:
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    slot = f"fsdp_offload_cfg/meet/{name}/{next(_meetings.setdefault(name, itertools.count()))}"
    decision = f"{slot}/decision"
    store.set(f"{slot}/rank{rank}", "1")
    if store.add(f"{slot}/count", 1) == world:
        store.compare_set(decision, "", "go")
    start = time.monotonic()
    deadline, next_log, pause = start + process_group_timeout(), start + MEETING_LOG_EVERY_S, 0.001
    while not store.check([decision]):
        now = time.monotonic()
        if now >= deadline or (_any_gone(store) and _notes(store, _absent(store, slot, world))):
            store.compare_set(decision, "", "stop")
        elif now >= next_log:
            next_log += MEETING_LOG_EVERY_S
            logger.warning("rank %d has waited %.0fs for %s to %s as well", rank, now - start,
                           named_ranks(_absent(store, slot, world)), what)  # fmt: skip
        time.sleep(pause)
        pause = min(2 * pause, 0.5)
    if store.get(decision) == b"go":
        return True, []
    return False, _absent(store, slot, world)


def _absent(store: Any, slot: str, world: int) -> list[int]:
    return [r for r in range(world) if not store.check([f"{slot}/rank{r}"])]
