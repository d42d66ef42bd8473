"""Typed, frozen view of a user's FSDP config (accelerate YAML, Trainer/ms-swift JSON or a mapping).

The loading, normalisation and validation logic lives here too (see `load_config`).
Every other module consumes only `FSDPOffloadConfig`; nothing downstream reads raw dicts.

Pipeline (docs/config.md has the user-facing version):

    file | dict | FSDPOffloadConfig
      -> plain dict (omegaconf reads files; no interpolation, nothing executed)
      -> layout detected from the top-level keys (accelerate / trainer / bare mapping)
      -> overrides ("fsdp_config.key=value" dotlist or a mapping) merged in
      -> keys canonicalised (`fsdp_` prefix optional, `cpu_offload` alias), values coerced
      -> JSON Schema (fsdp_offload_cfg.schema) -> rules between keys -> FSDPOffloadConfig

Every problem found on the way is collected; one `ConfigError` reports them all.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fsdp_offload_cfg import schema as _schema

OffloadMode = Literal["auto", "async", "sync"]
LoadStrategy = Literal["broadcast", "sharded"]
Layout = Literal["accelerate", "trainer", "mapping", "env"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: where (file, key path) and what was expected."""

    file: str
    path: str
    message: str

    def __str__(self) -> str:
        return ": ".join(part for part in (self.file, self.path, self.message) if part)


class ConfigError(ValueError):
    """Every problem found in a config, reported together (file, key path, what was expected).

    `problems` holds them one by one (the CLI prints them as JSON). `unreadable` is True when
    the file itself could not be read or parsed, as opposed to holding bad values.
    """

    def __init__(self, problems: Sequence[Problem] | str, *, unreadable: bool = False) -> None:
        if isinstance(problems, str):
            problems = [Problem("", "", problems)]
        self.problems: list[Problem] = list(problems)
        self.unreadable = unreadable
        super().__init__("\n".join(str(p) for p in self.problems))

    def __reduce__(self) -> tuple[Any, ...]:  # survive pickling between processes, problems included
        return (type(self), (self.problems,), {"unreadable": self.unreadable})


@dataclass(frozen=True)
class ActivationOffloadConfig:
    """Knobs of the activation CPU offload (`activation_cpu_offload` key: bool or object)."""

    enabled: bool = False
    mode: OffloadMode = "auto"  # auto: async on CUDA, sync elsewhere
    min_tensor_bytes: int = 1024  # smaller saved tensors stay on the device
    max_pinned_bytes: int | None = None  # pinned-pool cap; past it tensors stay on the device
    offload_last_group: bool = False  # the last group is needed first in backward
    prefetch_groups: int = 1  # how many groups ahead backward reloads (double buffer = 1)


@dataclass(frozen=True)
class FSDPOffloadConfig:
    """Normalised fsdp_config plus the launch keys we read; defaults filled in."""

    # accelerate's fsdp_config keys (names without the `fsdp_` prefix)
    version: int = 2
    reshard_after_forward: bool | str = True
    sharding_strategy: str | None = None
    offload_params: bool = False
    auto_wrap_policy: str | None = None
    transformer_layer_cls_to_wrap: tuple[str, ...] | None = None
    min_num_params: int | None = None
    backward_prefetch: str | None = None
    forward_prefetch: bool = False
    state_dict_type: str | None = None
    use_orig_params: bool = True
    cpu_ram_efficient_loading: bool = False
    sync_module_states: bool = True
    activation_checkpointing: bool = False
    activation_checkpointing_offload: bool = False
    ignored_modules: str | None = None
    # this plugin's keys
    activation_cpu_offload: ActivationOffloadConfig = field(default_factory=ActivationOffloadConfig)
    load_strategy: LoadStrategy = "broadcast"
    # launch keys read from a whole accelerate YAML (None when the source had none)
    distributed_type: str | None = None
    mixed_precision: str | None = None
    num_processes: int | None = None
    use_cpu: bool | None = None
    # where it came from, for messages ("examples/fsdp2.yaml", "<dict>", "env FSDP_*")
    source: str = "<defaults>"


