"""The rules between keys, as named objects in one list (`RULES`), checked on effective values.

The JSON Schema sees one key at a time and no defaults; these rules see the config as it will
run (defaults filled in per consumer: accelerate's FSDP1 default, the Trainer's FSDP2). Each
rule names the keys it reads and is skipped when one of them already had a problem, so a typo
gives one message, not a cascade. Messages name keys the way the user spelled them (see
`RuleContext.spell`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fsdp_offload_cfg._sizes import parse_auto, size_in_bytes
from fsdp_offload_cfg.config.keys import FSDP2_RESHARD_FOR, LAUNCH_KEYS, SHARDING_STRATEGIES, Layout
from fsdp_offload_cfg.config.schema import show


@dataclass(frozen=True)
class RuleContext:
    """What a rule sees: effective values, which keys the user set, and how the user spelled them."""

    values: Mapping[str, Any]  # canonical key -> typed value, defaults filled in
    explicit: frozenset[str]  # keys the source set (launch keys included)
    raw: Mapping[str, Any]  # canonical key -> the value as written, before typing (for messages)
    written: Mapping[str, str]  # canonical key -> its path as the user spelled it
    layout: Layout
    prefixed: bool  # the source spells fsdp_config keys with `fsdp_`
    fsdp_keys_given: bool  # the source has a non-empty fsdp_config (not one rebuilt from a config object)

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    @property
    def version(self) -> int:
        return self.values["version"]

    def spell(self, key: str) -> str:
        """`key` as the user wrote it, or as they would write it (their `fsdp_` habit). Never the
        Trainer's `fsdp` option string that may have set it: messages name the key to write, and
        advice to write `fsdp: false` would turn FSDP off."""
        if key in self.written and self.written[key] != "fsdp":
            return self.written[key].rpartition(".")[2]
        return f"fsdp_{key}" if self.prefixed and key not in LAUNCH_KEYS else key

    def where(self, key: str) -> str:
        """The key path a problem with `key` is reported at."""
        if key in self.written:
            return self.written[key]
        nested = self.layout in ("accelerate", "trainer") and key not in LAUNCH_KEYS
        return ("fsdp_config." if nested else "") + self.spell(key)

    def shown(self, key: str) -> str:
        """The value of `key` as the user wrote it (`1`, not the `FULL_SHARD` it stands for)."""
        return show(self.raw[key] if key in self.raw else self.values[key])

    def why_efficient_loading(self) -> str:
        if "cpu_ram_efficient_loading" in self.explicit or self.layout != "accelerate":
            return ""
        return f" ({self.spell('cpu_ram_efficient_loading')} is unset; accelerate launch defaults it to true)"

    def why_version(self) -> str:
        if "version" in self.explicit:
            return ""
        return f" ({self.spell('version')} is unset; {self.layout} defaults to {self.version})"


@dataclass(frozen=True)
class Rule:
    """One rule: when `broken(ctx)`, report `message(ctx)` at `at`, unless one of `keys` is already bad."""

    name: str
    keys: tuple[str, ...]
    at: str
    broken: Callable[[RuleContext], bool]
    message: Callable[[RuleContext], str]


def fsdp2_form(strategy: str, layout: Layout, reshard_key: str, replicas: bool = False) -> str:
    """What to write under FSDP2 for an FSDP1 sharding strategy. `accelerate to-fsdp2` maps every
    strategy to a `reshard_after_forward` bool, but for two of them the bool alone is not the same
    run: HYBRID_SHARD's replicas are a 2-D mesh in FSDP2 (accelerate's `parallelism_config`), and
    with the bool alone the job shards over every rank and replicates nothing; NO_SHARD has no FSDP2
    form at all (FSDP2 always shards), its run is DDP's. `replicas`: the config has that mesh already."""
    reshard = f"{reshard_key}: {str(FSDP2_RESHARD_FOR[strategy]).lower()}"
    if _the_bool_is_the_strategy(strategy, replicas):
        return f"use {reshard} instead" + (" (the parallelism_config section makes the replicas)" if replicas else "")
    if strategy == "NO_SHARD":
        ddp = "distributed_type: MULTI_GPU" if layout in ("accelerate", "env") else "no fsdp in TrainingArguments"
        return (f"FSDP2 always shards the parameters: for every rank to hold the whole model use DDP ({ddp}); "
                f"{reshard} is the nearest FSDP2 setting")
    return f"FSDP2 shards hybrid over a 2-D mesh: {_hybrid_mesh(layout)}, with {reshard}"


