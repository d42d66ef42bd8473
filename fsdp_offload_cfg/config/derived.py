"""Values derived from a config, each decided once: what the run-time plan and the offline
estimate read alike (the budget in bytes or `auto`, the stated plan rates, the compute dtype of
mixed precision). No torch here: the CLI's quick verbs import the config layer.
"""

from __future__ import annotations

from fsdp_offload_cfg._sizes import AutoBudget, parse_auto, size_in_bytes
from fsdp_offload_cfg.config.model import FSDPOffloadConfig

# accelerate's mixed precision computes activations in these (fp8 runs its fp8 matmuls inside a
# bf16 autocast, so everything else, activations included, is bf16); "no": the parameters' dtype
_COMPUTE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}


def auto_budget(cfg: FSDPOffloadConfig) -> AutoBudget | None:
    """The config's `auto` budget with its stated device memory; None for a fixed budget or none."""
    auto = parse_auto(cfg.activation_memory_budget)
    if auto is None:
        return None
    device = cfg.activation_budget_device_memory
    return AutoBudget(auto.margin_bytes, auto.margin_fraction, None if device is None else size_in_bytes(device))


def budget_bytes(cfg: FSDPOffloadConfig) -> int | None:
    """The budget in bytes; None when the config sets none or `auto` (the rules refuse a size <= 0)."""
    budget = cfg.activation_memory_budget
    return None if budget is None or parse_auto(budget) is not None else size_in_bytes(budget)


def stated_rates(cfg: FSDPOffloadConfig) -> tuple[float | None, float | None]:
    """(FLOP/s, copy bytes/s) the config states for the plan (`activation_budget_compute_tflops`,
    `activation_budget_copy_gb_per_s`), None for each it leaves to be measured."""
    tflops, gb_per_s = cfg.activation_budget_compute_tflops, cfg.activation_budget_copy_gb_per_s
    return (None if tflops is None else tflops * 1e12), (None if gb_per_s is None else gb_per_s * 1e9)


def mixed_compute_dtype(cfg: FSDPOffloadConfig) -> str | None:
    """The torch dtype name activations are computed in under the config's mixed precision, or
    None without one (then the parameters' own dtype)."""
    return _COMPUTE_DTYPES.get(cfg.mixed_precision or "no")