# -------------------------------------------------------------------------------------------
# What the sources look like
# -------------------------------------------------------------------------------------------

LAUNCH_KEYS = ("distributed_type", "mixed_precision", "num_processes", "use_cpu")
# transformers' TrainingArguments spells offload_params `cpu_offload`.
ALIASES = {"cpu_offload": "offload_params"}
# Keys only transformers' Trainer reads: `accelerate launch` would drop them without a word.
TRAINER_ONLY_KEYS = frozenset(
    {"cpu_offload", "limit_all_gathers", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings"}
)
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
# `key: null` is "unset" where the field's default is None (accelerate skips None for those).
NULL_MEANS_UNSET = frozenset(
    {"sharding_strategy", "auto_wrap_policy", "transformer_layer_cls_to_wrap", "min_num_params",
     "backward_prefetch", "state_dict_type", "ignored_modules"}
)
# What each consumer does when fsdp_config has no version.
VERSION_DEFAULT: dict[Layout, int] = {"accelerate": 1, "env": 1, "trainer": 2, "mapping": 2}
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

ENV_VARS = {  # accelerate/utils/launch.py exports these; the last two are this plugin's own
    "FSDP_VERSION": "version",
    "FSDP_RESHARD_AFTER_FORWARD": "reshard_after_forward",
    "FSDP_SHARDING_STRATEGY": "sharding_strategy",
    "FSDP_OFFLOAD_PARAMS": "offload_params",
    "FSDP_MIN_NUM_PARAMS": "min_num_params",
    "FSDP_AUTO_WRAP_POLICY": "auto_wrap_policy",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "transformer_layer_cls_to_wrap",
    "FSDP_BACKWARD_PREFETCH": "backward_prefetch",
    "FSDP_STATE_DICT_TYPE": "state_dict_type",
    "FSDP_FORWARD_PREFETCH": "forward_prefetch",
    "FSDP_USE_ORIG_PARAMS": "use_orig_params",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "cpu_ram_efficient_loading",
    "FSDP_SYNC_MODULE_STATES": "sync_module_states",
    "FSDP_ACTIVATION_CHECKPOINTING": "activation_checkpointing",
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "activation_checkpointing_offload",
    "FSDP_IGNORED_MODULES": "ignored_modules",
    "FSDP_ACTIVATION_CPU_OFFLOAD": "activation_cpu_offload",
    "FSDP_LOAD_STRATEGY": "load_strategy",
}
# accelerate's plugin reads these from the environment under FSDP1 only (launch always exports
# FSDP_SHARDING_STRATEGY, even for FSDP2).
FSDP1_ONLY_ENV_KEYS = (
    "sharding_strategy", "backward_prefetch", "forward_prefetch", "use_orig_params", "sync_module_states",
)
LAUNCH_ENV_VARS = {
    "mixed_precision": "ACCELERATE_MIXED_PRECISION", "use_cpu": "ACCELERATE_USE_CPU", "num_processes": "WORLD_SIZE",
}
ENV_SOURCE = "env FSDP_*"


# -------------------------------------------------------------------------------------------
# Public API
# -------------------------------------------------------------------------------------------


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | FSDPOffloadConfig,
    overrides: Sequence[str] | Mapping[str, Any] | None = None,
) -> FSDPOffloadConfig:
    """Load, normalise and validate an FSDP config; raise one `ConfigError` listing every problem.

    `source`: a path to an accelerate config, a transformers/ms-swift TrainingArguments JSON or a
    bare fsdp_config file; a mapping of the same shapes; or an `FSDPOffloadConfig` (returned as
    is unless there are overrides). `overrides`: dotlist strings ("fsdp_config.load_strategy=
    sharded") or a mapping of dotted keys; keys without `fsdp_config.` target fsdp_config unless
    they name a top-level key (`num_processes`, `fsdp`, ...).
    """
    if isinstance(source, FSDPOffloadConfig):
        if not overrides:
            return source
        return _load(_as_mapping(source), source.source, overrides, layout="accelerate", rebuilt=True)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        return _load(_read_file(path), path, overrides)
    if isinstance(source, Mapping):
        return _load(_plain(source), "<dict>", overrides)
    raise TypeError(f"load_config: expected a path, a mapping or an FSDPOffloadConfig, got {type(source).__name__}")


