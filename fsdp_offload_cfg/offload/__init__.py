"""Activation CPU offload for FSDP2/FSDP1 training (see docs/offload.md).

`enable_activation_offload(model, config)` hooks a model so that activations saved for backward
by its groups (decoder layers / FSDP units) move to host memory in forward and come back, one
group ahead, in backward. `offload_stats()` reports what moved and what stayed.
"""

from typing import TYPE_CHECKING

from fsdp_offload_cfg._lazy import lazy_exports

# Resolved on first use: the config layer reads `offload.options` without importing torch.
__getattr__, __dir__ = lazy_exports(__name__, globals(), {
    "OffloadHandle": "fsdp_offload_cfg.offload.api",
    "enable_activation_offload": "fsdp_offload_cfg.offload.api",
    "get_offload_handle": "fsdp_offload_cfg.offload.api",
    "SavedBytesMeter": "fsdp_offload_cfg.offload.stats",
    "offload_stats": "fsdp_offload_cfg.offload.stats",
    "reset_offload_stats": "fsdp_offload_cfg.offload.stats",
})

if TYPE_CHECKING:
    from fsdp_offload_cfg.offload.api import OffloadHandle, enable_activation_offload, get_offload_handle
    from fsdp_offload_cfg.offload.stats import SavedBytesMeter, offload_stats, reset_offload_stats

__all__ = [
    "OffloadHandle",
    "SavedBytesMeter",
    "enable_activation_offload",
    "get_offload_handle",
    "offload_stats",
    "reset_offload_stats",
]
