"""fsdp_offload_cfg: config-driven FSDP2 memory savers for accelerate and transformers.

    import fsdp_offload_cfg
    fsdp_offload_cfg.patch()          # first line of the training script

Rank-0 meta loading (`cpu_ram_efficient_loading`) and activation CPU offload
(`activation_cpu_offload`) are switched on by the same config file `accelerate launch` reads.
"""

from __future__ import annotations

from typing import Any

from fsdp_offload_cfg.config import ActivationOffloadConfig, ConfigError, FSDPOffloadConfig
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
    "offload_stats",
    "patch",
    "unpatch",
]
__version__ = "0.1.0"


def load_config(source: Any, overrides: Any = None) -> FSDPOffloadConfig:
    """Load, normalise and validate a config file or mapping (see `fsdp_offload_cfg.config`)."""
    from fsdp_offload_cfg.config import load_config as _load

    return _load(source, overrides)


def enable_activation_offload(model: Any, config: ActivationOffloadConfig | None = None, **kwargs: Any) -> Any:
    """Offload saved activations of `model`'s layers to host memory; usable without accelerate."""
    from fsdp_offload_cfg.offload import enable_activation_offload as _enable

    return _enable(model, config, **kwargs)


def offload_stats() -> dict[str, Any]:
    """Cumulative offload counters: offloaded/reloaded bytes, peak resident bytes, pinned pool."""
    from fsdp_offload_cfg.offload import offload_stats as _stats

    return _stats()
