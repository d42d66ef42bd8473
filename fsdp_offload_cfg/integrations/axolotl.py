"""The documented path of axolotl's plugin (`plugins: [fsdp_offload_cfg.integrations.axolotl.
FsdpOffloadCfgPlugin]`); the plugin lives with ms-swift's in `fsdp_offload_cfg.plugins`."""

from fsdp_offload_cfg.plugins.axolotl import FsdpOffloadCfgPlugin, registered

__all__ = ["FsdpOffloadCfgPlugin", "registered"]