def config_from_env(environ: Mapping[str, str] = os.environ) -> FSDPOffloadConfig | None:
    """Rebuild the config from what `accelerate launch` exported to its workers.

    None unless ACCELERATE_USE_FSDP is true. Mirrors accelerate's plugin: under FSDP2 the FSDP1-only
    variables (which launch always exports) are ignored, under FSDP1 FSDP_SHARDING_STRATEGY wins
    over FSDP_RESHARD_AFTER_FORWARD. `activation_cpu_offload` and `load_strategy` are not exported
    by accelerate; FSDP_ACTIVATION_CPU_OFFLOAD ("true" or a JSON object) and FSDP_LOAD_STRATEGY
    are read when something (this plugin) exported them.
    """
    if str(environ.get("ACCELERATE_USE_FSDP", "")).strip().lower() not in ("1", "true", "yes", "y", "on", "t"):
        return None
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    problems: list[Problem] = []
    for var, key in ENV_VARS.items():
        if var not in environ:
            continue
        raw: Any = environ[var]
        if key == "activation_cpu_offload" and raw.lstrip().startswith("{"):
            try:
                raw = json.loads(raw)
            except ValueError as exc:
                problems.append(Problem(ENV_SOURCE, var, f"expected true, false or a JSON object; {exc}"))
                continue
        values[key] = _schema.coerce_key(key, raw)
        where[key] = var
    version = values.get("version", VERSION_DEFAULT["env"])
    if version == 2:
        dropped: tuple[str, ...] = FSDP1_ONLY_ENV_KEYS
    else:
        dropped = ("reshard_after_forward",) if "sharding_strategy" in values else ()
    for key in dropped:
        values.pop(key, None)
        where.pop(key, None)
    launch: dict[str, Any] = {"distributed_type": "FSDP"}
    for key, var in LAUNCH_ENV_VARS.items():
        if var in environ:
            launch[key], where[key] = environ[var], var
    return _build(values, where, launch, "env", ENV_SOURCE, problems)


def normalized_dict(config: FSDPOffloadConfig) -> dict[str, Any]:
    """The effective config as plain JSON/YAML-able data (for `explain` and logs)."""
    data = dataclasses.asdict(config)
    if data["transformer_layer_cls_to_wrap"] is not None:
        data["transformer_layer_cls_to_wrap"] = list(data["transformer_layer_cls_to_wrap"])
    return data


# -------------------------------------------------------------------------------------------
# Reading sources
# -------------------------------------------------------------------------------------------


def _read_file(path: str) -> dict[Any, Any]:
    """YAML or JSON file -> plain dict. omegaconf's loader is yaml's SafeLoader: no tags, no code."""
    import yaml
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        loaded = OmegaConf.load(path)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, OmegaConfBaseException) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError([Problem(path, "", f"cannot read or parse the file: {reason}")], unreadable=True) from exc
    if not isinstance(loaded, DictConfig):
        raise ConfigError([Problem(path, "", "expected a mapping at the top level, got a list")])
    data = OmegaConf.to_container(loaded, resolve=False)
    if not data:
        raise ConfigError([Problem(path, "", "the file holds no settings (empty)")])
    return data  # type: ignore[return-value]


def read_config_file(path: str) -> dict[Any, Any]:
    """A config file as a plain dict (safe YAML/JSON); `ConfigError` naming the file otherwise."""
    return _read_file(path)


