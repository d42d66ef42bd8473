"""Strategy "broadcast": rank 0 sends every rank its own part of each tensor, in byte buckets.

Why point-to-point sends, not `dist.broadcast` or `dist.scatter`: a rank receives only the rows
it keeps (plus the small replicated tensors: buffers, unsharded params), so no rank ever holds
a full copy of a sharded tensor and rank 0 sends each byte once; and a rank that reads a tensor
from the files itself (`auto` on a node that has the checkpoint) receives nothing for it, where a
scatter sends every rank an equal-sized buffer. So `auto` at node scale streams only to the node
that cannot read (`Target.to` names the receiving ranks). Each rank knows from the layout alone
which buckets hold a part for it, and takes part in those only.
Why bytes: a bucket mixes dtypes (bf16 weights, fp32 norms, int64 and bool buffers); packing raw
bytes keeps every value bit-exact, never float-casts an integer, and avoids backend dtype gaps
(gloo and bf16/bool). The receiver casts floats to the sharded parameter's dtype while copying
(bf16 checkpoint -> fp32 master weights).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fsdp_offload_cfg._logging import get_logger
from fsdp_offload_cfg.loading.layout import Region, Target
from fsdp_offload_cfg.loading.progress import Progress
from fsdp_offload_cfg.ranks import agreed, attempt, describe_error, raise_if_any_failed

logger = get_logger("fsdp_offload_cfg.loading")

ALIGN = 16  # byte offset of every tensor in a bucket: viewing bytes as any dtype needs alignment
HEADER = ALIGN  # each rank's message for a bucket starts with it; byte 0: 1 if rank 0 could not pack the bucket


@dataclass
class TransferStats:
    tensors: int = 0
    bytes_received: int = 0  # this rank's parts that came over the network (rank 0: none)
    bytes_to: dict[int, int] = field(default_factory=dict)  # rank 0: bytes sent to each rank
    bytes_read: int = 0  # rank 0: checkpoint bytes it read from the files to send (streamed)
    buckets: int = 0  # buckets this rank took part in
    seconds: float = 0.0

    @property
    def bytes_sent(self) -> int:
        """Rank 0: bytes sent over the network, summed over the ranks (its own part not counted)."""
        return sum(self.bytes_to.values())


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def buckets(targets: list[Target], bucket_bytes: int, rank: int = 0) -> list[list[Target]]:
    """Consecutive targets whose largest per-rank parts add up to at most `bucket_bytes` (what
    one rank receives per message); a tensor larger than that is split into blocks first."""
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
    """Where each of `rank`'s parts starts in its message for `bucket`, and the message's size
    (0: no part of this bucket goes to `rank`, which then takes no part in it)."""
    offsets, pos = [], HEADER
    for t in bucket:
        offsets.append(pos)
        pos += _aligned(t.sent_nbytes(rank))
    return offsets, (pos if pos > HEADER else 0)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as a flat uint8 tensor (a view where `t` is contiguous)."""
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