def _the_bool_is_the_strategy(strategy: str, replicas: bool) -> bool:
    """`reshard_after_forward` alone runs `strategy` under FSDP2 (HYBRID_SHARD only beside the mesh)."""
    return strategy in ("FULL_SHARD", "SHARD_GRAD_OP") or (replicas and strategy.startswith("HYBRID"))


def _has_replicas(ctx: RuleContext) -> bool:
    """The config file's `parallelism_config` section asks for more than one replica."""
    section = ctx.values.get("parallelism_config") or {}
    replicas = section.get("parallelism_config_dp_replicate_size") if isinstance(section, Mapping) else None
    return isinstance(replicas, int) and replicas > 1


def _hybrid_mesh(layout: Layout) -> str:
    if layout in ("accelerate", "env"):
        return ("add to the config file a parallelism_config section with parallelism_config_dp_replicate_size "
                "(the replicas, such as one per node) and parallelism_config_dp_shard_size (the ranks in each; "
                "the two multiply to the number of processes)")
    return ("pass ParallelismConfig(dp_replicate_size=<the replicas, such as one per node>, dp_shard_size=<the "
            "ranks in each>) from accelerate.parallelism_config as TrainingArguments' or the Accelerator's "
            "parallelism_config (the two multiply to the number of processes)")


def _fsdp2_reshard_name(ctx: RuleContext) -> str:
    value = ctx["reshard_after_forward"]
    mapped = (f"FSDP2{ctx.why_version()} needs true or false; got {ctx.shown('reshard_after_forward')} "
              f"(accelerate to-fsdp2 maps {value} to {str(FSDP2_RESHARD_FOR[value]).lower()})")
    if _the_bool_is_the_strategy(value, _has_replicas(ctx)):
        return mapped
    form = fsdp2_form(value, ctx.layout, ctx.spell("reshard_after_forward"))
    return f"{mapped}, but that bool alone is not {value}: {form}"


