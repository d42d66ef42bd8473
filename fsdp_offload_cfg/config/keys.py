"""Every config key, defined once: names, type, default, environment variable, doc.

`KEYS` is the one table a key is written in. Everything else follows from it:
- the typed model (`model.FSDPOffloadConfig`: one field per key that has a field);
- the JSON Schema (`schema.build_schema`: one pattern property per spelling, its type from `TYPES`);
- the environment mapping (`ENV_VARS`, what `accelerate launch` exports and what `patch()` exports
  under torchrun or the Trainer, the plugin's own two keys included);
- the small sets the reader needs (`NULL_MEANS_UNSET`, `ALIASES`, `TRAINER_ONLY_KEYS`, ...).

The rest of this module is what we measured about accelerate and transformers that is not a
key: top-level keys of an accelerate file, per-consumer defaults, the Trainer's `fsdp` string.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

from fsdp_offload_cfg._sizes import AUTO_PATTERN
from fsdp_offload_cfg._sizes import PATTERN as SIZE_PATTERN
from fsdp_offload_cfg.offload.options import MODES, ActivationOffloadConfig, knobs

Layout = Literal["accelerate", "trainer", "mapping", "env"]
Owner = Literal["accelerate", "plugin", "trainer"]

SHARDING_STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
_IDENTIFIER = "[A-Za-z_][A-Za-z0-9_]*"


@dataclass(frozen=True)
class Key:
    """One fsdp_config key. `name` is the spelling without the optional `fsdp_` prefix."""

    name: str
    type: str  # a name in TYPES
    doc: str
    owner: Owner = "accelerate"  # who reads it: accelerate (and the Trainer), this plugin, or the Trainer alone
    default: Any = None  # the model's value when unset; None: unset (and `key: null` means unset)
    annotation: str = "Any"  # the model field's type, as written in a signature
    env: str | None = None  # the variable accelerate launch exports it as (or this plugin, for its own keys)
    fsdp1_only_env: bool = False  # accelerate reads the variable under FSDP1 only (launch exports it always)
    aliases: tuple[str, ...] = ()  # other names transformers' Trainer accepts for it
    field: bool = True  # False: accepted and checked, but not part of the model (Trainer-only keys)
    schema_default: Any = None  # the default the schema documents, where it differs from `default`


def _accelerate(name: str, type_: str, annotation: str, default: Any, doc: str, **kw: Any) -> Key:
    return Key(name, type_, doc, "accelerate", default, annotation, env="FSDP_" + name.upper(), **kw)


def _trainer_only(name: str, type_: str, doc: str) -> Key:
    return Key(name, type_, doc, "trainer", field=False)


KEYS: tuple[Key, ...] = (
    _accelerate("version", "version", "int", 2,
                "FSDP version. accelerate launch defaults to 1 when unset, transformers' Trainer to 2."),
    _accelerate("reshard_after_forward", "reshard_after_forward", "bool | str", True,
                "FSDP2: free gathered parameters after forward (true ~ ZeRO-3) or keep them until backward "
                "(false ~ ZeRO-2). FSDP1: a sharding strategy name."),
    _accelerate("sharding_strategy", "sharding_strategy", "str | None", None,
                "FSDP1 only (deprecated in accelerate in favour of reshard_after_forward).", fsdp1_only_env=True),
    _accelerate("offload_params", "boolish", "bool", False,
                "Offload parameters and gradients to the CPU (FSDP CPUOffload / CPUOffloadPolicy).",
                aliases=("cpu_offload",)),
    _accelerate("auto_wrap_policy", "auto_wrap_policy", "str | None", None,
                "How modules are wrapped into FSDP units. accelerate defaults to NO_WRAP, the Trainer to "
                "TRANSFORMER_BASED_WRAP."),
    Key("transformer_layer_cls_to_wrap", "class_names",
        "Layer classes wrapped by TRANSFORMER_BASED_WRAP (default, per model: the classes its "
        "_no_split_modules names that it has, or its sub-models' where it names none).",
        annotation="tuple[str, ...] | None", env="FSDP_TRANSFORMER_CLS_TO_WRAP"),
    _accelerate("min_num_params", "nonneg_int", "int | None", None, "Minimum parameters per unit for SIZE_BASED_WRAP."),
    _accelerate("backward_prefetch", "backward_prefetch", "str | None", None,
                "FSDP1 backward prefetch; ignored (with a warning from accelerate) under FSDP2.", fsdp1_only_env=True),
    _accelerate("forward_prefetch", "boolish", "bool", False,
                "FSDP1 forward prefetch; not implemented in FSDP2.", fsdp1_only_env=True),
    _accelerate("state_dict_type", "state_dict_type", "str | None", None,
                "Checkpoint format. accelerate defaults to FULL_STATE_DICT (FSDP1) / SHARDED_STATE_DICT (FSDP2)."),
    _accelerate("use_orig_params", "boolish", "bool", True,
                "FSDP1 use_orig_params; obsolete in FSDP2.", fsdp1_only_env=True),
    _accelerate("cpu_ram_efficient_loading", "boolish", "bool", False,
                "Only rank 0 reads the checkpoint; the other ranks build the model on the meta device. Turns on "
                "this plugin's loader."),
    _accelerate("sync_module_states", "boolish", "bool", True,
                "FSDP1: broadcast module states from rank 0 after wrapping. Must stay true with "
                "cpu_ram_efficient_loading.", fsdp1_only_env=True),
    _accelerate("activation_checkpointing", "boolish", "bool", False,
                "Recompute each wrapped layer's activations in backward."),
    _accelerate("activation_checkpointing_offload", "boolish", "bool", False,
                "accelerate's offload of checkpointed layer inputs to pinned CPU memory (FSDP2, needs "
                "activation_checkpointing)."),
    _accelerate("ignored_modules", "regex", "str | None", None,
                "Regular expression; modules whose names fully match are not sharded."),
    Key("activation_cpu_offload", "activation_cpu_offload",
        "fsdp_offload_cfg: offload saved activations to CPU memory during forward, prefetch them back in backward.",
        owner="plugin", default=ActivationOffloadConfig(), annotation="ActivationOffloadConfig",
        env="FSDP_ACTIVATION_CPU_OFFLOAD", schema_default=False),
    Key("load_strategy", "load_strategy",
        "fsdp_offload_cfg: how the ranks get their weights under cpu_ram_efficient_loading: auto (each rank "
        "reads its own slices where it can, rank 0 streams them to any rank that cannot, rank 0 loads whole "
        "where the checkpoint cannot be read slice by slice), broadcast (rank 0 reads and sends), or sharded "
        "(every rank reads its own slices).",
        owner="plugin", default="auto", annotation="str", env="FSDP_LOAD_STRATEGY"),
    Key("activation_memory_budget", "budget",
        "fsdp_offload_cfg, FSDP2: device memory for activations (bytes, or a size such as 12GiB), or auto: the "
        "device's memory less what the step holds besides activations (measured at the first training forward: "
        "parameters, buffers, the CUDA context; estimated: gradients, AdamW's state, the gathered layers), less a "
        "margin (auto keeps 10% of the device free, auto-2GiB or auto-5% another margin; the tightest rank "
        "decides). At the first training forward the plugin plans each decoder layer (keep, offload, checkpoint, "
        "or checkpoint with its input offloaded) so that the estimated activation peak fits, at the least "
        "estimated step time; it decides checkpointing, so activation_checkpointing stays false.",
        owner="plugin", annotation="int | str | None", env="FSDP_ACTIVATION_MEMORY_BUDGET"),
    Key("activation_budget_device_memory", "size",
        "fsdp_offload_cfg: the device memory activation_memory_budget: auto plans against, for this process "
        "(a GPU shared with other work; a CPU run, which has no device size to read). Unset: the GPU's total "
        "memory, less what other processes and the CUDA context hold.",
        owner="plugin", annotation="int | str | None", env="FSDP_ACTIVATION_BUDGET_DEVICE_MEMORY"),
    Key("activation_budget_compute_tflops", "positive_number",
        "fsdp_offload_cfg: the rate (TFLOP/s) activation_memory_budget plans a layer's compute at. Unset: "
        "measured on the device at the first training forward (a matmul of the model's width; the slowest "
        "rank's). Set it, with activation_budget_copy_gb_per_s, for the same plan on every run.",
        owner="plugin", annotation="float | None", env="FSDP_ACTIVATION_BUDGET_COMPUTE_TFLOPS"),
    Key("activation_budget_copy_gb_per_s", "positive_number",
        "fsdp_offload_cfg: the rate (GB/s, each way) activation_memory_budget plans the offload's copies at. "
        "Unset: measured on the device at the first training forward (a copy to the host and back; the "
        "slowest rank's).",
        owner="plugin", annotation="float | None", env="FSDP_ACTIVATION_BUDGET_COPY_GB_PER_S"),
    Key("expandable_segments", "boolish",
        "fsdp_offload_cfg: the CUDA caching allocator's expandable segments in each process (what "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True sets), so that reserved memory stays near allocated. "
        "Unset: on where activation_cpu_offload or activation_memory_budget is on and neither PYTORCH_ALLOC_CONF "
        "nor PYTORCH_CUDA_ALLOC_CONF is set (a variable you set leaves the allocator to you). false: torch's default.",
        owner="plugin", annotation="bool | None", env="FSDP_EXPANDABLE_SEGMENTS"),
    _trainer_only("limit_all_gathers", "boolish",
                  "transformers Trainer, FSDP1 only: rate-limit all-gathers. Accepted and not used by this plugin."),
    _trainer_only("xla", "boolish", "transformers Trainer: use PyTorch/XLA FSDP instead of accelerate's FSDP. "
                  "Not supported by this plugin (must be false)."),
    _trainer_only("xla_fsdp_v2", "boolish", "transformers Trainer: XLA SPMD FSDP. Accepted and not used by this plugin."),
    _trainer_only("xla_fsdp_grad_ckpt", "boolish",
                  "transformers Trainer: gradient checkpointing for XLA FSDP. Accepted and not used by this plugin."),
    _trainer_only("xla_fsdp_settings", "mapping",
                  "transformers Trainer: XLA FSDP wrapper arguments. Accepted and not used by this plugin."),
)
BY_NAME: dict[str, Key] = {k.name: k for k in KEYS}
FIELD_KEYS: tuple[Key, ...] = tuple(k for k in KEYS if k.field)

# -------------------------------------------------------------------------------------------
# Derived from KEYS
# -------------------------------------------------------------------------------------------

ALIASES: dict[str, str] = {alias: k.name for k in KEYS for alias in k.aliases}  # Trainer's cpu_offload
# Keys only transformers' Trainer reads: `accelerate launch` drops them without a word.
TRAINER_ONLY_KEYS = frozenset({k.name for k in KEYS if k.owner == "trainer"} | set(ALIASES))
PLUGIN_KEYS = frozenset(k.name for k in KEYS if k.owner == "plugin")  # accelerate never exports these
ALL_NAMES: tuple[str, ...] = tuple(n for k in KEYS for n in (k.name, *k.aliases))  # every accepted name
# `key: null` is "unset" where the field's default is None (accelerate skips None for those).
NULL_MEANS_UNSET = frozenset(k.name for k in FIELD_KEYS if k.default is None)
ENV_VARS: dict[str, str] = {k.env: k.name for k in KEYS if k.env}  # variable -> key
FSDP1_ONLY_ENV_KEYS = tuple(k.name for k in KEYS if k.fsdp1_only_env)

# -------------------------------------------------------------------------------------------
# Launch keys: the top-level keys of an accelerate file this plugin reads
# -------------------------------------------------------------------------------------------

DISTRIBUTED_TYPES = ["NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                     "MULTI_XPU", "DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM", "MULTI_HPU", "MULTI_NEURON"]


@dataclass(frozen=True)
class LaunchKey:
    """A top-level key of an accelerate config file, read as accelerate reads it."""

    name: str
    schema: dict[str, Any]
    annotation: str
    env: str | None  # what the launcher exports it as to its workers
    case_sensitive: bool  # accelerate builds an enum from the exact text: `distributed_type: fsdp` is refused
    flag: str | None = None  # the `accelerate launch` flag that sets it over the file (`--cpu` for use_cpu)


LAUNCH: tuple[LaunchKey, ...] = (
    LaunchKey("distributed_type", {"description": "one of " + ", ".join(DISTRIBUTED_TYPES), "enum": DISTRIBUTED_TYPES},
              "str | None", None, case_sensitive=True),
    LaunchKey("mixed_precision", {"description": "one of no, fp8, fp16, bf16", "enum": ["no", "fp8", "fp16", "bf16"]},
              "str | None", "ACCELERATE_MIXED_PRECISION", case_sensitive=False, flag="--mixed_precision"),
    LaunchKey("num_processes", {"description": "an integer >= 1, or -1 (decided at launch)",
                                "anyOf": [{"type": "integer", "minimum": 1}, {"const": -1}]},
              "int | None", "WORLD_SIZE", case_sensitive=False, flag="--num_processes"),
    LaunchKey("use_cpu", {"$ref": "#/$defs/boolish"}, "bool | None", "ACCELERATE_USE_CPU", case_sensitive=False,
              flag="--cpu"),
    # HSDP, tensor and context parallelism under FSDP2; its keys are checked against the installed
    # accelerate's (`sources._parallelism_problems`). accelerate launch exports it as
    # PARALLELISM_CONFIG_* variables (`integrations.common.launch_sections_env`), not as one variable.
    LaunchKey("parallelism_config", {"description": "a mapping of parallelism_config_* keys", "type": "object"},
              "dict[str, Any] | None", None, case_sensitive=True),
    # torch.compile through accelerate; exported as ACCELERATE_DYNAMO_* (`integrations.common.launch_sections_env`).
    # The legacy top-level `dynamo_backend` is read into it, as accelerate reads it.
    LaunchKey("dynamo_config", {"description": "a mapping of dynamo_* keys", "type": "object"},
              "dict[str, Any] | None", None, case_sensitive=True),
    # accelerate's checks of collectives' shapes across ranks (`--debug`) and each process pinned
    # to the CPU cores of its GPU's NUMA node (`--enable_cpu_affinity`): exported under torchrun
    # too (`integrations.common.accelerate_env`), where a file's `true` did nothing before
    LaunchKey("debug", {"$ref": "#/$defs/boolish"}, "bool | None", "ACCELERATE_DEBUG_MODE", case_sensitive=False,
              flag="--debug"),
    LaunchKey("enable_cpu_affinity", {"$ref": "#/$defs/boolish"}, "bool | None", "ACCELERATE_CPU_AFFINITY",
              case_sensitive=False, flag="--enable_cpu_affinity"),
)
LAUNCH_KEYS: tuple[str, ...] = tuple(k.name for k in LAUNCH)
LAUNCH_ENV_VARS: dict[str, str] = {k.name: k.env for k in LAUNCH if k.env}
LAUNCH_FLAGS: dict[str, str] = {k.name: k.flag for k in LAUNCH if k.flag}  # key -> `accelerate launch` flag

# -------------------------------------------------------------------------------------------
# Value types ($defs of the schema)
# -------------------------------------------------------------------------------------------


def _enum_or_number(names: list[str]) -> dict[str, Any]:
    return {"description": f"one of {', '.join(names)} (or its number 1-{len(names)})",
            "anyOf": [{"enum": names}, {"type": "integer", "minimum": 1, "maximum": len(names)}]}


def _offload_options() -> dict[str, Any]:
    props = {}
    for f in knobs():
        node: dict[str, Any] = {"$ref": f"#/$defs/{f.metadata['type']}",
                                "default": True if f.name == "enabled" else f.default}
        props[f.name] = node
    return {"description": "activation CPU offload options; a mapping without `enabled` means enabled",
            "type": "object", "properties": props, "additionalProperties": False}


TYPES: dict[str, dict[str, Any]] = {
    "boolish": {"description": 'true or false (a boolean, or the string "true"/"false")',
                "anyOf": [{"type": "boolean"}, {"enum": ["true", "false", "True", "False", "TRUE", "FALSE"]}]},
    "version": {"description": "1 or 2", "type": "integer", "enum": [1, 2]},
    "sharding_strategy": _enum_or_number(SHARDING_STRATEGIES),
    "reshard_after_forward": {
        "description": "true or false (FSDP2), or for FSDP1 one of " + ", ".join(SHARDING_STRATEGIES)
                       + " (or its number 1-5)",
        "anyOf": [{"$ref": "#/$defs/boolish"}, {"$ref": "#/$defs/sharding_strategy"}]},
    "auto_wrap_policy": {"description": "one of TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP",
                         "enum": ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]},
    "backward_prefetch": {"description": "one of BACKWARD_PRE, BACKWARD_POST, NO_PREFETCH (or its number 1-2)",
                          "anyOf": [{"enum": ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]},
                                    {"type": "integer", "minimum": 1, "maximum": 2}]},
    "state_dict_type": _enum_or_number(["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"]),
    "class_names": {
        "description": 'a class name, comma-separated class names without spaces ("LlamaDecoderLayer,LlamaMLP"), '
                       "or a list of class names",
        "anyOf": [{"type": "string", "pattern": f"^{_IDENTIFIER}(,{_IDENTIFIER})*$"},
                  {"type": "array", "minItems": 1, "items": {"type": "string", "pattern": f"^{_IDENTIFIER}$"}}]},
    "nonneg_int": {"description": "an integer >= 0", "type": "integer", "minimum": 0},
    "optional_nonneg_int": {"description": "an integer >= 0, or null for no cap",
                            "anyOf": [{"$ref": "#/$defs/nonneg_int"}, {"type": "null"}]},
    "positive_int": {"description": "an integer >= 1", "type": "integer", "minimum": 1},
    "positive_number": {"description": "a number > 0", "type": "number", "exclusiveMinimum": 0},
    "regex": {"description": "a non-empty regular expression string", "type": "string", "minLength": 1},
    "mapping": {"description": "a mapping", "type": "object"},
    "size": {"description": "bytes as an integer >= 1, or a size such as 12GiB (KB, MB, GB, TB, KiB, MiB, GiB, TiB)",
             "anyOf": [{"type": "integer", "minimum": 1}, {"type": "string", "pattern": SIZE_PATTERN}]},
    "budget": {"description": "bytes as an integer >= 1, a size such as 12GiB, or auto, auto-2GiB, auto-5%",
               "anyOf": [{"$ref": "#/$defs/size"}, {"type": "string", "pattern": AUTO_PATTERN}]},
    "load_strategy": {"description": "one of auto, broadcast, sharded", "enum": ["auto", "broadcast", "sharded"]},
    "offload_mode": {"description": "one of " + ", ".join(MODES), "enum": list(MODES)},
    "activation_cpu_offload": {
        "if": {"type": "object"},
        "then": {"$ref": "#/$defs/activation_offload_options"},
        "else": {"description": "true, false, or a mapping with " + ", ".join(f.name for f in knobs()),
                 "anyOf": [{"$ref": "#/$defs/boolish"}]}},
    "activation_offload_options": _offload_options(),
    "launch": {"description": "The top-level keys of an accelerate config file that fsdp_offload_cfg reads.",
               "type": "object", "properties": {k.name: k.schema for k in LAUNCH}},
}
# accelerate numbers these enums from 1 in this order (FSDP_SHARDING_STRATEGY.index(...) + 1).
NUMBERED_ENUMS = ("sharding_strategy", "backward_prefetch", "state_dict_type")

# -------------------------------------------------------------------------------------------
# What accelerate and transformers do that is not a key
# -------------------------------------------------------------------------------------------

# Top-level keys of an accelerate 1.15 config file (ClusterConfig and SageMakerConfig fields,
# plus the legacy `fp16` / `dynamo_backend`). accelerate refuses any other top-level key.
ACCELERATE_TOP_KEYS = frozenset({
    "additional_args", "base_job_name", "command_file", "commands", "compute_environment", "debug",
    "deepspeed_config", "distributed_type", "downcast_bf16", "dynamo_backend", "dynamo_config",
    "ec2_instance_type", "enable_cpu_affinity", "fp16", "fp8_config", "fsdp_config", "gpu_ids",
    "iam_role_name", "image_uri", "machine_rank", "main_process_ip", "main_process_port",
    "main_training_function", "megatron_lm_config", "mixed_precision", "mpirun_config",
    "num_machines", "num_processes", "parallelism_config", "profile", "py_version",
    "pytorch_version", "rdzv_backend", "region", "sagemaker_inputs_file", "sagemaker_metrics_file",
    "same_network", "tpu_env", "tpu_name", "tpu_use_cluster", "tpu_use_sudo", "tpu_vm", "tpu_zone",
    "transformers_version", "use_cpu",
})
# The names accelerate 1.15's `accelerate launch` reads from a file's `parallelism_config` section
# (its `--parallelism_config_*` arguments); `parallelism_config_keys()` reads the installed version's.
PARALLELISM_CONFIG_KEYS_1_15 = frozenset(f"parallelism_config_{name}" for name in (
    "dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_backend", "cp_comm_strategy", "sp_size",
    "sp_backend", "sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation"))


def _launch_dests(prefix: str, fallback: frozenset[str]) -> frozenset[str]:
    """The installed `accelerate launch` parser's argument names starting with `prefix`;
    accelerate 1.15's names (`fallback`) where that cannot be read."""
    try:
        from accelerate.commands.launch import launch_command_parser

        names = frozenset(a.dest for a in launch_command_parser()._actions if a.dest.startswith(prefix))
    except Exception:  # noqa: BLE001 - accelerate missing or its parser changed: the names we know
        return fallback
    return names or fallback


