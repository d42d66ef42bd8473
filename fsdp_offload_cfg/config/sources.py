"""Where a config comes from, and how it becomes an `FSDPOffloadConfig`: `load_config`, `config_from_env`.

Pipeline (docs/config.md has the user-facing version):

    file | dict | FSDPOffloadConfig | the launcher's environment
      -> plain data (`reading`: safe YAML / strict JSON, depth and size limits, never a crash)
      -> layout detected from the top-level keys (accelerate / trainer / bare mapping)
      -> overrides ("fsdp_config.key=value" dotlist or a mapping) merged in
      -> keys canonicalised (`fsdp_` prefix optional, aliases), values coerced (`schema.coerce`)
      -> JSON Schema (`schema.validate`) -> typed values -> `rules.RULES` -> `FSDPOffloadConfig`

Every problem found on the way is collected; one `ConfigError` reports them all.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from fsdp_offload_cfg.config import schema as _schema
from fsdp_offload_cfg.config.keys import (
    ACCELERATE_TOP_KEYS,
    ALIASES,
    ALL_NAMES,
    EFFICIENT_LOADING_DEFAULT,
    ENV_VARS,
    FIELD_KEYS,
    FSDP1_ONLY_ENV_KEYS,
    FSDP2_RESHARD_FOR,
    LAUNCH,
    LAUNCH_ENV_VARS,
    LAUNCH_KEYS,
    NULL_MEANS_UNSET,
    NUMBERED_ENUMS,
    PARALLELISM_CONFIG_KEYS_1_15,
    TRAINER_DEFAULTS,
    TRAINER_FSDP_OPTIONS,
    TRAINER_ONLY_KEYS,
    VERSION_DEFAULT,
    Layout,
    dynamo_config_keys,
    parallelism_config_keys,
)
from fsdp_offload_cfg.config.model import ConfigError, FSDPOffloadConfig, Problem
from fsdp_offload_cfg.config.reading import check_shape, parse_yaml, plain, read_config_file
from fsdp_offload_cfg.config.rules import RuleContext, broken_rules, fsdp2_form
from fsdp_offload_cfg.offload.options import ActivationOffloadConfig

ENV_SOURCE = "env FSDP_*"
_TRUE = ("1", "true", "yes", "y", "on", "t")
_FALSE = ("0", "false", "no", "n", "off", "f")  # accelerate's `str_to_bool`, both ways
_BOOL_LAUNCH_KEYS = frozenset(k.name for k in LAUNCH if k.annotation == "bool | None")


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | FSDPOffloadConfig,
    overrides: Sequence[str] | Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
) -> FSDPOffloadConfig:
    """Load, normalise and validate an FSDP config; raise one `ConfigError` listing every problem.

    `source`: a path to an accelerate config, a transformers/ms-swift TrainingArguments JSON or a
    bare fsdp_config file; a mapping of the same shapes; or an `FSDPOffloadConfig` (returned as
    is unless there are overrides). `overrides`: dotlist strings ("fsdp_config.load_strategy=
    sharded") or a mapping of dotted keys; keys without `fsdp_config.` target fsdp_config unless
    they name a top-level key (`num_processes`, `fsdp`, ...). `name`: what messages call the
    source (default: the path, or "<dict>" for a mapping).
    """
    if isinstance(source, FSDPOffloadConfig):
        if not overrides:
            return source
        return _load(as_accelerate_mapping(source), name or source.source, overrides, layout="accelerate", rebuilt=True)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        return _load(read_config_file(path), name or path, overrides, launch_file=True)
    if isinstance(source, Mapping):
        label = name or "<dict>"
        check_shape(source, label)
        return _load(plain(source), label, overrides)
    raise TypeError(f"load_config: expected a path, a mapping or an FSDPOffloadConfig, got {type(source).__name__}")


def config_from_env(environ: Mapping[str, str] = os.environ) -> FSDPOffloadConfig | None:
    """Rebuild the config from what `accelerate launch` (or `patch()`) exported to the workers.

    None unless ACCELERATE_USE_FSDP is true. Mirrors accelerate's plugin: under FSDP2 the FSDP1-only
    variables (which launch always exports) are ignored, under FSDP1 FSDP_SHARDING_STRATEGY wins
    over FSDP_RESHARD_AFTER_FORWARD. The plugin's own keys are never exported by accelerate;
    `patch()` exports them (FSDP_ACTIVATION_CPU_OFFLOAD: true/false or a JSON object,
    FSDP_LOAD_STRATEGY), so processes it starts see the whole config.
    """
    if str(environ.get("ACCELERATE_USE_FSDP", "")).strip().lower() not in _TRUE:
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
                check_shape(raw, f"{ENV_SOURCE}: {var}")
            except (ValueError, RecursionError, ConfigError) as exc:
                problems.append(Problem(ENV_SOURCE, var, f"expected true, false or a JSON object; {_first_line(exc)}"))
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
            launch[key], where[key] = _launch_env_value(key, environ[var]), var
    return _build(_Values(values, where, dict(values)), launch, "env", ENV_SOURCE, problems)


def _launch_env_value(key: str, text: str) -> Any:
    """A launch variable's text as the key's value. accelerate reads its flags with `str_to_bool`
    and spells them its own way (ACCELERATE_CPU_AFFINITY=1, ACCELERATE_USE_CPU=True): the flags'
    spellings it accepts are booleans here too; anything else stays text, for validation to name."""
    if key in _BOOL_LAUNCH_KEYS and text.strip().lower() in (*_TRUE, *_FALSE):
        return text.strip().lower() in _TRUE
    return text


def env_values(config: FSDPOffloadConfig) -> dict[str, str]:
    """`FSDP_*` variable -> text: what `config_from_env` reads back into an equal config.

    accelerate's keys wherever they have a value (as `accelerate launch` exports them); the
    plugin's own keys only where they differ from the default, so that a default never reads
    back as "set" (an explicit `load_strategy` under FSDP1 is a rule violation).
    """
    env = {}
    for key in FIELD_KEYS:
        value = getattr(config, key.name)
        if key.env is None or value is None or (key.owner == "plugin" and value == key.default):
            continue
        env[key.env] = _env_text(value)
    return env


def _env_text(value: Any) -> str:
    if isinstance(value, ActivationOffloadConfig):
        data = dataclasses.asdict(value)
        return str(value.enabled).lower() if data == dataclasses.asdict(ActivationOffloadConfig(value.enabled)) \
            else json.dumps(data, sort_keys=True)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return ",".join(value)
    return str(value)


def as_accelerate_mapping(config: FSDPOffloadConfig, keep: frozenset[str] = frozenset()) -> dict[str, Any]:
    """An accelerate-layout mapping that loads back into an equal config: the keys off their
    defaults, and those in `keep` (the ones the user wrote, which `explain` shows as theirs)."""
    fsdp: dict[str, Any] = {}
    for key in FIELD_KEYS:
        value = getattr(config, key.name)
        if key.name in ("version", "reshard_after_forward", "cpu_ram_efficient_loading", *keep) \
                or value != key.default:
            fsdp[key.name] = plain(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value)
    top = {k: getattr(config, k) for k in LAUNCH_KEYS if getattr(config, k) is not None}
    return {**top, "fsdp_config": fsdp}


def as_config_file(config: FSDPOffloadConfig, keep: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A config file's content that `validate` accepts and that loads back into an equal config.

    An accelerate file when the config has launch keys; otherwise a bare fsdp_config mapping
    (an accelerate file without `distributed_type` is refused by accelerate, and so by us).
    `explain` prints this: the user can save it and run with it. `keep`: keys written even at
    their defaults (`as_accelerate_mapping`).
    """
    data = as_accelerate_mapping(config, keep)
    if config.distributed_type is None:
        return data["fsdp_config"]  # a bare fsdp_config (a Trainer's, say): a list of classes is right there
    classes = data["fsdp_config"].get("transformer_layer_cls_to_wrap")
    if isinstance(classes, list):  # a launch file: accelerate launch reads classes comma-separated only
        data["fsdp_config"]["transformer_layer_cls_to_wrap"] = ",".join(classes)
    return data


def fsdp_keys_written(top: Mapping[Any, Any]) -> frozenset[str]:
    """The config's fields that a file's own mapping sets, read as the file is read
    (`_canonicalize`: any spelling, aliases, a `null` that means unset left out): what the user
    typed, default value or not."""
    layout = _detect_layout(top)
    fsdp = top.get("fsdp_config") if layout in ("accelerate", "trainer") else top
    if not isinstance(fsdp, Mapping):
        return frozenset()
    return frozenset(_canonicalize(fsdp, layout, "", "", []).values)


def with_the_files_other_keys(written: dict[str, Any], top: Mapping[Any, Any]) -> dict[str, Any]:
    """`written` (an accelerate file from `as_config_file`) with the keys of the user's accelerate
    file `top` that this plugin's config does not hold, as the file has them, in the file's order.

    `explain`'s config is a file to launch. Without them it launched another run: `num_machines`,
    `machine_rank`, `main_process_ip` (one machine), and every other accelerate key. A bare
    fsdp_config (from a Trainer's file) has nowhere to put them. A legacy `dynamo_backend` is ours:
    it is written as the `dynamo_config` it stands for."""
    if "fsdp_config" not in written or _detect_layout(top) != "accelerate":
        return written
    ours = {"fsdp_config", "dynamo_backend", *LAUNCH_KEYS}
    merged = {k: written[k] if k in ours else v for k, v in top.items() if k in written or k not in ours}
    return {**merged, **{k: v for k, v in written.items() if k not in merged}}


# -------------------------------------------------------------------------------------------
# Layouts, overrides, interpolation
# -------------------------------------------------------------------------------------------


def layout_of(top: Mapping[Any, Any]) -> Layout:
    """A file's layout, as `load_config` reads it (`config/trainer_file.py` reads a Trainer's)."""
    return _detect_layout(top)


def _detect_layout(top: Mapping[Any, Any]) -> Layout:
    """accelerate config file, TrainingArguments JSON, or a bare fsdp_config mapping."""
    if "compute_environment" in top or "distributed_type" in top:
        return "accelerate"
    if "fsdp" in top or "fsdp_config" in top:
        return "trainer"
    return "mapping"


def _load(top: dict[Any, Any], file: str, overrides: Any, layout: Layout | None = None,
          rebuilt: bool = False, launch_file: bool = False) -> FSDPOffloadConfig:
    """`launch_file`: `top` is a file `accelerate launch --config_file` may read, judged as it reads it."""
    layout = layout or _detect_layout(top)
    problems = list(_interpolation_problems(top, file, ()))
    items = _override_items(overrides, file, problems)
    if problems:
        raise ConfigError(problems)
    # the file as launch reads it (overrides given here never reach the launcher)
    launch_problems = list(_launch_reading_problems(top, file)) if launch_file and layout == "accelerate" else []
    if items:
        top = _merge_overrides(top, [(_route(top, key, layout), value) for key, value in items], file)
    try:
        config = _build_from_top(top, layout, file, rebuilt)
    except ConfigError as error:
        raise ConfigError([*launch_problems, *error.problems]) from None
    if launch_problems:
        raise ConfigError(launch_problems)
    return config


def _launch_reading_problems(top: Mapping[Any, Any], file: str) -> Iterator[Problem]:
    """What `accelerate launch` would pass on broken. It exports each fsdp_config value with
    `str()`: a YAML list of layer classes reaches every rank as the text "['LlamaDecoderLayer']",
    which neither accelerate nor this plugin can read as class names. (A list is right in a
    Trainer's `fsdp_config`, which no launcher turns into text.)"""
    fsdp = top.get("fsdp_config")
    for key, value in (fsdp.items() if isinstance(fsdp, Mapping) else ()):
        if _canonical(key) == "transformer_layer_cls_to_wrap" and isinstance(value, list):
            names = ",".join(str(v) for v in value)
            yield Problem(file, f"fsdp_config.{key}",
                          f"accelerate launch passes a list on as the text {str(value)!r}, which no rank can read "
                          f"as class names; write it comma-separated: {key}: {names}")


def _override_items(overrides: Any, file: str, problems: list[Problem]) -> list[tuple[str, Any]]:
    """Overrides as (dotted key, value); dotlist values are typed like YAML ("true" -> True)."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        check_shape(overrides, file)
        pairs = [(k, plain(v)) for k, v in overrides.items()]
    else:
        pairs = []
        for item in [overrides] if isinstance(overrides, str) else overrides:
            key, sep, text = str(item).partition("=")
            if not sep or not key.strip():
                problems.append(Problem(file, str(item), "override must look like KEY=VALUE"))
                continue
            try:
                value = parse_yaml(text, key) if text.strip() else ""
            except ConfigError as exc:
                problems.append(Problem(file, key, f"cannot parse override value {text!r}: {exc.problems[0].message}"))
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
    except (OmegaConfBaseException, ValueError, TypeError) as exc:
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
# Keys: spellings, the Trainer's `fsdp` string
# -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Values:
    """fsdp_config values by canonical key, with where and how the user wrote each."""

    values: dict[str, Any]  # coerced
    where: dict[str, str]  # the key path as spelled
    raw: dict[str, Any]  # as written, for messages
    prefixed: bool = False  # the user writes the `fsdp_` prefix


def _canonical(key: Any) -> str | None:
    """`fsdp_offload_params` -> `offload_params`; None for keys that are not strings."""
    return key.removeprefix("fsdp_") if isinstance(key, str) else None


def _target(key: Any) -> str | None:
    """The model field a key sets: `_canonical` with aliases (`cpu_offload` -> `offload_params`)."""
    name = _canonical(key)
    return ALIASES.get(name, name) if name is not None else None


def _allowed_keys(layout: Layout) -> set[str]:
    keys = set(ALL_NAMES)
    return keys - TRAINER_ONLY_KEYS if layout in ("accelerate", "env") else keys


def _spellings(keys: set[str]) -> list[str]:
    return sorted(keys) + sorted("fsdp_" + k for k in keys)


def _build_from_top(top: dict[Any, Any], layout: Layout, file: str, rebuilt: bool = False) -> FSDPOffloadConfig:
    """Split a top-level mapping into fsdp_config keys and launch keys, then build."""
    problems: list[Problem] = []
    if layout == "mapping" and (said := [key for key in RUN_KEYS if key in top]):
        raise ConfigError([Problem(file, "", _run_file_message(top, said))])
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
    given = _canonicalize(fsdp_raw, layout, prefix, file, problems)
    launch: dict[str, Any] = {}
    if layout == "accelerate":
        for key in top:
            if key not in ACCELERATE_TOP_KEYS:
                problems.append(Problem(file, _schema.key_text(key), _schema.unknown_key_message(
                    key, sorted(ACCELERATE_TOP_KEYS), "unknown top-level key (accelerate refuses it)", listing=[])))
        problems.extend(_parallelism_problems(top.get("parallelism_config"), file))
        problems.extend(_dynamo_problems(top, file))
        top = _with_legacy_dynamo_backend(top)
        launch = {k: top[k] for k in LAUNCH_KEYS if top.get(k) is not None}
        for section in ("parallelism_config", "dynamo_config"):
            if launch.get(section) == {}:  # accelerate: an empty section is none
                del launch[section]
        given.where.update({k: k for k in launch})
    if layout == "trainer" and _apply_trainer_fsdp(top.get("fsdp"), given, file, problems):
        launch["distributed_type"] = "FSDP"
    return _build(given, launch, layout, file, problems, fsdp_keys_given=bool(fsdp_raw) and not rebuilt)


# a run's training arguments, in each framework's spelling: a file with one of these and neither an
# accelerate key nor `fsdp` / `fsdp_config` is a TRL recipe or a LlamaFactory YAML, not an FSDP config
RUN_KEYS = ("model_name_or_path", "base_model", "model", "max_length", "cutoff_len", "sequence_len",
            "max_seq_length", "output_dir", "dataset_name", "dataset", "datasets", "learning_rate",
            "per_device_train_batch_size", "micro_batch_size")


def _run_file_message(top: Mapping[Any, Any], said: list[str]) -> str:
    """One sentence for a run's file read as a config, where each of its keys was an "unknown key"
    (a screen of them) and none said what to do."""
    named = top.get("accelerate_config")
    config = f" (this one names it: accelerate_config: {named})" if isinstance(named, str) else ""
    return (f"holds a run's training arguments ({', '.join(said)}) and no FSDP settings (`fsdp` / `fsdp_config` as "
            f"the Trainer takes them, or an accelerate config's `distributed_type`): give the accelerate config the "
            f"run launches with{config}; `fsdp-offload-cfg estimate -- <its launch command>` (trl sft --config "
            "sft.yaml, accelerate launch --config_file fsdp.yaml train.py sft.yaml) reads the two together")


def _parallelism_problems(section: Any, file: str) -> list[Problem]:
    """The file's `parallelism_config` section (HSDP, tensor, context parallelism under FSDP2):
    `accelerate launch` reads only the `parallelism_config_*` keys its version knows and drops
    any other without a word (an unprefixed `dp_replicate_size: 2` ran the job without
    replicas), and takes each size as given."""
    if not isinstance(section, Mapping):  # absent, or not a mapping (the schema says so)
        return []
    known = parallelism_config_keys()
    problems = []
    for key, value in section.items():
        where = f"parallelism_config.{_schema.key_text(key)}"
        if key not in known:
            prefixed = f"parallelism_config_{key}"
            if prefixed in known:
                message = f"accelerate reads only the prefixed name; did you mean {prefixed!r}?"
            elif key in PARALLELISM_CONFIG_KEYS_1_15:
                message = (f"the installed accelerate {_accelerate_version()} does not read it (accelerate 1.15 "
                           "does): upgrade accelerate, or remove the key")
            else:
                message = _schema.unknown_key_message(key, sorted(known), "unknown key (accelerate ignores it)")
            problems.append(Problem(file, where, message))
        elif key.endswith("_size") and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            problems.append(Problem(file, where, f"expected an integer >= 1; got {_schema.show(value)}"))
    return problems


def _with_legacy_dynamo_backend(top: Mapping[Any, Any]) -> Mapping[Any, Any]:
    """accelerate reads a top-level `dynamo_backend` (older files) as the whole `dynamo_config`."""
    if "dynamo_backend" not in top:
        return top
    legacy = top["dynamo_backend"]
    section = {} if str(legacy).upper() == "NO" else {"dynamo_backend": legacy}
    return {**{k: v for k, v in top.items() if k != "dynamo_backend"}, "dynamo_config": section}


def _dynamo_problems(top: Mapping[Any, Any], file: str) -> list[Problem]:
    """The file's `dynamo_config` (torch.compile through accelerate) or legacy `dynamo_backend`:
    `accelerate launch` adds the `dynamo_` prefix to a key without it and drops a key it does not
    know without a word (a misspelt `dynamo_use_regional_compilation` compiled the model whole),
    and stops at launch on a backend it does not know."""
    if "dynamo_backend" in top:
        section, at = {"dynamo_backend": top["dynamo_backend"]}, ""
    elif isinstance(top.get("dynamo_config"), Mapping):  # not a mapping: the schema says so
        section, at = top["dynamo_config"], "dynamo_config."
    else:
        return []
    from accelerate.utils import DynamoBackend

    known = dynamo_config_keys()
    problems = []
    for key, value in section.items():
        name = str(key) if str(key).startswith("dynamo_") else f"dynamo_{key}"
        where = at + _schema.key_text(key)
        if name not in known:
            problems.append(Problem(file, where, _schema.unknown_key_message(
                key, sorted(known), "unknown key (accelerate ignores it)")))
        elif name == "dynamo_backend" and str(value).upper() not in DynamoBackend.list():
            yaml_no = " (YAML reads an unquoted NO as false: write 'NO')" if value is False else ""
            problems.append(Problem(file, where, f"expected one of {', '.join(DynamoBackend.list())}; got "
                                    f"{_schema.show(value)}{yaml_no}; accelerate launch refuses it"))
    return problems


def _accelerate_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("accelerate")
    except PackageNotFoundError:
        return "(not installed)"


def _canonicalize(raw: Mapping[Any, Any], layout: Layout, prefix: str, file: str, problems: list[Problem]) -> _Values:
    """Canonical key -> coerced value, where it was written, and the value as written."""
    allowed = _allowed_keys(layout)
    given = _Values({}, {}, {}, prefixed=any(isinstance(k, str) and k.startswith("fsdp_") for k in raw))
    for key, value in raw.items():
        name = _canonical(key)
        if name not in allowed:
            problems.append(Problem(file, prefix + _schema.key_text(key), _unknown_key(key, name, layout)))
            continue
        name = ALIASES.get(name, name)
        if value is None and name in NULL_MEANS_UNSET:
            continue
        coerced = _schema.coerce_key(name, value)
        if name in given.values:
            if not _same(name, given.values[name], coerced):
                problems.append(Problem(file, prefix + str(key), f"conflicts with {given.where[name]} "
                                        f"({_schema.show(value)} vs {_schema.show(given.raw[name])}); keep one spelling"))
            continue
        given.values[name], given.where[name], given.raw[name] = coerced, prefix + str(key), value
    return given


def _unknown_key(key: Any, name: str | None, layout: Layout) -> str:
    if name in TRAINER_ONLY_KEYS:  # only reachable for accelerate layouts
        hint = f"; did you mean 'fsdp_{ALIASES[name]}'?" if name in ALIASES else ""
        return f"a transformers Trainer key that accelerate launch ignores{hint}"
    allowed = _allowed_keys(layout)
    return _schema.unknown_key_message(key, _spellings(allowed), "unknown key", listing=sorted(allowed))


def _same(name: str, a: Any, b: Any) -> bool:
    """Two spellings of one key agree when they mean the same (`true` and `{}` both enable offload)."""
    if not _schema.validate({name: a}) and not _schema.validate({name: b}):
        try:
            return _typed(name, a) == _typed(name, b)
        except ValueError:
            pass
    return _schema.show(a) == _schema.show(b)


def _apply_trainer_fsdp(option: Any, given: _Values, file: str, problems: list[Problem]) -> bool:
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
    values = given.values
    version = values.get("version") if values.get("version") in (1, 2) else VERSION_DEFAULT["trainer"]
    for item in items:
        low = item.lower() if isinstance(item, str) else None
        if low not in TRAINER_FSDP_OPTIONS:
            problems.append(Problem(file, "fsdp", f"expected options among {', '.join(TRAINER_FSDP_OPTIONS)}; "
                                    f"got {_schema.show(item)}"))
        elif low == "offload":
            _set_default(given, "offload_params", True)
        elif low == "auto_wrap":
            pass
        elif version == 1:
            _set_default(given, "reshard_after_forward", low.upper())
        elif low.upper() in ("FULL_SHARD", "SHARD_GRAD_OP"):
            _set_default(given, "reshard_after_forward", FSDP2_RESHARD_FOR[low.upper()])
        else:
            problems.append(Problem(file, "fsdp", f"{item!r} is only available with FSDP1 (fsdp_config.version 1); "
                                    + fsdp2_form(low.upper(), "trainer", "fsdp_config.reshard_after_forward")))
    return True


def _set_default(given: _Values, key: str, value: Any) -> None:
    if key not in given.values:
        given.values[key], given.where[key], given.raw[key] = value, "fsdp", value


# -------------------------------------------------------------------------------------------
# Values: schema, typing, defaults, rules between keys
# -------------------------------------------------------------------------------------------


def _build(given: _Values, launch: dict[str, Any], layout: Layout, file: str, problems: list[Problem],
           fsdp_keys_given: bool = False) -> FSDPOffloadConfig:
    """Validate canonical values, type them, fill defaults, apply the rules, build the model."""
    values, where = given.values, given.where
    bad: set[str] = set()
    for path, message in _schema.validate(values):
        bad.add(path[0])
        problems.append(Problem(file, _dotted((where[path[0]], *path[1:])), message))
    launch_raw = dict(launch)
    launch = {k: _schema.coerce_launch(k, v) for k, v in launch.items()}
    for path, message in _schema.validate(launch, "launch"):
        bad.add(path[0])
        problems.append(Problem(file, where.get(path[0], path[0]), message))

    kwargs: dict[str, Any] = {}
    for key, value in {**values, **launch}.items():
        if key in bad or key in TRAINER_ONLY_KEYS:
            continue
        try:
            kwargs[key] = _typed(key, value)
        except ValueError as exc:
            bad.add(key)
            problems.append(Problem(file, where[key], str(exc)))
    if "version" not in bad:
        kwargs.setdefault("version", VERSION_DEFAULT[layout])
        if kwargs["version"] == 1:
            kwargs.setdefault("reshard_after_forward", "FULL_SHARD")
    if "cpu_ram_efficient_loading" not in bad:
        kwargs.setdefault("cpu_ram_efficient_loading", EFFICIENT_LOADING_DEFAULT[layout])
    if layout == "trainer":
        for key, value in TRAINER_DEFAULTS.items():
            kwargs.setdefault(key, value)

    effective = {f.name: getattr(FSDPOffloadConfig(), f.name) for f in dataclasses.fields(FSDPOffloadConfig)}
    effective.update(kwargs, xla=values.get("xla", False))  # xla: a Trainer-only key, not a field
    ctx = RuleContext(effective, frozenset(values) | frozenset(launch), {**given.raw, **launch_raw}, where,
                      layout, given.prefixed, fsdp_keys_given)
    problems.extend(Problem(file, at, message) for at, message in broken_rules(ctx, bad))
    if problems:
        raise ConfigError(problems)
    return FSDPOffloadConfig(**kwargs, source=file)


def _typed(key: str, value: Any) -> Any:
    """A schema-valid canonical value -> the model field's type; ValueError for what the schema cannot check."""
    if key in NUMBERED_ENUMS:
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
            raise ValueError(f"expected a valid regular expression; {exc}") from exc
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


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(_schema.key_text(p) for p in path)


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]

