"""Values derived from a config, each decided once: what the run-time plan and the offline
estimate read alike (the budget in bytes, the stated plan rates, the compute dtype of mixed
precision). No torch here: the CLI's quick verbs import the config layer.
"""

from __future__ import annotations

from fsdp_offload_cfg._sizes import size_in_bytes
from fsdp_offload_cfg.config.model import FSDPOffloadConfig

# accelerate's mixed precision computes activations in these (fp8 runs its fp8 matmuls inside a
# bf16 autocast, so everything else, activations included, is bf16); "no": the parameters' dtype
_COMPUTE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}


def budget_bytes(cfg: FSDPOffloadConfig) -> int | None:
    """The budget in bytes, or None when the config sets none (the rules refuse a size <= 0)."""
    return None if cfg.activation_memory_budget is None else size_in_bytes(cfg.activation_memory_budget)


def stated_rates(cfg: FSDPOffloadConfig) -> tuple[float | None, float | None]:
    """(FLOP/s, copy bytes/s) the config states for the plan (`activation_budget_compute_tflops`,
    `activation_budget_copy_gb_per_s`), None for each it leaves to be measured."""
    tflops, gb_per_s = cfg.activation_budget_compute_tflops, cfg.activation_budget_copy_gb_per_s
    return (None if tflops is None else tflops * 1e12), (None if gb_per_s is None else gb_per_s * 1e9)


def mixed_compute_dtype(cfg: FSDPOffloadConfig) -> str | None:
    """The torch dtype name activations are computed in under the config's mixed precision, or
    None without one (then the parameters' own dtype)."""
    return _COMPUTE_DTYPES.get(cfg.mixed_precision or "no")
