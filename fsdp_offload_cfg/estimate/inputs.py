"""What an estimate is made from: its error type, and the dtypes a run of the config holds its
parameters, states and activations in. Below every other estimate module (they import it; it
imports none of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fsdp_offload_cfg.config import FSDPOffloadConfig

OPTIMIZERS = ("adamw", "adamw_fused", "sgd")
DEVICES = ("cuda", "cpu")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class EstimateError(ValueError):
    """The estimate cannot be made; the message says which input to change."""


@dataclass(frozen=True)
class Dtypes:
    load: torch.dtype  # what from_pretrained materialises (and the checkpoint converts to)
    storage: torch.dtype  # sharded parameters, gradients, optimizer moments
    compute: torch.dtype  # gathered parameters and activations


def resolve_dtypes(config: FSDPOffloadConfig, model_config: Any, dtype: str | None) -> Dtypes:
    """accelerate's rule: mixed precision computes in bf16/fp16 over master weights that the
    installed accelerate upcasts to fp32 (all but 1.13: `compat.master_weights`); without it,
    everything stays in the load dtype (`dtype`, else the config.json's, as transformers 5
    `from_pretrained(dtype="auto")` does, else fp32)."""
    from fsdp_offload_cfg.compat.master_weights import accelerate_upcast
    from fsdp_offload_cfg.config.derived import mixed_compute_dtype

    name = dtype or _config_dtype(model_config) or "float32"
    if name not in _DTYPES:
        raise EstimateError(f"--dtype: expected one of {', '.join(sorted(_DTYPES))}, got {name!r}")
    load = _DTYPES[name]
    mixed_name = mixed_compute_dtype(config)  # one rule with the run-time plan
    mixed = getattr(torch, mixed_name) if mixed_name is not None else None
    storage = torch.float32 if mixed and accelerate_upcast() != "none" else load
    return Dtypes(load, storage, mixed or load)


def _config_dtype(model_config: Any) -> str | None:
    """The checkpoint's dtype: `dtype` where transformers has it (reading the older `torch_dtype`
    there prints a deprecation notice), `torch_dtype` on the releases before it."""
    name = "dtype" if hasattr(model_config, "dtype") else "torch_dtype"
    value = getattr(model_config, name, None)
    return str(value).removeprefix("torch.") if value is not None else None
