"""Host memory peak while loading, per strategy, for rank 0 and for the other ranks.

The model of each strategy follows what the loader does (`loading/broadcast.py`,
`loading/sharded.py`) and is checked against `benchmarks/load_memory.py` (peak RSS):

- broadcast, where the checkpoint can be read slice by slice (safetensors): rank 0 builds on meta
  like the others and, at prepare, reads each rank's region of each tensor while it sends it
  (`pread`, nothing mapped): it holds its shard, one send bucket per rank and a receive bucket,
  plus the one region being read (on the host even when the shards live on the device; twice
  when it is converted). Every other rank holds its shard and one receive bucket.
- broadcast of a checkpoint that cannot be read slice by slice (`.bin`): rank 0 runs
  `from_pretrained` on the CPU. A checkpoint already in the load dtype is memory-mapped, so its
  pages count in rank 0's RSS (F) and stay mapped until the load ends; a checkpoint in another
  dtype is converted, so the converted copy (M) comes on top of the mapped pages while
  `from_pretrained` runs, and the copy shrinks while it is sent.
- sharded: every rank reads its own slices with `pread` (nothing mapped), straight into its shard
  when the dtypes match, else through one staging block of at most a bucket.
- auto (the default): sharded where the checkpoint can be read slice by slice, else broadcast.
- plain (`cpu_ram_efficient_loading: false`): every rank loads the whole model like rank 0.

Where the shards live: on the host when the run is on the CPU or with `offload_params`;
otherwise on the device, and the staging buckets with them (broadcast scatters device buffers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

STRATEGIES = ("auto", "broadcast", "sharded")


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


class LoadingPeak(NamedTuple):
    rank0: int
    others: int


def peak(strategy: str, x: LoadingInputs) -> LoadingPeak:
    """Peak host bytes above a rank's baseline for `strategy` ("broadcast", "sharded", "plain")."""
    shard = x.shard_bytes if x.shards_on_host else 0
    staging = min(x.bucket_bytes, x.shard_bytes) if x.shards_on_host else 0  # broadcast's buckets
    full = x.checkpoint_bytes + (x.loaded_bytes if x.converting else 0)
    if strategy == "auto":
        strategy = "sharded" if x.sliceable else "broadcast"
    if strategy == "sharded" and x.sliceable:
        block = min(x.bucket_bytes, x.shard_bytes)  # pread's staging block (host), when one is needed
        every = shard + (block if x.converting or not x.shards_on_host else 0)
        return LoadingPeak(every, every)
    if strategy in ("broadcast", "sharded") and x.sliceable:  # rank 0 streams from the files
        # one rank's region at a time is read into host memory (and converted: a second copy)
        region = min(x.bucket_bytes, x.shard_bytes) * (2 if x.converting else 1)
        return LoadingPeak(shard + staging * (x.world + 1) + region, shard + staging)
    if strategy in ("broadcast", "sharded"):  # rank 0 loads whole
        sending = (x.loaded_bytes if x.converting else x.checkpoint_bytes + shard) + staging * (x.world + 1)
        return LoadingPeak(max(full, sending), shard + staging)
    plain = max(full, (x.loaded_bytes if x.converting else x.checkpoint_bytes) + shard)
    return LoadingPeak(plain, plain)
