"""The configs the loader's tests run under: the loader off, or on with one strategy."""

from __future__ import annotations

from typing import Any

LOADER_MODES = ["loader_off", "broadcast", "sharded"]


def loader_config(mode: str, **fsdp: Any) -> dict[str, Any]:
    """An accelerate config (FSDP2, transformer-based wrapping, no mixed precision) with the
    loader off (`loader_off`) or on with `mode` as its `load_strategy`; `fsdp`: more keys."""
    keys = {"fsdp_version": 2, "fsdp_cpu_ram_efficient_loading": mode != "loader_off",
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", **fsdp}
    if mode != "loader_off":
        keys["load_strategy"] = mode
    return {"distributed_type": "FSDP", "mixed_precision": "no", "fsdp_config": keys}
