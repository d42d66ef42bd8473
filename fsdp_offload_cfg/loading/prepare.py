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
     the mesh device) and rank 0 scatters each tensor's bytes, bucket by bucket, in name order,
     each rank receiving only its own shard, rank 0 freeing each source tensor once sent;
  5. every rank checks nothing is left on meta and ties still hold.
Under "sharded" (a model built by `sharded_from_pretrained`), step 4 is hybrid: tensors in the
checkpoint record are read by each rank from the files (`sharded.py`), non-persistent buffers are
each rank's own, and only the rest is scattered from rank 0.
Each step that can fail on some ranks ends with an all-rank agreement, so failures raise
everywhere at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_offload_cfg.loading import sharded
from fsdp_offload_cfg.loading._sync import (
    attempt,
    broadcast_from_rank0,
    describe_error,
    distributed_ready,
    raise_if_any_failed,
)
from fsdp_offload_cfg.loading.broadcast import TransferStats, scatter_from_rank0
from fsdp_offload_cfg.loading.checkpoint import CHECKPOINT_ATTR
from fsdp_offload_cfg.loading.layout import Target, plan
from fsdp_offload_cfg.loading.meta import release_meta_guards
from fsdp_offload_cfg.loading.pairing import CALL_ATTR, LoadCall, pair_problem, repeat_shift
from fsdp_offload_cfg.loading.spec import (
    ModelSpec,
    TensorSpec,
    describe,
    meta_tensor_names,
    mismatch,
    rebuild_on_meta,
    retie,
)

logger = logging.getLogger("fsdp_offload_cfg.loading")

DEFAULT_BUCKET_BYTES = 32 * 2**20  # per rank and scatter; rank 0 packs world_size times this


@dataclass(frozen=True)
class LoadReport:
    """What one `load_into_sharded` call did on this rank (for logs, tests and benchmarks)."""

    model: nn.Module  # the sharded, filled model: what `shard_fn` returned (or the model itself)
    sent: TransferStats | None  # rank 0's scatter (on rank 0: what it sent; elsewhere: what arrived); None: no scatter ran
    read: sharded.ReadStats | None  # this rank's own reads from the checkpoint; None: it read nothing


