"""Strategy "sharded": every rank reads only its own slices from the safetensors files, so no
rank ever holds the full model and no weight crosses the network.

Where each tensor comes from (decided from one `all_gather` of every rank's view):
  - file:  this rank's model records the same checkpoint tensor as rank 0's
           (`checkpoint.CheckpointRecord`: built by `sharded_from_pretrained`): this rank reads
           `Target.regions[rank]` itself;
  - streamed: rank 0's model records it, this rank's does not (it was built from rank 0's
           description: under "broadcast", or under "auto" on a node that cannot read the files):
           rank 0 reads this rank's region while it sends it (`FileSlice`), bucket by bucket, to
           the ranks that cannot read it only. So under "auto" each checkpoint byte is read once
           across the job, by the node that has the files, and crosses the network only to a
           node that has not;
  - local: a non-persistent buffer every rank computed itself in `from_pretrained` (RoPE
           `inv_freq`, ...): each rank keeps its own, after checking its checksum equals rank 0's;
  - own:   a tensor real on every rank that no file backs (LoRA adapters, which stay on the
           host with the values PEFT drew: `adapters.py`; keys missing from the checkpoint,
           initialised on every rank): each rank copies its own region of its own tensor, as
           FSDP2 shards each rank's own model in a plain run (so a framework that seeds each rank
           differently, like ms-swift's seed + rank, gets what its plain run gets);
  - rank 0: anything else (a tensor real on rank 0 only, e.g. resized embeddings; every tensor
           of a model without a record): sent by the broadcast strategy's transfer.

The reader (`read_own_shards`) sorts the reads by file and byte offset (sequential, page-cache
friendly), splits large parts into blocks of at most `bucket_bytes`, and reads a contiguous
region (FSDP2's dim-0 shards always are) with `os.preadv` straight into the destination when
the dtype matches, else into one reused staging buffer that `copy_` converts from. Why not
mmap (`safe_open`): pages of a mapped file count in the reader's RSS while mapped; `pread`
goes through the page cache without that, and allocates nothing per tensor. Why not keep the
shards as views of a private mapping, as transformers' own FSDP2 load does: the copy then
happens at the first write, a copy-on-write fault per page, which costs about 3x a `pread` into
new pages (docs/benchmarks.md), and a page never written (a frozen weight) follows any later
change to the checkpoint file. Non-contiguous regions (not produced by FSDP2's default
placements) use `safe_open(...).get_slice(key)[region]`. A model tensor that transformers builds
from several checkpoint tensors (MoE experts stacked on load) is read from each of them in turn,
by the same reads (`file_reads.py`): a rank reads only its own experts.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fsdp_offload_cfg._logging import get_logger
from fsdp_offload_cfg.loading.checkpoint import record_of
from fsdp_offload_cfg.loading.file_reads import OpenFiles, as_bytes, file_range, read_range, read_region
from fsdp_offload_cfg.loading.layout import Region, Target
from fsdp_offload_cfg.loading.progress import Progress
from fsdp_offload_cfg.loading.spec import ModelSpec, TensorSpec, owner, tensor_at
from fsdp_offload_cfg.ranks import attempt, node_name, raise_if_any_failed
from fsdp_offload_cfg.safetensors_index import FileTensor, converted, rows_view

logger = get_logger("fsdp_offload_cfg.loading")


@dataclass
class Sources:
    """Where every tensor comes from. `files`: what this rank reads itself; `streamed`: on rank 0,
    what it reads for the ranks that cannot; the rest is the same on every rank."""

    files: dict[str, FileTensor] = field(default_factory=dict)
    local: dict[str, torch.Tensor] = field(default_factory=dict)
    streamed: dict[str, FileTensor] = field(default_factory=dict)  # rank 0 only; sent to the ranks that cannot read
    # real on every rank and backed by no file (PEFT adapters, heads each rank drew): each rank
    # shards its own copy, as FSDP2 does with a plain model on every rank
    own: dict[str, torch.Tensor] = field(default_factory=dict)
    # per tensor of rank 0's checkpoint record: the ranks whose own record maps it to the same
    # checkpoint tensor, which read it themselves (every rank on shared storage; a node without
    # the files, none of its ranks)
    readers: dict[str, frozenset[int]] = field(default_factory=dict)
    # each rank's node (`ranks.node_name`): for the log of who got what, and which replicas split reads
    nodes: tuple[str, ...] = ()

    def filled_everywhere(self) -> set[str]:
        """What every rank fills itself, from no file (the same names on every rank)."""
        return set(self.local) | set(self.own)

    def receivers(self, name: str, world: int) -> frozenset[int]:
        """The ranks rank 0 sends `name` to: every rank that does not read it itself."""
        return frozenset(range(world)) - self.readers.get(name, frozenset())


@dataclass
class ReadStats:
    """What this rank read (for logs, tests and the benchmark)."""

    tensors: int = 0
    reads: int = 0
    bytes_read: int = 0
    largest_read: int = 0  # bytes of the largest single read: bounded by about one bucket
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _tensor(model: nn.Module, t: TensorSpec) -> torch.Tensor:
    return tensor_at(model, t.name, t.is_param)


def _non_persistent(model: nn.Module, name: str) -> bool:
    module, attr = owner(model, name)
    return attr in module._non_persistent_buffers_set


def digest(t: torch.Tensor) -> str:
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{t.dtype}{tuple(t.shape)}:{hashlib.sha256(data).hexdigest()}"


def _own_sources(model: nn.Module, spec: ModelSpec) -> tuple[bool, Sources, dict[str, str]]:
    """This rank's view: (has a record, sources, checksum of each local buffer). No collectives."""
    record = record_of(model)
    sources = Sources()
    for t in spec.tensors:
        tensor = _tensor(model, t)
        where = record.lookup(tensor) if record is not None else None
        if record is None:
            if not tensor.is_meta:
                sources.own[t.name] = tensor
        elif where is not None:
            sources.files[t.name] = where
        elif not t.is_param and not tensor.is_meta and _non_persistent(model, t.name):
            sources.local[t.name] = tensor
        elif not tensor.is_meta:
            sources.own[t.name] = tensor
    return record is not None, sources, {n: digest(v) for n, v in sources.local.items()}


