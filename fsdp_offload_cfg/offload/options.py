"""`ActivationOffloadConfig`: the knobs of the activation CPU offload, checked once when built.

It lives with the offload (not with the config layer) so that `import fsdp_offload_cfg.offload`
needs only torch. Each field carries its schema type in its metadata; the config layer builds
the JSON Schema of the `activation_cpu_offload` key from these fields, so a knob is declared
in exactly one place. `__post_init__` enforces the same ranges the schema states, so a config
built in Python (`ActivationOffloadConfig(prefetch_groups=0)`) is refused with the same words as
one read from a file, before any hook is installed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

OffloadMode = Literal["auto", "async", "sync"]
MODES: tuple[str, ...] = ("auto", "async", "sync")


@dataclass(frozen=True)
class ActivationOffloadConfig:
    """Knobs of the activation CPU offload (`activation_cpu_offload` key: a bool or a mapping)."""

    # Each field's metadata: its schema type (a `$defs` name of the config layer) and a doc line.
    enabled: bool = field(default=False, metadata={
        "type": "boolish", "doc": "offload saved activations (a mapping without it means true)"})
    mode: OffloadMode = field(default="auto", metadata={
        "type": "offload_mode", "doc": "auto: async on CUDA, sync elsewhere"})
    min_tensor_bytes: int = field(default=1024, metadata={
        "type": "nonneg_int", "doc": "smaller saved tensors stay on the device"})
    max_pinned_bytes: int | None = field(default=None, metadata={
        "type": "optional_nonneg_int", "doc": "pinned-pool cap; past it tensors stay on the device (null: no cap)"})
    offload_last_group: bool = field(default=False, metadata={
        "type": "boolish", "doc": "also offload the last group, which backward needs first"})
    prefetch_groups: int = field(default=1, metadata={
        "type": "positive_int", "doc": "how many groups ahead backward reloads (double buffer = 1)"})

    def __post_init__(self) -> None:
        problems = [f"{name}: {why}" for name, why in _out_of_range(self)]
        if problems:
            raise ValueError("ActivationOffloadConfig: " + "; ".join(problems))

    def resolved_mode(self, device_type: str) -> OffloadMode:
        """The handler the offload builds on `device_type`: "auto" is async on CUDA, sync elsewhere;
        async needs streams, so only CUDA and the CPU (its proxy: same prefetch order, no streams)
        keep it. The one rule for the run (`api`) and the estimate's replay of it."""
        if self.mode == "auto":
            return "async" if device_type == "cuda" else "sync"
        if self.mode == "async" and device_type not in ("cuda", "cpu"):
            return "sync"
        return self.mode


def _out_of_range(cfg: ActivationOffloadConfig) -> list[tuple[str, str]]:
    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    checks = {
        "enabled": (isinstance(cfg.enabled, bool), "expected true or false"),
        "mode": (cfg.mode in MODES, f"expected one of {', '.join(MODES)}"),
        "min_tensor_bytes": (is_int(cfg.min_tensor_bytes) and cfg.min_tensor_bytes >= 0, "expected an integer >= 0"),
        "max_pinned_bytes": (cfg.max_pinned_bytes is None or (is_int(cfg.max_pinned_bytes) and cfg.max_pinned_bytes >= 0),
                             "expected an integer >= 0, or None for no cap"),
        "offload_last_group": (isinstance(cfg.offload_last_group, bool), "expected true or false"),
        "prefetch_groups": (is_int(cfg.prefetch_groups) and cfg.prefetch_groups >= 1, "expected an integer >= 1"),
    }
    return [(name, f"{why}; got {getattr(cfg, name)!r}") for name, (ok, why) in checks.items() if not ok]


def knobs() -> tuple[dataclasses.Field[Any], ...]:
    """The fields, with their schema type and doc in `metadata` (the config layer's schema reads them)."""
    return dataclasses.fields(ActivationOffloadConfig)
