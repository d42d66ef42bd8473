"""axolotl: the plugin entry that turns this package on from an axolotl config file alone.

    plugins:
      - fsdp_offload_cfg.integrations.axolotl.FsdpOffloadCfgPlugin
    fsdp_version: 2
    fsdp_config:
      cpu_ram_efficient_loading: true
      load_strategy: sharded
      activation_cpu_offload: true

Why a plugin and not only `fsdp-offload-cfg run -- axolotl train`: axolotl validates its config
with a pydantic schema that silently drops the `fsdp_config` keys it does not know (ours:
`load_strategy`, `activation_cpu_offload`, ...), and hands the Trainer only what is left; so
without the plugin those keys do nothing, without a word. axolotl gives a plugin the raw config
before that validation (`register`), and the validated one before the model loads
(`pre_model_load`), which is what the Trainer's `fsdp_config` is built from later:
- `register`: validate the raw `fsdp_config` with our schema (a typo stops the run here, naming
  the key and the axolotl file) and `patch()` with it, before axolotl touches any model;
- `pre_model_load`: put the keys axolotl's validation dropped back into its `fsdp_config`, so the
  `TrainingArguments` axolotl builds carry the same config (`TrainingArguments.fsdp_config` is a
  config source of ours too: without this, it would switch the run to the config minus our keys).

Imported only by axolotl (it names this module in its `plugins:` list): axolotl is imported here.
"""

from __future__ import annotations

from typing import Any

from axolotl.integrations.base import BasePlugin

from fsdp_offload_cfg._logging import get_logger
from fsdp_offload_cfg.integrations.common import without_framework_keys

logger = get_logger("fsdp_offload_cfg.integrations")
_registered = False  # a config in this process listed the plugin: the Trainer-arguments hint stays quiet


def registered() -> bool:
    return _registered


class FsdpOffloadCfgPlugin(BasePlugin):
    """axolotl plugin: `patch()` with the axolotl config's own `fsdp_config`."""

    def __init__(self) -> None:
        super().__init__()
        # the raw fsdp_config as the user wrote it, kept from `register` (before axolotl's schema
        # drops our keys) until `pre_model_load` puts the dropped ones back
        self._written: dict[str, Any] = {}

    def register(self, cfg: dict) -> None:
        from fsdp_offload_cfg.config import ConfigError, load_config
        from fsdp_offload_cfg.patching import patch

        where = f"axolotl config {cfg.get('axolotl_config_path') or '(in code)'}"
        written = dict(cfg.get("fsdp_config") or {})
        if not written:
            logger.warning("%s lists the fsdp_offload_cfg plugin but has no fsdp_config: nothing to do", where)
            return
        if cfg.get("fsdp_version") is not None and not ({"fsdp_version", "version"} & set(written)):
            written["fsdp_version"] = cfg["fsdp_version"]  # axolotl's top-level spelling
        config = load_config({"distributed_type": "FSDP", "fsdp_config": without_framework_keys(written, "axolotl")},
                             name=where)  # axolotl's own keys (final_state_dict_type, ...) are left to it
        if cfg.get("activation_offloading") and config.activation_cpu_offload.enabled:
            raise ConfigError(f"{where}: activation_offloading ({cfg['activation_offloading']!r}) turns on axolotl's "
                              "own activation offloader and fsdp_config.activation_cpu_offload fsdp_offload_cfg's: two "
                              "offloaders on one model, one of which would move nothing. Keep one of the two keys.")
        self._written = written
        patch(config)
        global _registered
        _registered = True

    def pre_model_load(self, cfg: Any) -> None:
        fsdp_config = cfg.get("fsdp_config")
        if fsdp_config is None or not self._written:
            return
        dropped = {k: v for k, v in self._written.items() if k not in fsdp_config}
        fsdp_config.update(dropped)  # what the Trainer's fsdp_config is built from (core/builders)
