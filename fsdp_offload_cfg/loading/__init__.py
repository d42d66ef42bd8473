"""Meta loading: build on `meta`, shard, then fill each rank's shards.

- `rank0_from_pretrained` / `rank0_from_config`: bodies of the transformers patches (strategy
  "broadcast": rank 0 reads, the others build on meta).
- `sharded_from_pretrained`: the `from_pretrained` patch body for strategy "sharded" (every rank
  builds on meta and records where each tensor is in the safetensors files).
- `auto_from_pretrained`: for strategy "auto" (the default): as "sharded" on every rank that can
  read the files, from rank 0's description on a rank that cannot.
- `load_into_sharded`: the prepare step (capture, meta, `fully_shard`, materialise, fill); it
  returns a `LoadReport` (the model, what rank 0 sent, what this rank read).
- `local_loading`: the stock loaders for the loads inside the block (`local.py`).
See docs/loading.md.

The names are imported on first use: `import fsdp_offload_cfg` (the CLI, `local_loading`) must
not pay for torch.distributed.tensor and transformers' loading internals.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "auto_from_pretrained": "meta",
    "DEFAULT_BUCKET_BYTES": "prepare",
    "LoadReport": "prepare",
    "is_rank0_source": "meta",
    "load_into_sharded": "prepare",
    "local_loading": "local",
    "rank0_from_config": "meta",
    "rank0_from_pretrained": "meta",
    "sharded_from_pretrained": "meta",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
