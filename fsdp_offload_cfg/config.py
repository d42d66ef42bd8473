"""Typed, frozen view of a user's FSDP config (accelerate YAML, Trainer/ms-swift JSON or a mapping).

The loading, normalisation and validation logic lives here too (see `load_config`).
Every other module consumes only `FSDPOffloadConfig`; nothing downstream reads raw dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

OffloadMode = Literal["auto", "async", "sync"]
LoadStrategy = Literal["broadcast", "sharded"]


class ConfigError(ValueError):
    """Every problem found in a config, reported together (file, key path, what was expected)."""


@dataclass(frozen=True)
class ActivationOffloadConfig:
    """Knobs of the activation CPU offload (`activation_cpu_offload` key: bool or object)."""

    enabled: bool = False
    mode: OffloadMode = "auto"  # auto: async on CUDA, sync elsewhere
    min_tensor_bytes: int = 1024  # smaller saved tensors stay on the device
    max_pinned_bytes: int | None = None  # pinned-pool cap; past it tensors stay on the device
    offload_last_group: bool = False  # the last group is needed first in backward
    prefetch_groups: int = 1  # how many groups ahead backward reloads (double buffer = 1)


@dataclass(frozen=True)
class FSDPOffloadConfig:
    """Normalised fsdp_config plus the launch keys we read; defaults filled in."""

    # accelerate's fsdp_config keys (names without the `fsdp_` prefix)
    version: int = 2
    reshard_after_forward: bool | str = True
    sharding_strategy: str | None = None
    offload_params: bool = False
    auto_wrap_policy: str | None = None
    transformer_layer_cls_to_wrap: tuple[str, ...] | None = None
    min_num_params: int | None = None
    backward_prefetch: str | None = None
    forward_prefetch: bool = False
    state_dict_type: str | None = None
    use_orig_params: bool = True
    cpu_ram_efficient_loading: bool = False
    sync_module_states: bool = True
    activation_checkpointing: bool = False
    activation_checkpointing_offload: bool = False
    ignored_modules: str | None = None
    # this plugin's keys
    activation_cpu_offload: ActivationOffloadConfig = field(default_factory=ActivationOffloadConfig)
    load_strategy: LoadStrategy = "broadcast"
    # launch keys read from a whole accelerate YAML (None when the source had none)
    distributed_type: str | None = None
    mixed_precision: str | None = None
    num_processes: int | None = None
    use_cpu: bool | None = None
    # where it came from, for messages ("examples/fsdp2.yaml", "<dict>", "env FSDP_*")
    source: str = "<defaults>"
