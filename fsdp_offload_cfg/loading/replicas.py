"""Under hybrid sharding (HSDP: FSDP2 on a 2-D mesh, placements `(Replicate(), Shard(0))`, as
accelerate builds it for `parallelism_config` `dp_replicate_size` > 1) read each checkpoint byte
once across the job, not once per replica.

Every rank of a replica group holds the same slice of each tensor. Reading it on each of them
multiplies the bytes read by the number of replicas: the replicas are usually nodes, so every
node reads the whole checkpoint from shared storage, the load users report as many times slower
than their filesystem allows (transformers #48239). Here the copies of a slice split the reading
between the nodes they span: the tensors are cut into as many consecutive runs of about equal
bytes as there are such nodes, one rank of the group on node k reads run k, and each run is
broadcast within the replica group, bucket by bucket. Storage sees each byte once; the network
carries what the replicas share (over the data-parallel interconnect, built for that, rather
than the storage's). Copies on one node read their slices each, from the page cache they share.

Taken only where it holds for every copy: a tensor every rank of the job reads itself (under
`auto`, a node without the files gets its slices from rank 0 instead, as before), placed on one
`Replicate` mesh dim. Every rank computes the same assignment from the layouts and the agreed
sources alone (no communication), and every rank of a replica group makes the same broadcasts in
the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_offload_cfg.loading.broadcast import as_bytes
from fsdp_offload_cfg.loading.layout import Copies, Target


@dataclass(frozen=True)
class Share:
    """One tensor's slice: read by `reader`, broadcast to the other ranks of `target.copies`."""

    target: Target
    reader: int  # global rank


def assign_readers(targets: list[Target], readers: dict[str, frozenset[int]], nodes: tuple[str, ...]) -> list[Share]:
    """Which replica reads which tensor: the tensors every rank reads and whose copies span nodes,
    in spec order, cut into one run of about equal bytes per node, read by the first rank of its
    replica group on that node. The same on every rank of a replica group (its ranks hold slices
    of the same sizes). Copies on one node are not split: their ranks share the node's page
    cache, so the storage serves the bytes once anyway, and a read from it is faster than any
    broadcast (docs/benchmarks.md)."""
    everyone = frozenset(range(len(nodes)))
    spread = [(t, _node_readers(t.copies, nodes)) for t in targets
              if t.copies is not None and readers.get(t.spec.name) == everyone]
    spread = [(t, node_readers) for t, node_readers in spread if len(node_readers) > 1]
    total = sum(t.dest.numel() * t.dest.element_size() for t, _ in spread)
    shares, before = [], 0
    for t, node_readers in spread:
        index = min(len(node_readers) - 1, before * len(node_readers) // total) if total else 0
        shares.append(Share(t, node_readers[index]))
        before += t.dest.numel() * t.dest.element_size()
    return shares


def _node_readers(copies: Copies, nodes: tuple[str, ...]) -> tuple[int, ...]:
    """The first rank of `copies` on each node they span, in replica order."""
    first: dict[str, int] = {}
    for r in copies.ranks:
        first.setdefault(nodes[r], r)
    return tuple(first.values())


Bucket = tuple[int, dist.ProcessGroup, list[torch.Tensor]]  # (reader, replica group, destinations)


@dataclass(frozen=True)
class Broadcasts:
    """A rank's broadcasts between replicas and the one buffer they pass through."""

    buckets: list[Bucket]
    staging: torch.Tensor  # bytes on the communication device, for every bucket not sent in place


def plan_broadcasts(shares: list[Share], rank: int, device: torch.device, bucket_bytes: int) -> Broadcasts:
    """The buckets (consecutive slices with the same reader, large ones cut into row blocks, about
    `bucket_bytes` each) and their staging buffer, allocated here, before any broadcast: a rank
    that cannot allocate it fails in the step that agrees on it (the read), not halfway through
    the broadcasts with its replicas waiting in one."""
    buckets = _buckets(shares, rank, bucket_bytes)
    staged = [_nbytes(dests) for _, _, dests in buckets if not _in_place(dests, device)]
    return Broadcasts(buckets, torch.empty(max(staged, default=0), dtype=torch.uint8, device=device))


@torch.no_grad()
def broadcast_shares(broadcasts: Broadcasts, rank: int, device: torch.device) -> int:
    """Each reader's slices to the rest of its replica group: a slice alone that lives contiguously
    on the communication device in place, the others packed as bytes into the staging buffer.
    Returns the bytes this rank received."""
    received = 0
    for reader, group, dests in broadcasts.buckets:
        if _in_place(dests, device):
            dist.broadcast(as_bytes(dests[0]), src=reader, group=group)
        else:
            buffer = broadcasts.staging[:_nbytes(dests)]
            if rank == reader:
                _copy_through(dests, buffer, pack=True)
            dist.broadcast(buffer, src=reader, group=group)
            if rank != reader:
                _copy_through(dests, buffer, pack=False)
        if rank != reader:
            received += _nbytes(dests)
    return received


def _in_place(dests: list[torch.Tensor], device: torch.device) -> bool:
    return len(dests) == 1 and dests[0].device == device and dests[0].is_contiguous()


def _nbytes(dests: list[torch.Tensor]) -> int:
    return sum(d.numel() * d.element_size() for d in dests)


def _copy_through(dests: list[torch.Tensor], buffer: torch.Tensor, pack: bool) -> None:
    """`dests` into the byte buffer one after another (`pack`), or back out of it."""
    offset = 0
    for d in dests:
        part = buffer[offset:offset + d.numel() * d.element_size()]
        if pack:
            part.copy_(as_bytes(d))
        else:
            d.copy_(part.view(d.dtype).view(d.shape))
        offset += part.numel()


def _buckets(shares: list[Share], rank: int, bucket_bytes: int) -> list[Bucket]:
    """One per broadcast: consecutive slices with the same reader, large ones cut into row blocks,
    up to about `bucket_bytes` each."""
    out: list[Bucket] = []
    size = 0
    for share in shares:
        for block in share.target.split(max(1, bucket_bytes), rank):
            dest = block.dest
            nbytes = dest.numel() * dest.element_size()
            if nbytes == 0:
                continue
            group = share.target.copies.group
            if not out or out[-1][:2] != (share.reader, group) or size + nbytes > bucket_bytes:
                out.append((share.reader, group, []))
                size = 0
            out[-1][2].append(dest)
            size += nbytes
    return out

