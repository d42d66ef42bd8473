"""The config layer: one definition per key, readers that never crash, rules as named objects.

Modules, by what a reader looks for:
- `keys`: every key defined once (names, type, default, environment variable, doc), and what
  we measured about accelerate and transformers that is not a key;
- `model`: the typed, frozen `FSDPOffloadConfig` (generated from `keys`), `ConfigError`, `Problem`;
- `schema`: the JSON Schema built from `keys`, value coercion and validation messages;
- `reading`: files and mappings -> plain data, within depth and size limits;
- `sources`: `load_config` (files, mappings, overrides), `config_from_env`, `env_values`;
- `rules`: the rules between keys (`RULES`);
- `trainer_file`: a Trainer's file as the run it describes (its training arguments beside its
  `fsdp_config`), which `estimate` takes where its flags are left out.

Every other module consumes only `FSDPOffloadConfig` (and `estimate`, `RunArguments`); nothing downstream
reads raw dicts.
"""

from fsdp_offload_cfg.config.keys import (
    ENV_VARS,
    FSDP1_ONLY_ENV_KEYS,
    KEYS,
    LAUNCH_ENV_VARS,
    LAUNCH_KEYS,
    NULL_MEANS_UNSET,
    PLUGIN_KEYS,
)
from fsdp_offload_cfg.config.model import ConfigError, FSDPOffloadConfig, Problem, normalized_dict
from fsdp_offload_cfg.config.reading import read_config_file
from fsdp_offload_cfg.config.sources import (
    as_accelerate_mapping,
    as_config_file,
    config_from_env,
    env_values,
    fsdp_keys_written,
    load_config,
    with_the_files_other_keys,
)
from fsdp_offload_cfg.offload.options import ActivationOffloadConfig

__all__ = [
    "ENV_VARS",
    "FSDP1_ONLY_ENV_KEYS",
    "KEYS",
    "LAUNCH_ENV_VARS",
    "LAUNCH_KEYS",
    "NULL_MEANS_UNSET",
    "PLUGIN_KEYS",
    "ActivationOffloadConfig",
    "ConfigError",
    "FSDPOffloadConfig",
    "Problem",
    "as_accelerate_mapping",
    "as_config_file",
    "config_from_env",
    "env_values",
    "fsdp_keys_written",
    "load_config",
    "normalized_dict",
    "read_config_file",
    "with_the_files_other_keys",
]