def _plain(value: Any) -> Any:
    """Deep copy of a user mapping as plain dicts/lists; enum members become their names."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.name
    return value


def _as_mapping(config: FSDPOffloadConfig) -> dict[str, Any]:
    """An accelerate-layout mapping that loads back into `config` (non-default keys only)."""
    fsdp: dict[str, Any] = {}
    for f in dataclasses.fields(FSDPOffloadConfig):
        if f.name in LAUNCH_KEYS or f.name == "source":
            continue
        value = getattr(config, f.name)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        if f.name in ("version", "reshard_after_forward") or value != default:
            fsdp[f.name] = _plain(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value)
    top = {k: getattr(config, k) for k in LAUNCH_KEYS if getattr(config, k) is not None}
    return {**top, "fsdp_config": fsdp}


def _detect_layout(top: Mapping[Any, Any]) -> Layout:
    """accelerate config file, TrainingArguments JSON, or a bare fsdp_config mapping."""
    if "compute_environment" in top or "distributed_type" in top:
        return "accelerate"
    if "fsdp" in top or "fsdp_config" in top:
        return "trainer"
    return "mapping"


# -------------------------------------------------------------------------------------------
# Overrides and interpolation
# -------------------------------------------------------------------------------------------


def _load(top: dict[Any, Any], file: str, overrides: Any, layout: Layout | None = None,
          rebuilt: bool = False) -> FSDPOffloadConfig:
    layout = layout or _detect_layout(top)
    problems = list(_interpolation_problems(top, file, ()))
    items = _override_items(overrides, file, problems)
    if problems:
        raise ConfigError(problems)
    if items:
        top = _merge_overrides(top, [(_route(top, key, layout), value) for key, value in items], file)
    return _build_from_top(top, layout, file, rebuilt)


def _override_items(overrides: Any, file: str, problems: list[Problem]) -> list[tuple[str, Any]]:
    """Overrides as (dotted key, value); dotlist values are typed like YAML ("true" -> True)."""
    from omegaconf import OmegaConf

    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        pairs = [(k, _plain(v)) for k, v in overrides.items()]
    else:
        pairs = []
        for item in [overrides] if isinstance(overrides, str) else overrides:
            key, sep, text = str(item).partition("=")
            if not sep or not key.strip():
                problems.append(Problem(file, str(item), "override must look like KEY=VALUE"))
                continue
            try:
                value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={text}"]))["v"]  # type: ignore[index]
            except Exception as exc:  # noqa: BLE001 - omegaconf/yaml parse errors of the value text
                problems.append(Problem(file, key, f"cannot parse override value {text!r}: {exc}"))
                continue
            pairs.append((key.strip(), value))
    items = []
    for key, value in pairs:
        if not isinstance(key, str) or not key:
            problems.append(Problem(file, str(key), "override keys must be non-empty strings"))
            continue
        problems.extend(_interpolation_problems(value, file, (key,)))
        items.append((key, value))
    return items


def _route(top: Mapping[Any, Any], key: str, layout: Layout) -> str:
    """Where an override lands: top level or fsdp_config, in the spelling already in the file."""
    parts = key.split(".")
    if layout == "mapping":
        if parts[0] == "fsdp_config" and len(parts) > 1:
            parts = parts[1:]
        parts[0] = _existing_spelling(top, parts[0])
        return ".".join(parts)
    top_level = ACCELERATE_TOP_KEYS if layout == "accelerate" else {"fsdp", "fsdp_config"}
    if parts[0] not in top_level:
        parts = ["fsdp_config", *parts]
    if parts[0] == "fsdp_config" and len(parts) > 1:
        parts[1] = _existing_spelling(top.get("fsdp_config"), parts[1])
    return ".".join(parts)


def _existing_spelling(mapping: Any, key: str) -> str:
    """`offload_params` -> `fsdp_offload_params` when the file spells it that way."""
    if isinstance(mapping, Mapping):
        for existing in mapping:
            if isinstance(existing, str) and _target(existing) == _target(key):
                return existing
    return key


def _merge_overrides(top: dict[Any, Any], items: list[tuple[str, Any]], file: str) -> dict[Any, Any]:
    """omegaconf merge: a mapping merges into a mapping, anything else replaces."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if "fsdp_config" in top and top["fsdp_config"] is None:
        top = {**top, "fsdp_config": {}}  # `fsdp_config:` with nothing under it
    try:
        merged = OmegaConf.create(top)
    except OmegaConfBaseException as exc:
        raise ConfigError([Problem(file, "", f"unsupported value: {_first_line(exc)}")]) from exc
    problems = []
    for key, value in items:
        try:
            OmegaConf.update(merged, key, value, merge=True)
        except Exception as exc:  # noqa: BLE001 - omegaconf raises assorted types for impossible paths ("a.0" into a list)
            problems.append(Problem(file, key, f"cannot apply override: {_first_line(exc)}"))
    if problems:
        raise ConfigError(problems)
    return OmegaConf.to_container(merged, resolve=False)  # type: ignore[return-value]


