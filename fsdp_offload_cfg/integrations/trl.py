"""TRL: reference and teacher models TRL shards itself (`prepare_fsdp`). Lazy: `patch()` never
imports TRL; the replacement goes in as soon as `trl.models.utils` is imported, before TRL's
trainers bind it (`from ..models import prepare_fsdp`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from fsdp_offload_cfg.config import FSDPOffloadConfig
from fsdp_offload_cfg.integrations.common import (
    fill_through_loader,
    fsdp2_prepare_needed,
    fully_shard_swap,
    load_through_loader,
)
from fsdp_offload_cfg.registry import LaunchContext, Patch
from fsdp_offload_cfg.shard_groups import fsdp2_groups


def build_trl_prepare_fsdp(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    """TRL shards reference and teacher models itself (`prepare_fsdp`: `fully_shard` and `eval()`),
    not through accelerate's prepare; a model the loader built is filled the same way here."""

    @functools.wraps(original)
    def prepare_fsdp(model: torch.nn.Module, accelerator: Any) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule

        plugin = accelerator.state.fsdp_plugin

        def shard(m: torch.nn.Module) -> torch.nn.Module:
            with fsdp2_groups(m):
                return original(m, accelerator)

        if isinstance(model, FSDPModule) or plugin.fsdp_version != 2 or not fill_through_loader(model, plugin, cfg):
            return shard(model)
        return load_through_loader(model, shard, plugin, cfg)

    return prepare_fsdp


def _trl_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def _trl_prepare_needed(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    """Every FSDP2 run where TRL is installed: it fills loader-built models and splits dtype
    groups (lazy: TRL is patched when it is imported, never imported by `patch()`)."""
    return fsdp2_prepare_needed(cfg, ctx) and _trl_installed()


PATCHES = [
    Patch("trl-prepare-fsdp", "trl.models.utils", "prepare_fsdp", build_trl_prepare_fsdp,
          _trl_prepare_needed, ("torch", "accelerate"),
          "fill loader-built reference/teacher models that TRL shards itself; one group per dtype",
          swaps=fully_shard_swap, lazy=True),
]
