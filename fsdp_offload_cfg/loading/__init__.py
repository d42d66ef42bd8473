"""Rank-0 meta loading: one reader, every other rank on `meta`, then shard and scatter.

- `rank0_from_pretrained` / `rank0_from_config`: bodies of the transformers patches.
- `load_into_sharded`: the prepare step (capture, meta, `fully_shard`, materialise, send).
See docs/loading.md.
"""

from fsdp_offload_cfg.loading.meta import SOURCE_ATTR, is_rank0_source, rank0_from_config, rank0_from_pretrained
from fsdp_offload_cfg.loading.prepare import DEFAULT_BUCKET_BYTES, load_into_sharded

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "SOURCE_ATTR",
    "is_rank0_source",
    "load_into_sharded",
    "rank0_from_config",
    "rank0_from_pretrained",
]
