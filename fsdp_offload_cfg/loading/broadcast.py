"""Strategy "broadcast": rank 0 sends every rank its own part of each tensor, in byte buckets.

Why scatter, not broadcast: a rank receives only the rows it keeps (plus the small replicated
tensors: buffers, unsharded params), so no rank ever holds a full copy of a sharded tensor, and
rank 0 sends each byte once. Why bytes: a bucket mixes dtypes (bf16 weights, fp32 norms, int64
and bool buffers); packing raw bytes keeps every value bit-exact, never float-casts an integer,
and avoids backend dtype gaps (gloo and bf16/bool). The receiver casts floats to the sharded
parameter's dtype while copying (bf16 checkpoint -> fp32 master weights).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fsdp_offload_cfg._logging import get_logger
from fsdp_offload_cfg.loading.layout import Target
from fsdp_offload_cfg.loading.progress import Progress
from fsdp_offload_cfg.ranks import agreed, attempt, describe_error, raise_if_any_failed

logger = get_logger("fsdp_offload_cfg.loading")

ALIGN = 16  # byte offset of every tensor in a bucket: viewing bytes as any dtype needs alignment
HEADER = ALIGN  # each rank's part of a bucket starts with it; byte 0: 1 if rank 0 could not pack the bucket


@dataclass
class TransferStats:
    tensors: int = 0
    bytes_sent: int = 0  # by rank 0, summed over destination ranks
    buckets: int = 0
    seconds: float = 0.0


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def buckets(targets: list[Target], bucket_bytes: int, rank: int = 0) -> list[list[Target]]:
    """Consecutive targets whose largest per-rank parts add up to at most `bucket_bytes` (what
    one rank receives per scatter); a tensor larger than that is split into blocks first."""
    out: list[list[Target]] = []
    size = 0
    for t in (block for target in targets for block in target.split(bucket_bytes, rank)):
        if out and size + t.max_part_nbytes <= bucket_bytes:
            out[-1].append(t)
            size += t.max_part_nbytes
        else:
            out.append([t])
            size = t.max_part_nbytes
    return out


def _offsets(bucket: list[Target], rank: int) -> tuple[list[int], int]:
    offsets, pos = [], HEADER
    for t in bucket:
        offsets.append(pos)
        pos += _aligned(t.nbytes_on(rank))
    return offsets, pos


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _check_source(targets: list[Target], source: dict[str, torch.Tensor] | None) -> None:
    """Rank 0: every tensor to send is there, with the dtype and shape it was described with."""
    problems = []
    for name, spec in {t.spec.name: t.spec for t in targets}.items():
        full = (source or {}).get(name)
        if full is None:
            problems.append(f"{name}: missing")
        elif full.dtype != spec.dtype or tuple(full.shape) != spec.shape:
            problems.append(f"{name}: changed since it was described (was {spec.dtype} {spec.shape}, "
                            f"now {full.dtype} {tuple(full.shape)})")  # fmt: skip
    if problems:
        raise RuntimeError(f"rank 0 cannot send {len(problems)} tensors: " + "; ".join(problems[:5]))


def _allocate_staging(nbytes: int, destinations: int, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One receive buffer, and (rank 0) one send buffer per destination rank, reused by every
    bucket: no allocation churn, so the allocator cannot keep freed bucket memory resident."""
    staging = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return staging, [torch.empty_like(staging) for _ in range(destinations)]


def _pack(bucket: list[Target], source: dict[str, torch.Tensor], buffers: list[torch.Tensor]) -> None:
    """Rank 0: write each destination rank's parts into its byte buffer (`_check_source` ran),
    then drop each source tensor whose last part this was (its memory is freed now)."""
    offsets = [_offsets(bucket, rank)[0] for rank in range(len(buffers))]
    for i, t in enumerate(bucket):
        full = source[t.spec.name]
        read_into = getattr(full, "read_into", None)  # a file slice (streamed broadcast) reads in place
        for rank, buffer in enumerate(buffers):
            dest = buffer[offsets[rank][i] : offsets[rank][i] + t.nbytes_on(rank)]
            if read_into is not None:
                read_into(t.regions[rank], dest)
            else:
                dest.copy_(_as_bytes(full[t.regions[rank]]))
    for t in bucket:
        if t.last:
            del source[t.spec.name]  # rank 0's last reference