RULES: tuple[Rule, ...] = (
    Rule("fsdp2-reshard-is-a-bool", ("version", "reshard_after_forward"), "reshard_after_forward",
         lambda c: c.version == 2 and not isinstance(c["reshard_after_forward"], bool), _fsdp2_reshard_name),
    Rule("fsdp1-reshard-is-a-strategy", ("version", "reshard_after_forward"), "reshard_after_forward",
         lambda c: c.version == 1 and isinstance(c["reshard_after_forward"], bool),
         lambda c: f"FSDP1{c.why_version()} needs a sharding strategy ({', '.join(SHARDING_STRATEGIES)}); "
                   f"got {c.shown('reshard_after_forward')}"),
    Rule("sharding-strategy-is-fsdp1-only", ("version", "sharding_strategy"), "sharding_strategy",
         lambda c: c.version == 2 and "sharding_strategy" in c.explicit,
         lambda c: f"is FSDP1-only and ignored by FSDP2{c.why_version()}; " + fsdp2_form(
             c["sharding_strategy"], c.layout, c.spell("reshard_after_forward"), _has_replicas(c))),
    Rule("efficient-loading-needs-sync", ("cpu_ram_efficient_loading", "sync_module_states"), "sync_module_states",
         lambda c: c["cpu_ram_efficient_loading"] and not c["sync_module_states"],
         lambda c: f"must be true when {c.spell('cpu_ram_efficient_loading')} is true{c.why_efficient_loading()} "
                   "(accelerate launch refuses the combination: ranks other than 0 would keep empty weights)"),
    Rule("load-strategy-needs-efficient-loading", ("load_strategy", "cpu_ram_efficient_loading"), "load_strategy",
         lambda c: "load_strategy" in c.explicit and not c["cpu_ram_efficient_loading"],
         lambda c: f"only applies with {c.spell('cpu_ram_efficient_loading')}: true; here it would do nothing"),
    Rule("load-strategy-needs-fsdp2", ("load_strategy", "version", "cpu_ram_efficient_loading"), "load_strategy",
         lambda c: "load_strategy" in c.explicit and c["cpu_ram_efficient_loading"] and c.version == 1,
         lambda c: f"only applies with FSDP2 ({c.spell('version')}: 2){c.why_version()}: under FSDP1 accelerate "
                   "loads the model itself and this key would do nothing"),
    Rule("checkpointing-offload-needs-checkpointing",
         ("activation_checkpointing_offload", "activation_checkpointing"), "activation_checkpointing_offload",
         lambda c: c["activation_checkpointing_offload"] and not c["activation_checkpointing"],
         lambda c: f"needs {c.spell('activation_checkpointing')}: true (accelerate raises otherwise)"),
    Rule("checkpointing-offload-needs-fsdp2", ("activation_checkpointing_offload", "version"),
         "activation_checkpointing_offload",
         lambda c: c["activation_checkpointing_offload"] and c.version == 1,
         lambda c: f"needs FSDP2 ({c.spell('version')}: 2){c.why_version()}"),
    Rule("one-activation-offload", ("activation_checkpointing_offload", "activation_cpu_offload"),
         "activation_cpu_offload",
         lambda c: c["activation_checkpointing_offload"] and c["activation_cpu_offload"].enabled,
         lambda c: f"cannot be combined with {c.spell('activation_checkpointing_offload')}: both would move the "
                   "checkpoint inputs to the host; keep this one (async, filtered) and drop the other"),
    Rule("budget-is-positive", ("activation_memory_budget",), "activation_memory_budget",
         lambda c: c["activation_memory_budget"] is not None and size_in_bytes(c["activation_memory_budget"]) is None
         and parse_auto(c["activation_memory_budget"]) is None,
         lambda c: f"expected a size from 1 byte to 1 PiB (bytes, or such as 12GiB), or auto with an optional margin "
                   f"below the device's size (auto, auto-2GiB, auto-5%); got {c.shown('activation_memory_budget')}"),
    Rule("device-memory-needs-auto", ("activation_budget_device_memory", "activation_memory_budget"),
         "activation_budget_device_memory",
         lambda c: c["activation_budget_device_memory"] is not None
         and parse_auto(c["activation_memory_budget"]) is None,
         lambda c: f"is the device size {c.spell('activation_memory_budget')}: auto plans against, and that key is "
                   f"{'unset' if c['activation_memory_budget'] is None else 'a fixed size'}; set it to auto, or drop "
                   "this one"),
    # a file written for the CPU: what the run would say at its first forward, after loading
    Rule("auto-on-the-cpu-needs-a-device-size",
         ("activation_memory_budget", "activation_budget_device_memory", "use_cpu"), "activation_memory_budget",
         lambda c: c["use_cpu"] is True and parse_auto(c["activation_memory_budget"]) is not None
         and c["activation_budget_device_memory"] is None,
         lambda c: f"auto reads the device's memory from CUDA, and {c.spell('use_cpu')}: true computes on the CPU: "
                   f"state the size to plan against with {c.spell('activation_budget_device_memory')} (such as "
                   "8GiB), or give the budget in bytes"),
    Rule("device-memory-is-a-size", ("activation_budget_device_memory",), "activation_budget_device_memory",
         lambda c: c["activation_budget_device_memory"] is not None
         and size_in_bytes(c["activation_budget_device_memory"]) is None,
         lambda c: f"expected a size from 1 byte to 1 PiB (bytes, or such as 80GiB); got "
                   f"{c.shown('activation_budget_device_memory')}"),
    Rule("budget-needs-fsdp2", ("activation_memory_budget", "version"), "activation_memory_budget",
         lambda c: c["activation_memory_budget"] is not None and c.version == 1,
         lambda c: f"plans FSDP2 layers ({c.spell('version')}: 2){c.why_version()}; under FSDP1 it would do nothing"),
    Rule("budget-decides-checkpointing", ("activation_memory_budget", "activation_checkpointing"),
         "activation_checkpointing",
         lambda c: c["activation_memory_budget"] is not None and c["activation_checkpointing"],
         lambda c: f"must stay false with {c.spell('activation_memory_budget')}: the budget's plan decides which "
                   "layers to checkpoint (every layer, if that is what fits); drop one of the two"),
    *(Rule(f"{rate}-needs-a-budget", (rate, "activation_memory_budget"), rate,
           lambda c, rate=rate: c[rate] is not None and c["activation_memory_budget"] is None,
           lambda c: f"only sets the rate {c.spell('activation_memory_budget')}'s plan is made at, and that key is "
                     "unset; set it (such as 12GiB), or drop this one")
      for rate in ("activation_budget_compute_tflops", "activation_budget_copy_gb_per_s")),
    Rule("parallelism-needs-fsdp2", ("parallelism_config", "version", "distributed_type"), "parallelism_config",
         lambda c: bool(c["parallelism_config"]) and (c.version == 1 or c["distributed_type"] != "FSDP"),
         lambda c: f"needs FSDP2 (distributed_type: FSDP and {c.spell('version')}: 2){c.why_version()}: accelerate "
                   "launch refuses a parallelism_config without it; drop the section or switch to FSDP2"),
    Rule("no-forward-prefetch-in-fsdp2", ("forward_prefetch", "version"), "forward_prefetch",
         lambda c: c["forward_prefetch"] and c.version == 2,
         lambda c: f"is not implemented in FSDP2{c.why_version()} (accelerate raises); remove it"),
    Rule("no-local-state-dict-in-fsdp2", ("state_dict_type", "version"), "state_dict_type",
         lambda c: c["state_dict_type"] == "LOCAL_STATE_DICT" and c.version == 2,
         lambda c: f"FSDP2{c.why_version()} does not support LOCAL_STATE_DICT; use SHARDED_STATE_DICT or "
                   "FULL_STATE_DICT"),
    Rule("no-xla", ("xla",), "xla", lambda c: c["xla"] is True,
         lambda c: "XLA FSDP bypasses accelerate's FSDP plugin, so fsdp_offload_cfg cannot act on it; set it to false"),
    Rule("fsdp-needs-distributed-type", ("distributed_type",), "distributed_type",
         lambda c: c.layout == "accelerate" and c.fsdp_keys_given and c["distributed_type"] is None,
         lambda c: "missing: accelerate requires it; set distributed_type: FSDP"),
    Rule("fsdp-config-needs-fsdp", ("distributed_type",), "distributed_type",
         lambda c: c.layout == "accelerate" and c.fsdp_keys_given and c["distributed_type"] not in (None, "FSDP"),
         lambda c: f"is {c['distributed_type']}, so accelerate ignores fsdp_config; set distributed_type: FSDP"),
)


def broken_rules(ctx: RuleContext, bad: set[str]) -> list[tuple[str, str]]:
    """`(where, message)` for every rule `ctx` breaks whose keys are all fine so far."""
    return [(ctx.where(rule.at), rule.message(ctx))
            for rule in RULES if not set(rule.keys) & bad and rule.broken(ctx)]
