"""fsdp_offload_cfg: config-driven FSDP2 memory savers for accelerate and transformers."""

from fsdp_offload_cfg.config import ActivationOffloadConfig, ConfigError, FSDPOffloadConfig

__all__ = ["ActivationOffloadConfig", "ConfigError", "FSDPOffloadConfig"]
__version__ = "0.1.0"
