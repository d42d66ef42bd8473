"""What an estimate is made from: its error type, and the dtypes a run of the config holds its
parameters, states and activations in. Below every other estimate module (they import it; it
imports none of them). It imports no torch, so that `estimate`'s input errors (a flag, a dtype's
name) are said in the second a `validate` takes, not after the seconds torch's import costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsdp_offload_cfg._sizes import AutoBudget
from fsdp_offload_cfg.config import FSDPOffloadConfig
from fsdp_offload_cfg.config.derived import auto_budget, budget_bytes

if TYPE_CHECKING:
    import torch

OPTIMIZERS = ("adamw", "adamw_fused", "sgd")
DEVICES = ("cuda", "cpu")
# what a run's loss goes through: the model's own head, or one of TRL's (`estimate/heads.py`)
LOSS_HEADS = ("cross_entropy", "trl_fused_lm_head", "trl_chunked_distillation")
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # a name --dtype takes: torch's name


class EstimateError(ValueError):
    """The estimate cannot be made; the message says which input to change."""


@dataclass(frozen=True)
class Dtypes:
    load: torch.dtype  # what from_pretrained materialises (and the checkpoint converts to)
    storage: torch.dtype  # sharded parameters, gradients, optimizer moments
    compute: torch.dtype  # gathered parameters and activations
    frozen: torch.dtype  # parameters that do not train (a LoRA's base): upcast only where accelerate upcasts all


def resolve_dtypes(config: FSDPOffloadConfig, model_config: Any, dtype: str | None) -> Dtypes:
    """accelerate's rule: mixed precision computes in bf16/fp16 over master weights that the
    installed accelerate upcasts to fp32 (all but 1.13: `compat.master_weights`); without it,
    everything stays in the load dtype (`dtype`, else the config.json's, as transformers 5
    `from_pretrained(dtype="auto")` does, else fp32)."""
    import torch

    from fsdp_offload_cfg.compat.master_weights import accelerate_upcast
    from fsdp_offload_cfg.config.derived import mixed_compute_dtype

    name = dtype or _config_dtype(model_config) or "float32"
    check_dtype_name(name)
    load = getattr(torch, DTYPES[name])
    mixed_name = mixed_compute_dtype(config)  # one rule with the run-time plan
    mixed = getattr(torch, mixed_name) if mixed_name is not None else None
    storage = torch.float32 if mixed and accelerate_upcast() != "none" else load
    return Dtypes(load, storage, mixed or load, storage if accelerate_upcast() == "all" else load)


def check_dtype_name(name: str) -> None:
    if name not in DTYPES:
        raise EstimateError(f"--dtype: expected one of {', '.join(sorted(DTYPES))}, got {name!r}")


def _config_dtype(model_config: Any) -> str | None:
    """The checkpoint's dtype: `dtype` where transformers has it (reading the older `torch_dtype`
    there prints a deprecation notice), `torch_dtype` on the releases before it."""
    name = "dtype" if hasattr(model_config, "dtype") else "torch_dtype"
    value = getattr(model_config, name, None)
    return str(value).removeprefix("torch.") if value is not None else None


def requested_budget(config: FSDPOffloadConfig, given: int | AutoBudget | None) -> int | AutoBudget | None:
    """The budget to plan: the one given (the command line's), else the config's (the run will
    plan it: so does the estimate), else none."""
    if given is not None or config.activation_memory_budget is None:
        return given
    return budget_bytes(config) or auto_budget(config)


def auto_device_bytes(config: FSDPOffloadConfig, auto: AutoBudget, device_memory: int | None, device: str) -> int:
    """The device size `auto` plans against: the command line's, else the budget's own, else the
    config's `activation_budget_device_memory`, else the visible GPU's."""
    stated = auto_budget(config)  # the config's own device size, where it has one
    device_bytes = (device_memory or auto.device_bytes or (stated and stated.device_bytes)
                    or visible_device_bytes(device))
    if device_bytes is None:
        raise EstimateError("activation budget auto: the device's memory is unknown here; pass --device-memory "
                            "(such as 80GiB), or set activation_budget_device_memory in the config")
    return device_bytes


def visible_device_bytes(device: str) -> int | None:
    """The first visible GPU's memory for a CUDA estimate on a machine that has one; else unknown."""
    if device != "cuda":  # no torch to import (seconds) to know a CPU run has no GPU
        return None
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None