def _unpack(bucket: list[Target], received: torch.Tensor, rank: int) -> None:
    """Copy this rank's parts out of the received bytes into its shards (floats cast to the
    shard's dtype: a bf16 checkpoint into fp32 master weights)."""
    for t, offset in zip(bucket, _offsets(bucket, rank)[0]):
        raw = received[offset : offset + t.nbytes_on(rank)]
        t.dest.copy_(raw.view(t.spec.dtype).view(t.dest.shape))


def _in_bucket(k: int, n: int, step: Callable[..., None], *args: Any) -> BaseException | None:
    """Run one rank's part of bucket `k`, `step(*args)`; its failure (named with the bucket), or None."""
    _, error = attempt(lambda: step(*args))
    if error is None:
        return None
    failure = RuntimeError(f"bucket {k + 1}/{n}: {describe_error(error)}")
    failure.__cause__ = error
    return failure


@torch.no_grad()
def scatter_from_rank0(
    targets: list[Target], source: dict[str, torch.Tensor] | None, *, device: torch.device, bucket_bytes: int
) -> TransferStats:
    """Fill every target from rank 0's `source` (full tensors by name; None on other ranks).

    `source` is emptied as it goes, so rank 0's copy of the model shrinks while it is sent. Peak
    transient memory per rank: one staging buffer of its part of a bucket (rank 0: one per
    destination rank, about one bucket in all when tensors are sharded).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    stats = TransferStats()
    start = time.perf_counter()
    plan = buckets(targets, bucket_bytes, rank)
    sizes = [max(_offsets(bucket, r)[1] for r in range(world)) for bucket in plan]

    # Everything that can fail on one rank alone happens here, agreed before the first scatter:
    # a rank raising inside the loop would leave the others waiting in `dist.scatter`.
    def get_ready() -> tuple[torch.Tensor, list[torch.Tensor]]:
        if rank == 0:
            _check_source(targets, source)
        return _allocate_staging(max(sizes, default=0), world if rank == 0 else 0, device)

    staging, outgoing = agreed("getting ready to receive from rank 0 (checking its tensors, allocating staging)",
                               get_ready)
    # Inside the loop no rank raises alone: a rank that fails keeps taking part in every scatter
    # (doing no more work) and all ranks agree after the loop. Rank 0's failure stops everyone at
    # once through the header byte of the bucket it could not pack.
    failure: BaseException | None = None  # this rank's first failure in the loop
    total = sum(t.nbytes_on(r) for t in targets for r in range(1, world))
    progress = Progress(total if rank == 0 else 0, f"rank 0 sending to {world - 1} ranks")
    for k, (bucket, size) in enumerate(zip(plan, sizes)):
        received = staging[:size]
        packed = None
        if rank == 0:
            packed = [buffer[:size] for buffer in outgoing]
            failure = failure or _in_bucket(k, len(plan), _pack, bucket, source, packed)
            for buffer in packed:
                buffer[0] = 0 if failure is None else 1
        dist.scatter(received, packed, src=0)
        if received[0].item() != 0:
            break
        failure = failure or _in_bucket(k, len(plan), _unpack, bucket, received, rank)
        sent = sum(t.nbytes_on(r) for t in bucket for r in range(1, world))
        stats.tensors += sum(t.last for t in bucket)
        stats.bytes_sent += sent
        stats.buckets += 1
        progress.update(sent, sum(t.last for t in bucket))  # a bar on a terminal; the caller logs the summary
    progress.close()
    raise_if_any_failed(failure, "receiving the weights from rank 0 (bucket by bucket)")
    stats.seconds = time.perf_counter() - start
    return stats
