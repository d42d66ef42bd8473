"""fsdp_offload_cfg: config-driven FSDP2 memory savers for accelerate and transformers.

    import fsdp_offload_cfg
    fsdp_offload_cfg.patch()          # first line of the training script

Rank-0 meta loading (`cpu_ram_efficient_loading`) and activation CPU offload
(`activation_cpu_offload`) are switched on by the same config file `accelerate launch` reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdp_offload_cfg._lazy import lazy_exports

# Resolved on first use, so that importing the package (the CLI, the autopatch line) loads no torch.
__getattr__, __dir__ = lazy_exports(__name__, globals(), {
    "ActivationOffloadConfig": "fsdp_offload_cfg.offload.options",
    "ConfigError": "fsdp_offload_cfg.config.model",
    "FSDPOffloadConfig": "fsdp_offload_cfg.config.model",
    "load_config": "fsdp_offload_cfg.config.sources",
    "local_loading": "fsdp_offload_cfg.loading.local",
    "enable_activation_offload": "fsdp_offload_cfg.offload.api",
    "enable_activation_budget": "fsdp_offload_cfg.budget",
    "offload_stats": "fsdp_offload_cfg.offload.stats",
    "PatchSession": "fsdp_offload_cfg.patching",
    "UnsupportedVersionError": "fsdp_offload_cfg.patching",
    "active_config": "fsdp_offload_cfg.patching",
    "patch": "fsdp_offload_cfg.patching",
    "unpatch": "fsdp_offload_cfg.patching",
})

if TYPE_CHECKING:
    from fsdp_offload_cfg.config.model import ConfigError, FSDPOffloadConfig
    from fsdp_offload_cfg.config.sources import load_config
    from fsdp_offload_cfg.loading.local import local_loading
    from fsdp_offload_cfg.offload.api import enable_activation_offload
    from fsdp_offload_cfg.offload.options import ActivationOffloadConfig
    from fsdp_offload_cfg.offload.stats import offload_stats
    from fsdp_offload_cfg.patching import PatchSession, UnsupportedVersionError, active_config, patch, unpatch

__all__ = [
    "ActivationOffloadConfig",
    "ConfigError",
    "FSDPOffloadConfig",
    "PatchSession",
    "UnsupportedVersionError",
    "active_config",
    "enable_activation_budget",
    "enable_activation_offload",
    "load_config",
    "local_loading",
    "offload_stats",
    "patch",
    "unpatch",
]
__version__ = "0.1.0"