def _interpolation_problems(value: Any, file: str, path: tuple[Any, ...]) -> Iterator[Problem]:
    """`${...}` anywhere is an error: accelerate and transformers read these files with plain
    yaml/json and would see the literal text, and resolvers could run code."""
    if isinstance(value, str) and "${" in value:
        yield Problem(file, _dotted(path), f"interpolation is not supported ({value!r}): accelerate and "
                      "transformers read this file without resolving it; write the value itself")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _interpolation_problems(v, file, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _interpolation_problems(v, file, (*path, i))


# -------------------------------------------------------------------------------------------
# Keys: spellings, layouts, the Trainer's `fsdp` string
# -------------------------------------------------------------------------------------------


def _canonical(key: Any) -> str | None:
    """`fsdp_offload_params` -> `offload_params`; None for keys that are not strings."""
    return key.removeprefix("fsdp_") if isinstance(key, str) else None


def _target(key: Any) -> str | None:
    """The dataclass field a key sets: `_canonical` with aliases (`cpu_offload` -> `offload_params`)."""
    name = _canonical(key)
    return ALIASES.get(name, name) if name is not None else None


def _allowed_keys(layout: Layout) -> set[str]:
    keys = set(_schema.canonical_keys())
    return keys - TRAINER_ONLY_KEYS if layout in ("accelerate", "env") else keys


def _spellings(keys: set[str]) -> list[str]:
    return sorted(keys) + sorted("fsdp_" + k for k in keys)


def _build_from_top(top: dict[Any, Any], layout: Layout, file: str, rebuilt: bool = False) -> FSDPOffloadConfig:
    """Split a top-level mapping into fsdp_config keys and launch keys, then build."""
    problems: list[Problem] = []
    if layout == "mapping":
        fsdp_raw: Any = top
        prefix = ""
    else:
        fsdp_raw = {} if top.get("fsdp_config") is None else top["fsdp_config"]
        prefix = "fsdp_config."
        if not isinstance(fsdp_raw, Mapping):
            problems.append(Problem(file, "fsdp_config", "expected a mapping of fsdp_config keys (a path to another "
                                    f"file is not followed; load that file directly); got {_schema.show(fsdp_raw)}"))
            fsdp_raw = {}
    values, where = _canonicalize(fsdp_raw, layout, prefix, file, problems)
    launch: dict[str, Any] = {}
    if layout == "accelerate":
        for key in top:
            if key not in ACCELERATE_TOP_KEYS:
                problems.append(Problem(file, str(key), _schema.unknown_key_message(
                    key, sorted(ACCELERATE_TOP_KEYS), "unknown top-level key (accelerate refuses it)", listing=[])))
        launch = {k: top[k] for k in LAUNCH_KEYS if top.get(k) is not None}
        where.update({k: k for k in launch})
    if layout == "trainer" and _apply_trainer_fsdp(top.get("fsdp"), values, where, file, problems):
        launch["distributed_type"] = "FSDP"
    return _build(values, where, launch, layout, file, problems, fsdp_keys_given=bool(fsdp_raw) and not rebuilt)


def _canonicalize(raw: Mapping[Any, Any], layout: Layout, prefix: str, file: str,
                  problems: list[Problem]) -> tuple[dict[str, Any], dict[str, str]]:
    """Canonical key -> coerced value, and canonical key -> the path as the user spelled it."""
    allowed = _allowed_keys(layout)
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    for key, value in raw.items():
        name = _canonical(key)
        if name not in allowed:
            problems.append(Problem(file, prefix + str(key), _unknown_key(key, name, layout)))
            continue
        name = ALIASES.get(name, name)
        if value is None and name in NULL_MEANS_UNSET:
            continue
        value = _schema.coerce_key(name, value)
        if name in values:
            if not _same(name, values[name], value):
                problems.append(Problem(file, prefix + str(key), f"conflicts with {where[name]} "
                                        f"({_schema.show(value)} vs {_schema.show(values[name])}); keep one spelling"))
            continue
        values[name] = value
        where[name] = prefix + str(key)
    return values, where


def _unknown_key(key: Any, name: str | None, layout: Layout) -> str:
    if name in TRAINER_ONLY_KEYS:  # only reachable for accelerate layouts
        hint = f"; did you mean 'fsdp_{ALIASES[name]}'?" if name in ALIASES else ""
        return f"a transformers Trainer key that accelerate launch ignores{hint}"
    allowed = _allowed_keys(layout)
    return _schema.unknown_key_message(key, _spellings(allowed), "unknown key", listing=sorted(allowed))


def _same(name: str, a: Any, b: Any) -> bool:
    if name == "transformer_layer_cls_to_wrap":
        a, b = _class_names(a), _class_names(b)
    return _schema.show(a) == _schema.show(b)


def _apply_trainer_fsdp(option: Any, values: dict[str, Any], where: dict[str, str], file: str,
                        problems: list[Problem]) -> bool:
    """transformers' legacy `fsdp` value ("full_shard auto_wrap offload", a list, or a bool).

    Mirrors TrainingArguments._apply_legacy_fsdp_to_config: explicit fsdp_config keys win.
    Returns whether FSDP is on.
    """
    if option is None or option is False or option == "" or option == []:
        return False
    if option is True:
        return True
    if not isinstance(option, (str, list)):
        problems.append(Problem(file, "fsdp", "expected true, an option string or a list of options; "
                                f"got {_schema.show(option)}"))
        return True
    items = option.split() if isinstance(option, str) else option
    version = values.get("version") if values.get("version") in (1, 2) else VERSION_DEFAULT["trainer"]
    for item in items:
        low = item.lower() if isinstance(item, str) else None
        if low not in TRAINER_FSDP_OPTIONS:
            problems.append(Problem(file, "fsdp", f"expected options among {', '.join(TRAINER_FSDP_OPTIONS)}; "
                                    f"got {_schema.show(item)}"))
        elif low == "offload":
            _set_default(values, where, "offload_params", True)
        elif low == "auto_wrap":
            pass
        elif version == 1:
            _set_default(values, where, "reshard_after_forward", low.upper())
        elif low.upper() in ("FULL_SHARD", "SHARD_GRAD_OP"):
            _set_default(values, where, "reshard_after_forward", FSDP2_RESHARD_FOR[low.upper()])
        else:
            problems.append(Problem(file, "fsdp", f"{item!r} is only available with FSDP1 (fsdp_config.version 1)"))
    return True


def _set_default(values: dict[str, Any], where: dict[str, str], key: str, value: Any) -> None:
    if key not in values:
        values[key] = value
        where[key] = "fsdp"


# -------------------------------------------------------------------------------------------
# Values: schema, typing, defaults, rules between keys
# -------------------------------------------------------------------------------------------


def _build(values: dict[str, Any], where: dict[str, str], launch: dict[str, Any], layout: Layout,
           file: str, problems: list[Problem], fsdp_keys_given: bool = False) -> FSDPOffloadConfig:
    """Validate canonical values, fill defaults, apply the rules between keys, build the dataclass."""
    bad: set[str] = set()
    for path, message in _schema.validate(values):
        bad.add(path[0])
        problems.append(Problem(file, _dotted((where[path[0]], *path[1:])), message))
    launch = {k: _schema.coerce(v, _schema.definition("launch")["properties"][k]) for k, v in launch.items()}
    for path, message in _schema.validate(launch, "launch"):
        bad.add(path[0])
        problems.append(Problem(file, where.get(path[0], path[0]), message))

    kwargs: dict[str, Any] = {}
    for key, value in {**values, **launch}.items():
        if key not in bad and key not in TRAINER_ONLY_KEYS:
            kwargs[key] = _typed(key, value, file, where, problems, bad)
    if "version" not in bad:
        kwargs.setdefault("version", VERSION_DEFAULT[layout])
        if kwargs["version"] == 1:
            kwargs.setdefault("reshard_after_forward", "FULL_SHARD")
    if layout == "trainer":
        for key, value in TRAINER_DEFAULTS.items():
            kwargs.setdefault(key, value)

    explicit = set(values) | set(launch)
    defaults = {f.name: getattr(FSDPOffloadConfig(), f.name) for f in dataclasses.fields(FSDPOffloadConfig)}
    rule_values = {**defaults, **kwargs, "xla": values.get("xla", False)}
    problems.extend(_rule_problems(rule_values, explicit, bad, layout, file, where, fsdp_keys_given))
    if problems:
        raise ConfigError(problems)
    return FSDPOffloadConfig(**kwargs, source=file)


def _typed(key: str, value: Any, file: str, where: dict[str, str], problems: list[Problem], bad: set[str]) -> Any:
    """A schema-valid canonical value -> the dataclass field's type."""
    if key in ("sharding_strategy", "backward_prefetch", "state_dict_type"):
        return _enum_name(value, key)
    if key == "reshard_after_forward":
        return value if isinstance(value, bool) else _enum_name(value, "sharding_strategy")
    if key == "transformer_layer_cls_to_wrap":
        return _class_names(value)
    if key == "activation_cpu_offload":
        if isinstance(value, bool):
            return ActivationOffloadConfig(enabled=value)
        return ActivationOffloadConfig(**{"enabled": True, **value})
    if key in ("version", "min_num_params", "num_processes"):
        return int(value)
    if key == "ignored_modules":
        try:
            re.compile(value)
        except (re.error, RecursionError, OverflowError, ValueError) as exc:
            bad.add(key)
            problems.append(Problem(file, where[key], f"expected a valid regular expression; {exc}"))
    return value


def _enum_name(value: Any, definition: str) -> str:
    """accelerate also takes enum numbers (1-based, in the schema's order): 1 -> FULL_SHARD."""
    return _schema.enum_names(definition)[value - 1] if isinstance(value, int) else value


def _class_names(value: Any) -> Any:
    if isinstance(value, str):
        return tuple(name.strip() for name in value.split(",") if name.strip())
    if isinstance(value, list):
        return tuple(value)
    return value


def _rule_problems(cfg: dict[str, Any], explicit: set[str], bad: set[str], layout: Layout, file: str,
                   where: dict[str, str], fsdp_keys_given: bool) -> list[Problem]:
    """The rules between keys; each fires only when none of its keys already had a problem.

    They run on effective values (defaults filled in), which the JSON Schema cannot see.
    """
    problems: list[Problem] = []

    def rule(keys: tuple[str, ...], broken: Callable[[], bool], at: str, message: str | Callable[[], str]) -> None:
        if not set(keys) & bad and broken():
            problems.append(Problem(file, where.get(at, at), message() if callable(message) else message))

    version = cfg.get("version")
    why = "" if "version" in explicit else f" (fsdp_version is unset; {layout} defaults to {version})"
    names = ", ".join(_schema.enum_names("sharding_strategy"))
    rule(("version", "reshard_after_forward"),
         lambda: version == 2 and not isinstance(cfg["reshard_after_forward"], bool), "reshard_after_forward",
         lambda: f"FSDP2{why} needs true or false; got {_schema.show(cfg['reshard_after_forward'])} "
                 f"(accelerate to-fsdp2 maps it to {str(FSDP2_RESHARD_FOR[cfg['reshard_after_forward']]).lower()})")
    rule(("version", "reshard_after_forward"),
         lambda: version == 1 and isinstance(cfg["reshard_after_forward"], bool), "reshard_after_forward",
         f"FSDP1{why} needs a sharding strategy ({names}); got a bool")
    rule(("version", "sharding_strategy"),
         lambda: version == 2 and "sharding_strategy" in explicit, "sharding_strategy",
         lambda: f"is FSDP1-only and ignored by FSDP2{why}; use reshard_after_forward: "
                 f"{str(FSDP2_RESHARD_FOR[cfg['sharding_strategy']]).lower()} instead")
    rule(("cpu_ram_efficient_loading", "sync_module_states"),
         lambda: cfg["cpu_ram_efficient_loading"] and not cfg["sync_module_states"], "sync_module_states",
         "must be true when cpu_ram_efficient_loading is true (accelerate launch refuses the combination: "
         "ranks other than 0 would keep empty weights)")
    rule(("load_strategy", "cpu_ram_efficient_loading"),
         lambda: "load_strategy" in explicit and not cfg["cpu_ram_efficient_loading"], "load_strategy",
         "only applies with cpu_ram_efficient_loading: true; here it would do nothing")
    rule(("activation_checkpointing_offload", "activation_checkpointing"),
         lambda: cfg["activation_checkpointing_offload"] and not cfg["activation_checkpointing"],
         "activation_checkpointing_offload", "needs activation_checkpointing: true (accelerate raises otherwise)")
    rule(("activation_checkpointing_offload", "version"),
         lambda: cfg["activation_checkpointing_offload"] and version == 1,
         "activation_checkpointing_offload", f"needs FSDP2 (version 2){why}")
    rule(("activation_checkpointing_offload", "activation_cpu_offload"),
         lambda: cfg["activation_checkpointing_offload"] and cfg["activation_cpu_offload"].enabled,
         "activation_cpu_offload", "cannot be combined with activation_checkpointing_offload: both would move the "
         "checkpoint inputs to the host; keep activation_cpu_offload (async, filtered) and drop the other")
    rule(("forward_prefetch", "version"), lambda: cfg["forward_prefetch"] and version == 2, "forward_prefetch",
         f"is not implemented in FSDP2{why} (accelerate raises); remove it")
    rule(("state_dict_type", "version"), lambda: cfg["state_dict_type"] == "LOCAL_STATE_DICT" and version == 2,
         "state_dict_type", f"FSDP2{why} does not support LOCAL_STATE_DICT; use SHARDED_STATE_DICT or FULL_STATE_DICT")
    rule(("xla",), lambda: cfg["xla"] is True, "xla",
         "XLA FSDP bypasses accelerate's FSDP plugin, so fsdp_offload_cfg cannot act on it; set it to false")
    rule(("distributed_type",),
         lambda: layout == "accelerate" and fsdp_keys_given and cfg["distributed_type"] is None,
         "distributed_type", "missing: accelerate requires it; set distributed_type: FSDP")
    rule(("distributed_type",),
         lambda: layout == "accelerate" and fsdp_keys_given and cfg["distributed_type"] not in (None, "FSDP"),
         "distributed_type", lambda: f"is {cfg['distributed_type']}, so accelerate ignores fsdp_config; "
                                     "set distributed_type: FSDP")
    return problems


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]