@functools.cache
def parallelism_config_keys() -> frozenset[str]:
    """The `parallelism_config` keys the installed accelerate reads. `accelerate launch` copies each
    key of the section onto its arguments by name and reads only its own `parallelism_config_*`
    ones, so any other key is dropped without a word; which ones it has depends on its version
    (1.10: dp_replicate, dp_shard, tp, cp sizes and cp_comm_strategy; 1.15 adds cp_backend and
    the sp_* keys)."""
    return _launch_dests("parallelism_config_", PARALLELISM_CONFIG_KEYS_1_15)


DYNAMO_CONFIG_KEYS_1_15 = frozenset({"dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic",
                                     "dynamo_use_regional_compilation"})


@functools.cache
def dynamo_config_keys() -> frozenset[str]:
    """The `dynamo_config` keys the installed accelerate reads (its `--dynamo_*` arguments; a key
    of the section without the `dynamo_` prefix gets it, any other is dropped without a word)."""
    return _launch_dests("dynamo_", DYNAMO_CONFIG_KEYS_1_15)


# What each consumer does when fsdp_config has no version.
VERSION_DEFAULT: dict[Layout, int] = {"accelerate": 1, "env": 1, "trainer": 2, "mapping": 2}
# cpu_ram_efficient_loading where the source leaves it unset: `accelerate launch` defaults its
# --fsdp_cpu_ram_efficient_loading to true (1.10-1.15) and exports it, so an accelerate file
# without the key loads on rank 0 under it; the same file under torchrun (`patch("F")`) must too.
# accelerate's plugin reads false from an environment without the variable; the Trainer's
# fsdp_config defaults it to false.
EFFICIENT_LOADING_DEFAULT: dict[Layout, bool] = {"accelerate": True, "env": False, "trainer": False, "mapping": False}
# transformers' Trainer fills these in; accelerate leaves them to the plugin.
TRAINER_DEFAULTS = {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "state_dict_type": "FULL_STATE_DICT"}
# The Trainer's legacy `fsdp` option string ("full_shard auto_wrap offload").
TRAINER_FSDP_OPTIONS = (
    "full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2", "offload", "auto_wrap",
)
# accelerate to-fsdp2: FSDP1 sharding strategy -> FSDP2 reshard_after_forward.
FSDP2_RESHARD_FOR = {
    "FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True, "HYBRID_SHARD_ZERO2": False, "NO_SHARD": False,
}
