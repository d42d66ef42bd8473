"""Shard a model whose weights only rank 0 holds, keeping every parameter AND buffer.

`load_into_sharded(model, shard_fn)` is the prepare step that follows `rank0_from_pretrained`
(or any model that is real on rank 0 and anything, typically meta, elsewhere):

  1. rank 0 describes its model (`ModelSpec`: names, dtypes, shapes, ties) and keeps references
     to its tensors; every rank checks its names/shapes against that spec (clear error, no hang);
  2. every rank replaces all tensors by meta ones, tied exactly as on rank 0 (rank 0's model no
     longer references its real tensors: only the captured dict does);
  3. `shard_fn(model)` applies `fully_shard` on meta (e.g. accelerate's `fsdp2_prepare_model`,
     which may also upcast trainable params to fp32);
  4. storage is allocated (params on the mesh device, or the CPU with `cpu_offload`; buffers on
     the mesh device) and rank 0 sends each tensor's bytes, bucket by bucket, in name order,
     each rank receiving only its own shard, rank 0 freeing each source tensor once sent; then
     each rank computes its rows of the DoRA magnitudes from its rows of the base weights;
  5. every rank checks nothing is left on meta and ties still hold.
Under "sharded" and "auto" (a model built by `sharded_from_pretrained`), step 4 is hybrid: a
rank reads the tensors its checkpoint record shares with rank 0's from the files itself
(`sharded.py`), non-persistent buffers are each rank's own, and rank 0 sends the rest to the ranks
that need it (a node without the files gets its slices streamed from rank 0's reads). Under
hybrid sharding the replicas of a slice split its reading and broadcast what each read
(`replicas.py`), so each checkpoint byte is read once across the job there too.
Every step runs on every rank and ends with an all-rank agreement (`ranks.agreed`), so a failure
on any rank raises on all of them at once, naming the step and the failing ranks; no rank is left
waiting in a collective. The transfer agrees once before its first bucket and once after its last
(a failure on rank 0 mid-way travels in the buckets' header: `broadcast.py`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_offload_cfg import model_state
from fsdp_offload_cfg._logging import counted, get_logger
from fsdp_offload_cfg._sizes import show_size
from fsdp_offload_cfg.loading import dora, replicas, sharded
from fsdp_offload_cfg.loading.broadcast import TransferStats, send_from_rank0
from fsdp_offload_cfg.loading.checkpoint import FileTensor
from fsdp_offload_cfg.loading.guard import release_meta_guards
from fsdp_offload_cfg.loading.layout import Target, plan
from fsdp_offload_cfg.loading.pairing import LoadCall, pair_problem, repeat_shift
from fsdp_offload_cfg.loading.spec import (
    ModelSpec,
    describe,
    meta_tensor_names,
    mismatch,
    named_tensors,
    rebuild_on_meta,
    retie,
)
from fsdp_offload_cfg.ranks import (
    agreed,
    attempt,
    broadcast_from_rank0,
    describe_error,
    distributed_ready,
    every_rank_comes,
    named_ranks,
)

logger = get_logger("fsdp_offload_cfg.loading")

# Staging per load: what a rank reads at once, and what rank 0 packs for one bucket for all ranks
# together (each rank's part is this divided by the number of ranks), so rank 0 holds its shard
# plus about one bucket (and one region read from the files), never one bucket per rank.
DEFAULT_BUCKET_BYTES = 32 * 2**20
_MIN_PART_BYTES = 2**20  # below this per rank, messages get too many to be worth it


@dataclass(frozen=True)
class RankLoad:
    """One rank's share of a load, as the rank-0 summary line reports it."""

    node: str  # `ranks.node_name()`: "node 1" under torchrun, else the host's name
    bytes_read: int  # from the checkpoint files, by this rank (rank 0: what it streams included)
    bytes_received: int  # from rank 0 over the network
    bytes_from_replicas: int = 0  # under HSDP: the slices the other replicas of its group read


