"""fsdp_offload_cfg: config-driven FSDP2 memory savers for accelerate and transformers.

    import fsdp_offload_cfg
    fsdp_offload_cfg.patch()          # first line of the training script

Rank-0 meta loading (`cpu_ram_efficient_loading`) and activation CPU offload
(`activation_cpu_offload`) are switched on by the same config file `accelerate launch` reads.
"""

from __future__ import annotations

from fsdp_offload_cfg.config import ActivationOffloadConfig, ConfigError, FSDPOffloadConfig, load_config
from fsdp_offload_cfg.loading.local import local_loading
from fsdp_offload_cfg.offload import enable_activation_offload, offload_stats
from fsdp_offload_cfg.patching import PatchSession, UnsupportedVersionError, active_config, patch, unpatch

__all__ = [
    "ActivationOffloadConfig",
    "ConfigError",
    "FSDPOffloadConfig",
    "PatchSession",
    "UnsupportedVersionError",
    "active_config",
    "enable_activation_offload",
    "load_config",
    "local_loading",
    "offload_stats",
    "patch",
    "unpatch",
]
__version__ = "0.1.0"