def agree_sources(model: nn.Module, spec: ModelSpec) -> Sources:
    """Where every tensor comes from (see the module docstring), from one `all_gather` of every
    rank's view: `readers`, `nodes` and the names of `local` and `own` come out the same on every
    rank.

    Raises on every rank if a non-persistent buffer computed on some rank differs from rank 0's
    (named, with the ranks).
    """
    mine, error = attempt(lambda: _own_sources(model, spec))
    raise_if_any_failed(error, "finding each tensor in the checkpoint record")
    has_record, sources, checksums = mine
    summary = [(n, f.key, f.shape, str(f.dtype), f.offset) for n, f in sorted(sources.files.items())]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (has_record, summary, checksums, sorted(sources.own), node_name()))
    nodes = tuple(g[4] for g in gathered)
    own = set.intersection(*(set(g[3]) for g in gathered))
    own_sources = {n: v for n, v in sources.own.items() if n in own}
    if not gathered[0][0]:  # rank 0 has no record: every tensor comes from rank 0 but what all hold
        return Sources(own=own_sources, nodes=nodes)
    # Rank 0's record decides what is in the checkpoint. A rank reads a tensor itself where its
    # own record maps it to the same checkpoint tensor; rank 0 reads and sends it to the others (a
    # rank built from rank 0's description has no record: a node without the files; a rank that
    # filled some tensors before prepare no longer maps them).
    held = [set(g[1]) if g[0] else set() for g in gathered]
    readers = {entry[0]: frozenset(r for r, entries in enumerate(held) if entry in entries) for entry in gathered[0][1]}
    rank, world = dist.get_rank(), dist.get_world_size()
    files = {n: f for n, f in sources.files.items() if rank in readers.get(n, ())}
    streamed = {n: f for n, f in sources.files.items() if len(readers[n]) < world} if rank == 0 else {}
    problems = []
    local = set(gathered[0][2]).intersection(*(g[2] for g in gathered))
    for name in sorted(local):
        differ = [r for r, g in enumerate(gathered) if g[2][name] != gathered[0][2][name]]
        if differ:
            problems.append(f"non-persistent buffer {name} computed on ranks {differ} differs from rank 0's")
    if problems:
        raise RuntimeError("sharded loading: " + "; ".join(problems))
    # a buffer computed on rank 0 but left on meta elsewhere still comes from rank 0; so does a
    # tensor real on rank 0 only (a resize on rank 0, a base read whole for an adapter)
    return Sources(files, {n: v for n, v in sources.local.items() if n in local}, streamed, own_sources,
                   readers, nodes)


# ------------------------------------------------------------------------------------ the reader


@torch.no_grad()
def fill_own(targets: list[Target], sources: Sources, rank: int, bucket_bytes: int,
             not_read: frozenset[str] = frozenset()) -> ReadStats | None:
    """Fill every target this rank sources itself: local buffers copied, its own real tensors'
    regions copied, file tensors read, but those in `not_read` (another replica reads them:
    `replicas.py`). Returns the reader's stats (None when no tensor comes from the files)."""
    for t in targets:
        if t.spec.name in sources.local:
            t.dest.copy_(sources.local[t.spec.name])
        elif t.spec.name in sources.own:
            t.dest.copy_(sources.own[t.spec.name][t.regions[rank]])
    from_files = [t for t in targets if t.spec.name in sources.files and t.spec.name not in not_read]
    return read_own_shards(from_files, sources.files, rank, bucket_bytes) if from_files else None


