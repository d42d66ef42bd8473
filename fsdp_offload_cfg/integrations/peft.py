"""PEFT: adapters injected into a loader-built (meta) model keep the values PEFT drew, a saved
adapter loads without reading the base model (`loading/adapters.py`), and `save_pretrained` of a
model accelerate sharded writes the adapter (`saving.py`). Lazy: `patch()` never imports PEFT."""

from __future__ import annotations

from fsdp_offload_cfg.config import FSDPOffloadConfig
from fsdp_offload_cfg.integrations.common import fsdp2_prepare_needed, loader_enabled
from fsdp_offload_cfg.loading.adapters import build_inject_adapter, build_load_adapter
from fsdp_offload_cfg.registry import LaunchContext, Patch
from fsdp_offload_cfg.saving import build_save_pretrained


def _peft_adapters_needed(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    """The loader builds meta models and PEFT (which would move new adapters onto them) is there."""
    import importlib.util

    return loader_enabled(cfg) and importlib.util.find_spec("peft") is not None


def _peft_under_fsdp2(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    import importlib.util

    return fsdp2_prepare_needed(cfg, ctx) and importlib.util.find_spec("peft") is not None


PATCHES = [
    Patch("peft-adapters-on-host", "peft.tuners.tuners_utils", "BaseTuner.inject_adapter",
          build_inject_adapter, _peft_adapters_needed, ("torch",),
          "new PEFT adapters on a meta base keep the values PEFT drew (on the host) instead of moving to meta",
          lazy=True),
    Patch("peft-load-adapter-keys-only", "peft.peft_model", "PeftModel.load_adapter",
          build_load_adapter, _peft_adapters_needed, ("torch",),
          "loading a saved adapter onto a loader-built model reads no base weight (PEFT reads state_dict() for keys)",
          lazy=True),
    Patch("peft-save-pretrained-sharded", "peft.peft_model", "PeftModel.save_pretrained",
          build_save_pretrained, _peft_under_fsdp2, ("torch",),
          "save_pretrained of a PEFT model accelerate sharded (FSDP2) gathers it and writes the adapter on rank 0 "
          "(it stopped: invalid python storage)", lazy=True),
]