def _allocate_staging(sizes: list[list[int]], rank: int, world: int,
                      device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The buffers every bucket reuses, each sized to its largest message: one receive buffer on
    a rank other than 0; on rank 0, one send buffer per rank (its own part included). No
    allocation churn, so the allocator cannot keep freed bucket memory resident."""
    def largest(r: int) -> int:
        return max((row[r] for row in sizes), default=0)

    def buffer(r: int) -> torch.Tensor:
        return torch.empty(largest(r), dtype=torch.uint8, device=device)

    if rank == 0:
        return torch.empty(0, dtype=torch.uint8, device=device), [buffer(r) for r in range(world)]
    return buffer(rank), []


def _pack(bucket: list[Target], source: dict[str, torch.Tensor], messages: dict[int, torch.Tensor]) -> int:
    """Rank 0: write each receiving rank's parts into its message (`_check_source` ran), then
    drop each source tensor whose last part this was (its memory is freed now). Returns the
    checkpoint bytes read for it (parts of streamed tensors).

    A part another rank of this bucket gets too (HSDP: the same slice on every replica) is read
    once and copied from the first message that holds it: it was read once per replica."""
    read = 0
    packed: list[list[tuple[Region, torch.Tensor]]] = [[] for _ in bucket]  # per target: parts already packed
    for rank, message in messages.items():
        for i, (t, offset) in enumerate(zip(bucket, _offsets(bucket, rank)[0])):
            if not t.sent_nbytes(rank):
                continue
            region = t.regions[rank]
            dest = message[offset : offset + t.nbytes_on(rank)]
            same = next((bytes_ for r, bytes_ in packed[i] if r == region), None)
            full = source[t.spec.name]
            read_into = getattr(full, "read_into", None)  # a file slice (streamed) reads in place
            if same is not None:
                dest.copy_(same)
            elif read_into is not None:
                read += read_into(region, dest)
            else:
                dest.copy_(as_bytes(full[region]))
            packed[i].append((region, dest))
        message[0] = 0
    for t in bucket:
        if t.last:
            source.pop(t.spec.name, None)  # rank 0's last reference
    return read


def _unpack(bucket: list[Target], received: torch.Tensor, rank: int) -> None:
    """Copy this rank's parts out of the received bytes into its shards (floats cast to the
    shard's dtype: a bf16 checkpoint into fp32 master weights)."""
    for t, offset in zip(bucket, _offsets(bucket, rank)[0]):
        if t.sent_nbytes(rank):
            raw = received[offset : offset + t.nbytes_on(rank)]
            t.dest.copy_(raw.view(t.spec.dtype).view(t.dest.shape))


def _in_bucket(k: int, n: int, step: Callable[..., Any], *args: Any) -> tuple[Any, BaseException | None]:
    """Run one rank's part of bucket `k`, `step(*args)`: (its result, None), or (None, its
    failure named with the bucket)."""
    result, error = attempt(lambda: step(*args))
    if error is None:
        return result, None
    failure = RuntimeError(f"bucket {k + 1}/{n}: {describe_error(error)}")
    failure.__cause__ = error
    return None, failure


@torch.no_grad()
def send_from_rank0(
    targets: list[Target], source: dict[str, torch.Tensor] | None, *, device: torch.device, bucket_bytes: int
) -> TransferStats:
    """Fill every target from rank 0's `source` (full tensors by name; None on other ranks), on
    the ranks each target's `to` names (every rank when None).

    `source` is emptied as it goes, so rank 0's copy of the model shrinks while it is sent. Peak
    transient memory per rank: one buffer of its part of a bucket (rank 0: one per rank, about
    one bucket in all when tensors are sharded).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = buckets(targets, bucket_bytes, rank)
    sizes = [[_offsets(bucket, r)[1] for r in range(world)] for bucket in plan]  # sizes[k][r]: r's message

    # Everything that can fail on one rank alone happens here, agreed before the first message:
    # a rank raising inside the loop would leave rank 0 waiting in a send, or a rank in a receive.
    def get_ready() -> tuple[torch.Tensor, list[torch.Tensor]]:
        if rank == 0:
            _check_source(targets, source)
        return _allocate_staging(sizes, rank, world, device)

    staging, outgoing = agreed("getting ready to receive from rank 0 (checking its tensors, allocating staging)",
                               get_ready)
    start = time.perf_counter()
    if rank == 0:
        stats, failure = _send(plan, sizes, source, outgoing)
    else:
        stats, failure = _receive(plan, sizes, staging, rank)
    raise_if_any_failed(failure, "receiving the weights from rank 0 (bucket by bucket)")
    stats.seconds = time.perf_counter() - start
    return stats


def _send(plan: list[list[Target]], sizes: list[list[int]], source: dict[str, torch.Tensor],
          outgoing: list[torch.Tensor]) -> tuple[TransferStats, BaseException | None]:
    """Rank 0's loop: pack each bucket, send every receiving rank its message, keep its own part.

    No rank raises alone inside the loop. When rank 0 fails (it cannot read or pack a bucket), it
    sends every rank still waiting for a bucket that rank's next message with its header byte set,
    so every rank stops at once and all agree after the loop."""
    stats, failure = TransferStats(), None
    world = len(outgoing)
    progress = Progress(sum(sum(row[1:]) for row in sizes), f"rank 0 sending to {world - 1} ranks")
    for k, (bucket, row) in enumerate(zip(plan, sizes)):
        messages = {r: outgoing[r][:size] for r, size in enumerate(row) if size}
        if failure is None:
            read, failure = _in_bucket(k, len(plan), _pack, bucket, source, messages)
            stats.bytes_read += read or 0
        if failure is not None:
            _stop_the_waiting(sizes[k:], outgoing)
            break
        works = _exchange([dist.P2POp(dist.isend, message, r) for r, message in messages.items() if r != 0])
        if 0 in messages:  # rank 0's own part (a tensor real on rank 0 only, or every tensor under broadcast)
            _, failure = _in_bucket(k, len(plan), _unpack, bucket, messages[0], 0)
        for work in works:
            work.wait()
        for r in messages.keys() - {0}:
            stats.bytes_to[r] = stats.bytes_to.get(r, 0) + sum(t.sent_nbytes(r) for t in bucket)
        stats.tensors += sum(t.last for t in bucket)
        stats.buckets += 1
        progress.update(sum(row[1:]), sum(t.last for t in bucket))  # a bar on a terminal; the caller logs the summary
    progress.close()
    return stats, failure


def _exchange(ops: list[dist.P2POp]) -> list[Any]:
    """Start `ops`; their works. Both ends go through `batch_isend_irecv`, even for one op: NCCL
    runs a batch on the process group's own communicator but a lone `send`/`recv` on a
    communicator made for that pair of ranks, so mixing the two would leave a send and its
    receive on different communicators, waiting for each other forever."""
    return dist.batch_isend_irecv(ops) if ops else []


def _stop_the_waiting(sizes: list[list[int]], outgoing: list[torch.Tensor]) -> None:
    """Rank 0 failed at the first bucket of `sizes`: each rank still expecting a message gets its
    next one (the size it expects) with the header byte set, and stops receiving."""
    for r in range(1, len(outgoing)):
        size = next((row[r] for row in sizes if row[r]), 0)
        if size:
            message = outgoing[r][:size]
            message[0] = 1
            for work in _exchange([dist.P2POp(dist.isend, message, r)]):
                work.wait()


def _receive(plan: list[list[Target]], sizes: list[list[int]], staging: torch.Tensor,
             rank: int) -> tuple[TransferStats, BaseException | None]:
    """A rank's loop: receive each bucket that holds a part for it (and only those) and unpack it.
    A rank that fails to unpack keeps receiving (doing no more work) so rank 0 is never left
    waiting in a send; every rank agrees after the loop."""
    stats, failure = TransferStats(), None
    for k, (bucket, row) in enumerate(zip(plan, sizes)):
        if not row[rank]:
            continue
        received = staging[: row[rank]]
        for work in _exchange([dist.P2POp(dist.irecv, received, 0)]):
            work.wait()
        if received[0].item() != 0:
            break
        if failure is None:
            _, failure = _in_bucket(k, len(plan), _unpack, bucket, received, rank)
        stats.bytes_received += sum(t.sent_nbytes(rank) for t in bucket)
        stats.tensors += sum(t.last for t in bucket if t.sent_nbytes(rank))
        stats.buckets += 1
    return stats, failure
