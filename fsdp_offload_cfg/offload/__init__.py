"""Activation CPU offload for FSDP2/FSDP1 training (see docs/offload.md).

`enable_activation_offload(model, config)` hooks a model so that activations saved for backward
by its groups (decoder layers / FSDP units) move to host memory in forward and come back, one
group ahead, in backward. `offload_stats()` reports what moved and what stayed.
"""

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
