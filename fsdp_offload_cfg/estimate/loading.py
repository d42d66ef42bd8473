"""Host memory peak while loading, per strategy, for rank 0 and for the other ranks.

The model of each strategy follows what the loader does (`loading/broadcast.py`,
`loading/sharded.py`) and is checked against `benchmarks/load_memory.py` (peak RSS):

- broadcast, where the checkpoint can be read slice by slice (safetensors): rank 0 builds on meta
  like the others and, at prepare, reads each rank's region of each tensor while it sends it
  (`pread`, nothing mapped): it holds its shard, the send buffers of one scatter (one bucket for
  all ranks together: each rank's part is the bucket divided by the ranks) and its own receive
  part; regions are read straight into the send buffers, or through one reused host staging
  buffer of one part when they are converted or the buffers are on the device. Every other rank
  holds its shard and one receive part.
- broadcast of a checkpoint that cannot be read slice by slice (`.bin`): rank 0 runs
  `from_pretrained` on the CPU. A checkpoint already in the load dtype is memory-mapped, so its
  pages count in rank 0's RSS (F) and stay mapped until the load ends; a checkpoint in another
  dtype is converted, so the converted copy (M) comes on top of the mapped pages while
  `from_pretrained` runs, and the copy shrinks while it is sent.
- sharded: every rank reads its own slices with `pread` (nothing mapped), straight into its shard
  when the dtypes match, else through one staging block of at most a bucket.
- auto (the default): sharded where the checkpoint can be read slice by slice, else broadcast.
- plain (`cpu_ram_efficient_loading: false`): every rank loads the whole model like rank 0.

Companions: the frozen models a run loads beside the one it trains. TRL and ms-swift load every
one of them before they prepare any, the model first, so a plain load holds them beside the
model: a reward model or teacher whole (`others_whole_bytes`); a reference model (the same
checkpoint) as one more converted copy where loading converts, else as views of the same mapped
file pages, which cost nothing more until its shard is copied out at its prepare
(`reference_bytes`, measured: docs/benchmarks.md). The loader builds them on meta too and fills
each at its own prepare, after the model's: where the shards live on the host, what each rank
keeps of them (a reference model's shard; a reward model or teacher whole under TRL, its shard
under ms-swift: `others_kept_bytes`) stays beside the model's shard; on the device, the host
holds their staging buffers one at a time, no more than the model's own.

Where the shards live: on the host when the run is on the CPU or with `offload_params`;
otherwise on the device, and the staging buckets with them (broadcast scatters device buffers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

STRATEGIES = ("auto", "broadcast", "sharded")
MIN_PART_BYTES = 2**20  # as `loading.prepare`: a scatter's part per rank is the bucket / ranks, at least this


@dataclass(frozen=True)
class LoadingInputs:
    checkpoint_bytes: int  # F: bytes of the tensors in the checkpoint files, as stored
    loaded_bytes: int  # M: the whole model as `from_pretrained` materialises it (params + buffers)
    converting: bool  # the checkpoint dtype differs from the load dtype
    shard_bytes: int  # S: one rank's shard (storage dtype) plus the replicated buffers
    shards_on_host: bool
    bucket_bytes: int
    world: int
    sliceable: bool = True  # safetensors: read slice by slice (a `.bin` is not)
    reference_bytes: int = 0  # one rank's shard of a reference model (a frozen copy) plus its buffers; 0: none
    others_whole_bytes: int = 0  # the other frozen models (reward models, a teacher), whole
    others_kept_bytes: int = 0  # what each rank keeps of those once prepared (whole, or its shard)


class LoadingPeak(NamedTuple):
    rank0: int
    others: int


def peak(strategy: str, x: LoadingInputs) -> LoadingPeak:
    """Peak host bytes above a rank's baseline for `strategy` ("broadcast", "sharded", "plain")."""
    own = x.shard_bytes if x.shards_on_host else 0
    companions = x.reference_bytes + x.others_kept_bytes if x.shards_on_host else 0  # kept once prepared
    shard = own + companions  # the companions load after the model, beside its shard
    part = min(x.bucket_bytes, max(x.bucket_bytes // x.world, MIN_PART_BYTES))  # one rank's part of a scatter
    staging = min(part, x.shard_bytes) if x.shards_on_host else 0  # broadcast's buckets
    full = x.checkpoint_bytes + (x.loaded_bytes if x.converting else 0)
    if strategy == "auto":
        strategy = "sharded" if x.sliceable else "broadcast"
    if strategy == "sharded" and x.sliceable:
        block = min(x.bucket_bytes, x.shard_bytes)  # pread's staging block (host), when one is needed
        every = shard + (block if x.converting or not x.shards_on_host else 0)
        return LoadingPeak(every, every)
    if strategy in ("broadcast", "sharded") and x.sliceable:  # rank 0 streams from the files
        # a region is read straight into the send buffer, unless it is converted or the buffers are
        # on the device: then through one reused host staging buffer of one part
        region = min(part, x.shard_bytes) if x.converting or not x.shards_on_host else 0
        return LoadingPeak(shard + staging * (x.world + 1) + region, shard + staging)
    if strategy in ("broadcast", "sharded"):  # rank 0 loads whole
        sending = (x.loaded_bytes if x.converting else x.checkpoint_bytes + shard) + staging * (x.world + 1)
        # a companion read whole the same way comes while the model's shard is held
        return LoadingPeak(max(full + (own if companions else 0), sending), shard + staging)
    plain = max(full, (x.loaded_bytes if x.converting else x.checkpoint_bytes) + own) + x.others_whole_bytes
    plain += _plain_reference(x)
    return LoadingPeak(plain, plain)


def _plain_reference(x: LoadingInputs) -> int:
    """What a plain load's reference model adds (the same checkpoint, loaded before the model is
    prepared): one more converted copy where loading converts; else views of the file pages the
    model already mapped, which cost its shard alone once prepared (where shards live on the host)."""
    if not x.reference_bytes:
        return 0
    if x.converting:
        return x.loaded_bytes
    return x.reference_bytes if x.shards_on_host else 0
