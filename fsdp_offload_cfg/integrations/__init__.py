"""The patches, one module per target: `accelerate`, `transformers`, `trl`, `peft` (what each
replacement does to that library), and `common` (what they share: the config's predicates, the
environment, offload, logging). Adding a framework is one module with its `PATCHES` and its test.

`PATCHES` is the application order; `plan_for` is what a config needs here, checks included.
Replacements stay thin: the real work lives in `fsdp_offload_cfg.loading` and
`fsdp_offload_cfg.offload`.
"""

from __future__ import annotations

from fsdp_offload_cfg import registry
from fsdp_offload_cfg.config import ConfigError, FSDPOffloadConfig
from fsdp_offload_cfg.integrations import accelerate, peft, transformers, trl
from fsdp_offload_cfg.integrations.common import (
    EXPANDABLE_SEGMENTS_TEXT,
    accelerate_env,
    accelerator_state_exists,
    cpu_fsdp_needed,
    enable_offload,
    environment_problems,
    expandable_segments_wanted,
    fsdp_requested,
    loader_enabled,
    log_active,
)
from fsdp_offload_cfg.registry import LaunchContext

_ORDER = [
    "cpu-fsdp-state", "cpu-fsdp-accelerator-state", "cpu-fsdp1-state-dict", "cpu-fsdp1-optim-state-dict",
    "loader-from-pretrained", "rank0-from-config",
    "prepare-model-alone", "prepare-fsdp2", "fsdp2-prepare-model", "fsdp2-prepare-model-utils", "fsdp2-prepare-model-utils-export",
    "default-layer-classes", "trl-prepare-fsdp", "axolotl-trl-prepare-fsdp", "trl-forward-redirection",
    "resize-token-embeddings", "peft-adapters-on-host", "peft-load-adapter-keys-only",
    "peft-save-pretrained-sharded",
    "prepare-model-eval-copy", "fsdp1-prepare-model",
    "save-pretrained-sharded", "accelerator-save-model", "trainer-checkpoint-folder", "trainer-final-model", "trainer-fsdp-config",
]  # fmt: skip
_BY_NAME = {p.name: p for module in (accelerate, transformers, trl, peft) for p in module.PATCHES}
PATCHES = [_BY_NAME[name] for name in _ORDER]
assert len(PATCHES) == len(_BY_NAME), sorted(set(_BY_NAME) - set(_ORDER))


def plan_for(cfg: FSDPOffloadConfig, source: str, ctx: LaunchContext) -> registry.Plan:
    """The patches and environment `cfg` needs in `ctx`, after every check that can refuse it."""
    problems = environment_problems(cfg, ctx)
    if problems:
        raise ConfigError("\n".join(problems))
    return registry.plan(cfg, source, PATCHES, ctx, accelerate_env(cfg, ctx),
                         replan=lambda later, where: plan_for(later, where, LaunchContext.from_environ()),
                         expandable_segments=expandable_segments_wanted(cfg, ctx))


__all__ = [
    "EXPANDABLE_SEGMENTS_TEXT", "PATCHES", "accelerate_env", "accelerator_state_exists", "cpu_fsdp_needed", "enable_offload",
    "environment_problems", "expandable_segments_wanted", "fsdp_requested", "loader_enabled", "log_active", "plan_for",
]  # fmt: skip