def load_into_sharded(
    model: nn.Module,
    shard_fn: Callable[[nn.Module], nn.Module | None],
    *,
    strategy: Literal["broadcast", "sharded"] = "broadcast",
    cpu_offload: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> LoadReport:
    """Shard `model` with `shard_fn` and fill it with its parameters and buffers.

    "broadcast": rank 0 sends every tensor. "sharded": tensors the model's checkpoint record
    covers (it was built by `sharded_from_pretrained`) are read by each rank from the files,
    non-persistent buffers are each rank's own (checked equal to rank 0's), the rest (LoRA
    adapters, keys missing from the checkpoint, everything of a model without a record) comes
    from rank 0 as with "broadcast". A model with a record has no weights on rank 0, so its
    checkpoint tensors are read from the files whatever the strategy.

    Returns a `LoadReport` whose `model` is what `shard_fn` returned (or `model` if it returned
    None). Bit-exact for every tensor whose dtype is unchanged; floats are cast to the sharded
    dtype; other dtypes must match. Without a multi-rank process group this is just `shard_fn(model)`.
    """
    if strategy not in ("broadcast", "sharded"):
        raise ValueError(f"unknown load strategy {strategy!r}; expected 'broadcast' or 'sharded'")
    release_meta_guards(model)
    if not distributed_ready():
        return LoadReport(shard_fn(model) or model, None, None)
    rank, world = dist.get_rank(), dist.get_world_size()

    spec, rank0_call = _share_rank0_spec(model)
    own_call = getattr(model, CALL_ATTR, None)
    problem = pair_problem(own_call, rank0_call, rank) or mismatch(
        spec, describe(model), what=f"rank {rank}'s model does not match rank 0's")
    raise_if_any_failed(_error(problem), "matching this rank's model with rank 0's")
    if repeat_shift(own_call, rank0_call):
        logger.warning("rank %d prepares its load #%d of %s, rank 0 its load #%d of the same call: rank 0 made it "
                       "alone before (load such copies inside `fsdp_offload_cfg.local_loading()`); the weights come "
                       "from rank 0's prepared model", rank, own_call.repeat + 1, own_call.description,
                       rank0_call.repeat + 1)  # fmt: skip
    sources = sharded.agree_sources(model, spec)
    if strategy == "sharded" and not sources.files and rank == 0:
        logger.info("sharded loading: the model has no checkpoint record; every tensor comes from rank 0")
    source = _rank0_source(model, spec, skip=sources.names())

    rebuild_on_meta(model, spec)
    sharded_model, error = attempt(lambda: shard_fn(model) or model)
    raise_if_any_failed(error, "sharding the model (shard_fn)")

    def materialize() -> list[Target]:
        problem = mismatch(spec, describe(sharded_model), what="sharded model", check_dtype=True)
        if problem is not None:
            raise RuntimeError(problem)
        _materialize(sharded_model, *_devices(sharded_model, cpu_offload))
        retie(sharded_model, spec)
        return plan(sharded_model, spec, rank, world)

    targets, error = attempt(materialize)
    raise_if_any_failed(error, "allocating the sharded model")

    read_stats, error = attempt(lambda: sharded.fill_own(targets, sources, rank, bucket_bytes))
    raise_if_any_failed(error, "reading this rank's shards from the checkpoint")
    from_rank0 = [t for t in targets if t.spec.name not in sources.names()]
    device = _devices(sharded_model, cpu_offload)[1]
    stats = scatter_from_rank0(from_rank0, source, device=device, bucket_bytes=bucket_bytes)
    _log(stats, read_stats, world)

    left = meta_tensor_names(sharded_model)
    problem = f"still on meta after loading: {left}" if left else None
    problem = problem or mismatch(spec, describe(sharded_model), what="after loading", check_dtype=True)
    raise_if_any_failed(_error(problem), "checking the loaded model")
    for module in sharded_model.modules():  # the record points at meta tensors that are gone now
        module.__dict__.pop(CHECKPOINT_ATTR, None)
    return LoadReport(sharded_model, stats, read_stats)


def _log(stats: TransferStats, read: sharded.ReadStats | None, world: int) -> None:
    if dist.get_rank() != 0:
        return
    if read is not None:
        logger.info(
            "sharded loading: rank 0 read %d tensors (%.2f GiB, %d reads) from %d files in %.2fs",
            read.tensors, read.bytes_read / 2**30, read.reads, len(read.files), read.seconds,
        )  # fmt: skip
    if stats.tensors:
        logger.info(
            "rank-0 loading: sent %d tensors (%.2f GiB to %d ranks) in %d buckets in %.2fs",
            stats.tensors, stats.bytes_sent / 2**30, world - 1, stats.buckets, stats.seconds,
        )  # fmt: skip


def _error(problem: str | None) -> BaseException | None:
    return RuntimeError(problem) if problem is not None else None


def _share_rank0_spec(model: nn.Module) -> tuple[ModelSpec, LoadCall | None]:
    """Rank 0's spec, and the load call its model came from, on every rank."""
    spec, error = None, None
    if dist.get_rank() == 0:
        spec, error = attempt(lambda: describe(model))
    call = getattr(model, CALL_ATTR, None) if dist.get_rank() == 0 else None
    message, spec, call = broadcast_from_rank0((describe_error(error) if error is not None else None, spec, call))
    if message is not None:
        raise RuntimeError(f"rank 0 cannot describe its model: {message}") from error
    return spec, call


def _rank0_source(model: nn.Module, spec: ModelSpec, skip: set[str]) -> dict[str, torch.Tensor] | None:
    """On rank 0, its tensors by name (references, not copies) for every spec tensor not in `skip`
    (those are read from the files or computed locally); None elsewhere. Raises on every rank if
    one of them is on meta on rank 0."""
    source, error = None, None
    if dist.get_rank() == 0:

        def collect() -> dict[str, torch.Tensor]:
            wanted = {t.name for t in spec.tensors} - skip
            on_meta = {t.name for t in spec.tensors if t.name in wanted and _get(model, t).is_meta}
            sharded.init_meta_adapters(model, on_meta)
            named = {n: t.detach() for n, t in [*model.named_parameters(), *model.named_buffers()] if n in wanted}
            left = sorted(n for n, t in named.items() if t.is_meta)
            if left:
                hint = " (not in the checkpoint record either)" if skip else ""
                raise RuntimeError(f"rank 0's model has meta tensors, nothing to send{hint}: {left[:20]}")
            return named

        source, error = attempt(collect)
    message = broadcast_from_rank0(describe_error(error) if error is not None else None)
    if message is not None:
        raise RuntimeError(f"rank 0 cannot provide the weights: {message}") from error
    return source


def _get(model: nn.Module, t: TensorSpec) -> torch.Tensor:
    return model.get_parameter(t.name) if t.is_param else model.get_buffer(t.name)


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