class ReadStaging:
    """One host byte buffer, grown to the largest read and reused by every read after."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def get(self, nbytes: int) -> torch.Tensor:
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes]


class FileSlice:
    """Rank 0's stand-in for a checkpoint tensor it has not read (streamed broadcast): the
    transfer asks it for each rank's region, bucket by bucket, and gets those bytes read from the
    file, converted to `dtype` the way transformers converts (`Tensor.to`). So rank 0 never holds
    more of the checkpoint than the bucket being sent."""

    def __init__(self, where: FileTensor, dtype: torch.dtype, staging: ReadStaging | None = None) -> None:
        self.where, self.dtype, self.shape = where, dtype, torch.Size(where.shape)
        self.staging = staging or ReadStaging()  # shared by all of rank 0's slices of one load

    def read_into(self, region: Region, dest: torch.Tensor) -> int:
        """Write `region`, in `dtype`, into the byte buffer `dest`: read straight into it when it
        is host memory and needs no conversion (nothing allocated at all), else into the shared
        staging buffer and converted by one `copy_` into `dest` (no per-read tensors). Returns
        the checkpoint bytes read."""
        where = self.where
        byte_range = file_range(region, where)
        if byte_range is None:
            piece = self[region]
            dest.copy_(piece.contiguous().reshape(-1).view(torch.uint8))
            return piece.numel() * where.dtype.itemsize
        shape = tuple(s.stop - s.start for s in region)
        direct = _direct(dest, where, self.dtype)
        raw = dest if direct else self.staging.get(byte_range[1])
        with OpenFiles() as files:
            read_range(files, where, as_bytes(raw), byte_range[0])
        if not direct:
            copy_converted(dest.view(self.dtype).view(shape), rows_view(raw, where, shape), where)
        return byte_range[1]

    def __getitem__(self, region: Region) -> torch.Tensor:
        return converted(read_region(self.where, region), self.where, self.dtype)


@torch.no_grad()
def read_own_shards(targets: list[Target], files: dict[str, FileTensor], rank: int, bucket_bytes: int) -> ReadStats:
    """Fill each target's `dest` with this rank's region, read from the checkpoint; floats are
    cast to the destination dtype on the way (as transformers' `.to(dtype)` would)."""
    stats = ReadStats()
    start = time.perf_counter()
    blocks: list[tuple[Target, FileTensor]] = []
    for t in targets:
        where = files[t.spec.name]
        limit = max(1, bucket_bytes * t.spec.dtype.itemsize // where.dtype.itemsize)  # bucket_bytes as read
        blocks += [(b, where) for b in t.split(limit, rank) if b.dest.numel() > 0]
    ranges = [file_range(b.regions[rank], w) for b, w in blocks]
    order = sorted(range(len(blocks)), key=lambda i: (blocks[i][1].path, blocks[i][1].offset + (ranges[i] or (0,))[0]))
    staging_bytes = max((r[1] for r, (b, w) in zip(ranges, blocks) if r and not _direct(b.dest, w)), default=0)
    staging = torch.empty(staging_bytes, dtype=torch.uint8)
    total = sum(b.dest.numel() * w.dtype.itemsize for b, w in blocks)
    with OpenFiles() as open_files, Progress(total, f"rank {rank} reading its shards") as progress:
        for i in order:
            block, where = blocks[i]
            nbytes = _read_block(block, where, ranges[i], open_files, staging, rank)
            stats.reads += 1
            stats.bytes_read += nbytes
            stats.largest_read = max(stats.largest_read, nbytes)
            progress.update(nbytes, int(block.last))
        stats.files = open_files.paths
    stats.tensors = len(targets)
    stats.seconds = time.perf_counter() - start
    return stats


def _direct(dest: torch.Tensor, where: FileTensor, dtype: torch.dtype | None = None) -> bool:
    """Bytes can go straight into `dest` (holding `dtype`, its own by default; a byte buffer
    names it): same dtype all the way and the same layout, contiguous host memory."""
    return ((dtype or dest.dtype) == where.dtype and not where.via and where.transposed is None
            and dest.device.type == "cpu" and dest.is_contiguous())


def copy_converted(dest: torch.Tensor, values: torch.Tensor, where: FileTensor) -> None:
    """`dest.copy_(values)`, `values` in the file's dtype, rounded through `where.via` first as a
    plain load rounds them (`copy_` alone converts in place, allocating nothing)."""
    dest.copy_(converted(values, where, dest.dtype) if where.via else values)


def _read_block(
    block: Target, where: FileTensor, byte_range: tuple[int, int] | None, files: OpenFiles, staging: torch.Tensor,
    rank: int,
) -> int:
    if byte_range is None:
        piece = read_region(where, block.regions[rank])
        copy_converted(block.dest, piece.view(block.dest.shape), where)
        return piece.numel() * piece.element_size()
    offset, nbytes = byte_range
    if _direct(block.dest, where):
        read_range(files, where, as_bytes(block.dest), offset)
    else:
        raw = staging[:nbytes]
        read_range(files, where, as_bytes(raw), offset)
        copy_converted(block.dest, rows_view(raw, where, tuple(block.dest.shape)), where)
    return nbytes
