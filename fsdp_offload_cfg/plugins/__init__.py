"""Entries a framework loads by name or by path, together: axolotl's plugin class (`axolotl.py`,
listed in an axolotl config under `plugins:`) and ms-swift's external plugin file
(`swift/fsdp_offload_cfg_for_swift.py`, given to `--external_plugins`; `fsdp-offload-cfg
swift-plugin` prints its path). Each turns the package on from the framework's own config and
does nothing else: the patches live in `fsdp_offload_cfg.integrations`.

The documented axolotl path, `fsdp_offload_cfg.integrations.axolotl.FsdpOffloadCfgPlugin`, stays:
that module re-exports the class.
"""