@dataclass(frozen=True)
class LoadReport:
    """What one `load_into_sharded` call did on this rank (for logs, tests and benchmarks)."""

    model: nn.Module  # the sharded, filled model: what `shard_fn` returned (or the model itself)
    sent: TransferStats | None  # rank 0's transfer (on rank 0: what it sent; elsewhere: what arrived)
    read: sharded.ReadStats | None  # this rank's own reads from the checkpoint; None: it read nothing
    ranks: tuple[RankLoad, ...] = ()  # what every rank read and received (the same on every rank)
    # seconds of each step on this rank, in order; each ends in an agreement, so it includes
    # waiting for the slowest rank: where a load's time goes (`benchmarks/load_memory.py`)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)


class _Clock:
    """Seconds per step of one load, each from the end of the previous one."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, step: str) -> None:
        now = time.perf_counter()
        self.seconds[step] = now - self._last
        self._last = now


def load_into_sharded(
    model: nn.Module,
    shard_fn: Callable[[nn.Module], nn.Module | None],
    *,
    strategy: Literal["auto", "broadcast", "sharded"] = "broadcast",
    cpu_offload: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> LoadReport:
    """Shard `model` with `shard_fn` and fill it with its parameters and buffers.

    "broadcast": rank 0 sends every tensor. "sharded" and "auto": the tensors this rank's
    checkpoint record shares with rank 0's (its model was built by `sharded_from_pretrained`) it
    reads from the files itself, non-persistent buffers are each rank's own (checked equal to
    rank 0's), the rest (LoRA adapters, keys missing from the checkpoint, everything of a model
    without a record, the slices of a rank that cannot read the files) comes from rank 0 as with
    "broadcast". A model with a record has no weights on rank 0, so its checkpoint tensors are
    read from the files whatever the strategy.

    Returns a `LoadReport` whose `model` is what `shard_fn` returned (or `model` if it returned
    None). Bit-exact for every tensor whose dtype is unchanged; floats are cast to the sharded
    dtype; other dtypes must match. Without a multi-rank process group this is just `shard_fn(model)`.
    """
    if strategy not in ("auto", "broadcast", "sharded"):
        raise ValueError(f"unknown load strategy {strategy!r}; expected 'auto', 'broadcast' or 'sharded'")
    if not distributed_ready():
        release_meta_guards(model)
        return LoadReport(_returned_or(shard_fn(model), model), None, None)
    rank, world = dist.get_rank(), dist.get_world_size()

    clock = _Clock()
    # 0. every rank is here: a rank whose load failed on it alone (no collective in a load) is
    #    named now, before the first collective, instead of at the process-group timeout
    _every_rank_prepares()
    # 1. rank 0's description; every rank checks its model against it (same call, names, shapes)
    spec, rank0_call, computed = _share_rank0_spec(model)
    agreed("matching this rank's model with rank 0's", lambda: _match_rank0(model, spec, rank0_call, rank))
    clock.lap("describe")
    # 2. where each tensor comes from: this rank's checkpoint reads, its own computation after the
    #    load (DoRA magnitudes, `dora.py`), or rank 0 (to the ranks named, the same on every rank)
    sources = sharded.agree_sources(model, spec)
    everywhere = sources.filled_everywhere() | set(computed)
    receivers = {t.name: sources.receivers(t.name, world) for t in spec.tensors if t.name not in everywhere}
    receivers = {name: ranks for name, ranks in receivers.items() if ranks}
    _log_sources(sources, receivers, strategy)
    source = _rank0_source(model, spec, wanted=set(receivers), streamed=sources.streamed)
    clock.lap("agree sources")
    # 3. meta tensors tied as on rank 0, then fully_shard on meta
    sharded_model = agreed("sharding the model on meta (rebuild, shard_fn)", lambda: _shard_on_meta(model, spec, shard_fn))
    clock.lap("shard on meta")
    # 4. storage for this rank's shards
    targets, device = agreed("allocating the sharded model",
                             lambda: _allocate(sharded_model, spec, cpu_offload, rank, world))
    clock.lap("allocate")
    # 5. this rank's own reads (under HSDP, its replica's part of them, then the replicas share
    #    them), then rank 0 sends the rest (its own agreements, bucket by bucket)
    broadcasts, read_stats = agreed("reading this rank's shards from the checkpoint",
                                    lambda: _read_own(targets, sources, rank, device, bucket_bytes))
    clock.lap("read own slices")
    from_replicas = agreed("sharing the slices each replica read with the other replicas",
                           lambda: replicas.broadcast_shares(broadcasts, rank, device))
    if broadcasts.buckets:
        clock.lap("share between replicas")
    from_rank0 = [dataclasses.replace(t, to=receivers[t.spec.name]) for t in targets if t.spec.name in receivers]
    part = min(bucket_bytes, max(bucket_bytes // world, _MIN_PART_BYTES))
    stats = send_from_rank0(from_rank0, source, device=device, bucket_bytes=part)
    clock.lap("transfer from rank 0")
    loads = _loads(sources.nodes, stats, read_stats, from_replicas)
    _log(stats, read_stats, loads)
    if computed:  # the same list on every rank (rank 0's)
        agreed("computing DoRA magnitudes from this rank's rows of the base weights",
               lambda: dora.fill_pending(sharded_model, computed, rank, world))
    # 6. nothing left on meta, every name, dtype and tie as rank 0 described it
    agreed("checking the loaded model", lambda: _check_loaded(sharded_model, spec))
    clock.lap("check")
    return LoadReport(sharded_model, stats, read_stats, loads, clock.seconds)


def _every_rank_prepares() -> None:
    """Meet every rank in the store before prepare's first collective; raise, naming the ranks
    missing and why, on every rank that came where one is gone (`ranks.say_this_rank_is_gone`) or
    did not come within the process-group timeout."""
    meeting, rank = every_rank_comes("prepare", "prepare the model the loader built"), dist.get_rank()
    if meeting.everyone:
        return
    if meeting.absent:
        who = (f"{named_ranks(meeting.absent)} will not prepare the model the loader built, so rank {rank} stops "
               f"here instead of waiting for {'it' if len(meeting.absent) == 1 else 'them'} in a collective")
    else:  # this rank came after the others gave up on it: alone, it would wait in their collective
        who = (f"the other ranks stopped waiting before rank {rank} came to prepare the model the loader built, "
               f"so it stops here too instead of going into a collective alone")
    raise RuntimeError(f"{who}: {meeting.why}")


def _read_own(targets: list[Target], sources: sharded.Sources, rank: int, device: torch.device,
              bucket_bytes: int) -> tuple[replicas.Broadcasts, sharded.ReadStats | None]:
    """This rank's reads, less what another replica of its slices reads for it (HSDP), and the
    broadcasts between replicas that follow, their buffer allocated (which replica reads what is
    the same on every rank: computed from the agreed sources)."""
    shares = replicas.assign_readers(targets, sources.readers, sources.nodes)
    broadcasts = replicas.plan_broadcasts(shares, rank, device, bucket_bytes)
    not_read = frozenset(s.target.spec.name for s in shares if s.reader != rank)
    return broadcasts, sharded.fill_own(targets, sources, rank, bucket_bytes, not_read)


def _match_rank0(model: nn.Module, spec: ModelSpec, rank0_call: LoadCall | None, rank: int) -> None:
    """This rank's model is the model of rank 0's call, with its names and shapes."""
    release_meta_guards(model)  # it is being filled: its forward may run again afterwards
    own_call = model_state.found(model, "load_call")
    problem = pair_problem(own_call, rank0_call, rank) or mismatch(
        spec, describe(model), what=f"rank {rank}'s model does not match rank 0's")
    if problem is not None:
        raise RuntimeError(problem)
    if repeat_shift(own_call, rank0_call):
        logger.warning("rank %d prepares its load #%d of %s, rank 0 its load #%d of the same call: rank 0 made it "
                       "alone before (load such copies inside `fsdp_offload_cfg.local_loading()`); the weights come "
                       "from rank 0's prepared model", rank, own_call.repeat + 1, own_call.description,
                       rank0_call.repeat + 1)  # fmt: skip


def _shard_on_meta(model: nn.Module, spec: ModelSpec, shard_fn: Callable[[nn.Module], nn.Module | None]) -> nn.Module:
    rebuild_on_meta(model, spec)
    return _returned_or(shard_fn(model), model)


def _returned_or(returned: nn.Module | None, model: nn.Module) -> nn.Module:
    """`shard_fn`'s result, or `model` when it returned None. Not `returned or model`: the truth
    value of a module wrapper can raise (`torch.compile`'s `OptimizedModule` proxies `len()`)."""
    return model if returned is None else returned


def _allocate(model: nn.Module, spec: ModelSpec, cpu_offload: bool, rank: int,
              world: int) -> tuple[list[Target], torch.device]:
    """Uninitialised storage for this rank's shards and the buffers; what each rank fills where,
    and the device the transfer's buffers live on."""
    problem = mismatch(spec, describe(model), what="sharded model", check_dtype=True)
    if problem is not None:
        raise RuntimeError(problem)
    param_device, device = _devices(model, cpu_offload)
    _materialize(model, param_device, device)
    retie(model, spec)
    return plan(model, spec, rank, world), device


def _check_loaded(model: nn.Module, spec: ModelSpec) -> None:
    left = meta_tensor_names(model)
    problem = f"still on meta after loading: {left}" if left else None
    problem = problem or mismatch(spec, describe(model), what="after loading", check_dtype=True)
    if problem is not None:
        raise RuntimeError(problem)
    for module in model.modules():  # the loader is done with it: its record points at meta tensors gone now
        for field in ("checkpoint", "load_call", "loader_source"):
            model_state.take(module, field)


def _log_sources(sources: sharded.Sources, receivers: dict[str, frozenset[int]], strategy: str) -> None:
    """Rank 0: which ranks read the checkpoint themselves and which get it streamed, by node."""
    if dist.get_rank() != 0:
        return
    if sources.streamed:
        without = sorted({r for n in sources.streamed for r in receivers.get(n, ())})
        nodes = sorted({sources.nodes[r] for r in without})
        logger.info("loading: rank 0 reads %d tensors' slices for %s (%s), which have no record of the "
                    "checkpoint files (built from rank 0's description), and streams them; every other rank "
                    "reads its own", len(sources.streamed), named_ranks(without), ", ".join(nodes))  # fmt: skip
    elif strategy == "sharded" and not sources.readers:
        logger.info("sharded loading: the model has no checkpoint record; every tensor comes from rank 0")


def _loads(nodes: tuple[str, ...], stats: TransferStats, read: sharded.ReadStats | None,
            from_replicas: int) -> tuple[RankLoad, ...]:
    """Every rank's bytes read and received, on every rank (one small all_gather)."""
    mine = ((read.bytes_read if read is not None else 0) + stats.bytes_read, stats.bytes_received, from_replicas)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return tuple(RankLoad(node, *load) for node, load in zip(nodes, gathered))


def _log(stats: TransferStats, read: sharded.ReadStats | None, loads: tuple[RankLoad, ...]) -> None:
    if dist.get_rank() == 0:
        for line in summary_lines(stats, read, loads):
            logger.info(line)


def summary_lines(stats: TransferStats, read: sharded.ReadStats | None, loads: tuple[RankLoad, ...]) -> list[str]:
    """Rank 0's lines on a finished load: what it read, what it sent, what the replicas and the
    nodes did (each only where it happened)."""
    lines = []
    if read is not None:
        lines.append(f"sharded loading: rank 0 read {counted(read.tensors, 'tensor')} ({show_size(read.bytes_read)}, "
                     f"{counted(read.reads, 'read')}) from {counted(len(read.files), 'file')} in {read.seconds:.2f}s")
    if stats.bytes_sent:
        lines.append(f"rank-0 loading: sent {counted(stats.tensors, 'tensor')} ({show_size(stats.bytes_sent)} to "
                     f"{named_ranks(sorted(stats.bytes_to))}) in {counted(stats.buckets, 'bucket')} in "
                     f"{stats.seconds:.2f}s")
    if any(s.bytes_from_replicas for s in loads):
        lines.append(f"loading: the replicas (HSDP) split the reading: {show_size(sum(s.bytes_read for s in loads))} "
                     f"read from the files in all, {show_size(sum(s.bytes_from_replicas for s in loads))} passed "
                     "between replicas")
    if len({s.node for s in loads}) > 1:
        lines.append("loading by node: " + "; ".join(_node_line(node, loads)
                                                      for node in dict.fromkeys(s.node for s in loads)))
    return lines


def _node_line(node: str, loads: tuple[RankLoad, ...]) -> str:
    """"node 1 (ranks 2-3): read 0 B, received 1.2 GiB from rank 0"."""
    ranks = [r for r, s in enumerate(loads) if s.node == node]
    read = sum(loads[r].bytes_read for r in ranks)
    received = sum(loads[r].bytes_received for r in ranks)
    from_replicas = sum(loads[r].bytes_from_replicas for r in ranks)
    return (f"{node} ({named_ranks(ranks)}): read {show_size(read)} from the files, "
            f"received {show_size(received)} from rank 0"
            + (f" and {show_size(from_replicas)} from the other replicas" if from_replicas else ""))


def _share_rank0_spec(model: nn.Module) -> tuple[ModelSpec, LoadCall | None, list[str]]:
    """Rank 0's spec, the load call its model came from, and the tensors it cannot send because
    each rank computes them after the load (DoRA magnitudes), on every rank."""
    described, error = None, None
    if dist.get_rank() == 0:
        described, error = attempt(lambda: (describe(model), dora.pending_names(model)))
    call = model_state.found(model, "load_call") if dist.get_rank() == 0 else None
    message, described, call = broadcast_from_rank0(
        (describe_error(error) if error is not None else None, described, call))
    if message is not None:
        raise RuntimeError(f"rank 0 cannot describe its model: {message}") from error
    spec, computed = described
    return spec, call, computed


def _rank0_source(model: nn.Module, spec: ModelSpec, wanted: set[str],
                  streamed: dict[str, FileTensor]) -> dict[str, torch.Tensor | sharded.FileSlice] | None:
    """On rank 0, its tensors by name (references, not copies) for every spec tensor in `wanted`
    (what some rank gets from rank 0), the ones in `streamed` as `FileSlice`s it reads while it
    sends them; None elsewhere. Raises on every rank if one of them is on meta on rank 0 with no
    file behind it."""
    source, error = None, None
    if dist.get_rank() == 0:

        def collect() -> dict[str, torch.Tensor | sharded.FileSlice]:
            named: dict[str, Any] = {n: t.detach() for n, t in named_tensors(model) if n in wanted}
            dtypes = {t.name: t.dtype for t in spec.tensors}
            staging = sharded.ReadStaging()
            named.update({n: sharded.FileSlice(where, dtypes[n], staging) for n, where in streamed.items() if n in named})
            left = sorted(n for n, t in named.items() if getattr(t, "is_meta", False))
            if left:
                hint = " (not in the checkpoint record either)" if len(wanted) < len(spec.tensors) else ""
                raise RuntimeError(f"rank 0's model has meta tensors, nothing to send{hint}: {left[:20]}")
            return named

        source, error = attempt(collect)
    message = broadcast_from_rank0(describe_error(error) if error is not None else None)
    if message is not None:
        raise RuntimeError(f"rank 0 cannot provide the weights: {message}") from error
    return source


def _devices(model: nn.Module, cpu_offload: bool) -> tuple[torch.device, torch.device]:
    """(parameter device, buffer/communication device), from the DTensor mesh fully_shard used."""
    device_type = next((p.device_mesh.device_type for p in model.parameters() if isinstance(p, DTensor)), None)
    if device_type is None:
        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    if device_type == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device(device_type, torch.get_device_module(device_type).current_device())
    return (torch.device("cpu") if cpu_offload else device), device


def _materialize(model: nn.Module, param_device: torch.device, buffer_device: torch.device) -> None:
    """Allocate uninitialised storage for every meta tensor (FSDP2 re-pads its shards in its own
    `_apply`, so `to_empty` keeps Parameter objects and ties)."""
    model.to_empty(device=param_device)
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != buffer_device:
                module._buffers[name] = torch.empty_like(buf, device=buffer_device)
