"""Meta loading: build on `meta`, shard, then fill each rank's shards.

- `rank0_from_pretrained` / `rank0_from_config`: bodies of the transformers patches (strategy
  "broadcast": rank 0 reads, the others build on meta).
- `sharded_from_pretrained`: the `from_pretrained` patch body for strategy "sharded" (every rank
  builds on meta and records where each tensor is in the safetensors files).
- `load_into_sharded`: the prepare step (capture, meta, `fully_shard`, materialise, fill).
See docs/loading.md.
"""

from fsdp_offload_cfg.loading.checkpoint import CHECKPOINT_ATTR
from fsdp_offload_cfg.loading.meta import (
    SOURCE_ATTR,
    is_rank0_source,
    rank0_from_config,
    rank0_from_pretrained,
    sharded_from_pretrained,
)
from fsdp_offload_cfg.loading.prepare import DEFAULT_BUCKET_BYTES, load_into_sharded

__all__ = [
    "CHECKPOINT_ATTR",
    "DEFAULT_BUCKET_BYTES",
    "SOURCE_ATTR",
    "is_rank0_source",
    "load_into_sharded",
    "rank0_from_config",
    "rank0_from_pretrained",
    "sharded_from_pretrained",
]
