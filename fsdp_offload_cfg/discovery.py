"""Find the user's config without being told: the file they launched with.

Order, first hit wins: explicit argument; env `FSDP_OFFLOAD_CFG`; the `--config_file` of the
`accelerate launch` process that started this one (workers are its descendants), or the
`--accelerate_config` of a TRL CLI (`trl sft`, which runs accelerate's launcher inside its own
process), or accelerate's default config file when that launch named none; accelerate's
exported `FSDP_*` variables.
The `FSDP_*` variables are the last resort because `accelerate launch` drops every key it does
not know (this plugin's keys and typos alike) when exporting them.

Which value wins is a separate rule, accelerate's: code (`patch()` keywords, a mapping or config
object passed to `patch()`) > the launch command line (its exported variables) > a file, however
the file was found. A log line names an override only where the user typed the flag.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from fsdp_offload_cfg import registry
from fsdp_offload_cfg._script import this_script_command
from fsdp_offload_cfg.config import (
    ENV_VARS,
    FSDP1_ONLY_ENV_KEYS,
    LAUNCH_ENV_VARS,
    PLUGIN_KEYS,
    ConfigError,
    FSDPOffloadConfig,
    Problem,
    config_from_env,
    load_config,
)
from fsdp_offload_cfg.config.keys import ALIASES, LAUNCH_FLAGS
from fsdp_offload_cfg.config.reading import plain

ENV_CONFIG_PATH = "FSDP_OFFLOAD_CFG"
_MAX_ANCESTORS = 6
_FIND = object()  # discover_config's default: look for the accelerate launch ancestor


def _is_accelerate_launch(cmdline: Sequence[str]) -> bool:
    """`accelerate launch ...`, `accelerate-launch ...` or `python -m accelerate.commands.launch`."""
    for i, arg in enumerate(cmdline):
        name = os.path.basename(arg)
        if name == "accelerate-launch" or arg == "accelerate.commands.launch":
            return True
        if name == "accelerate" and i + 1 < len(cmdline) and cmdline[i + 1] == "launch":
            return True
        if arg.endswith("accelerate/commands/launch.py"):
            return True
    return False


def _config_file_arg(cmdline: Sequence[str]) -> str | None:
    for i, arg in enumerate(cmdline):
        for flag in ("--config_file", "--config-file"):
            if arg == flag and i + 1 < len(cmdline):
                return cmdline[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


def is_trl_cli(cmdline: Sequence[str]) -> bool:
    """`trl sft ...` (the console script) or `python -m trl ...`: TRL's CLI runs accelerate's
    launcher in its own process, so it is the launch its workers descend from."""
    for i, arg in enumerate(cmdline[:3]):
        if os.path.basename(arg) == "trl" and i + 1 < len(cmdline) and not cmdline[i + 1].startswith("-"):
            return True
        if arg == "-m" and i + 1 < len(cmdline) and cmdline[i + 1] in ("trl", "trl.cli", "trl.cli.main"):
            return True
    return False


def _trl_config_arg(cmdline: Sequence[str], cwd: str) -> tuple[str | None, str]:
    """TRL's accelerate config (a path, or the name of a config TRL ships: `fsdp2`) and how it was
    named: `--accelerate_config F` on the command line, else the `accelerate_config` key of the
    YAML its `--config` names (TRL hands that file's keys no dataclass takes to accelerate's
    launcher, the command line's after them, so the command line wins)."""
    for i, arg in enumerate(cmdline):
        if arg == "--accelerate_config" and i + 1 < len(cmdline):
            return cmdline[i + 1], "trl --accelerate_config"
        if arg.startswith("--accelerate_config="):
            return arg.split("=", 1)[1], "trl --accelerate_config"
    recipe = next((cmdline[i + 1] for i, arg in enumerate(cmdline[:-1]) if arg == "--config"), None)  # TRL's spelling
    if recipe is None:
        return None, ""
    named = _yaml_key(Path(recipe) if Path(recipe).is_absolute() else Path(cwd) / recipe, "accelerate_config")
    return (str(named), f"accelerate_config of trl --config {recipe}:") if named is not None else (None, "")


def _yaml_key(path: Path, key: str) -> Any:
    """`key` of the YAML mapping at `path`; None where the file, the mapping or the key is missing
    (TRL itself then says what is wrong with its file)."""
    import yaml

    try:
        top = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return top.get(key) if isinstance(top, dict) else None


def _trl_config_path(name: str, cwd: str) -> Path:
    """Where TRL finds `--accelerate_config name`: the file, else its packaged `name.yaml`."""
    path = Path(name) if Path(name).is_absolute() else Path(cwd) / name
    if path.is_file():
        return path
    try:
        from importlib import resources

        shipped = Path(str(resources.files("trl.accelerate_configs").joinpath(f"{name}.yaml")))
    except (ImportError, TypeError):
        return path
    return shipped if shipped.is_file() else path


def launch_config_file(cmdline: Sequence[str], cwd: str) -> tuple[bool, Path | None]:
    """(whether `cmdline` is a launcher that reads an accelerate config, the file it names):
    `accelerate launch --config_file F` and `trl <verb> --accelerate_config F` (or the
    `accelerate_config` of its `--config` YAML); a launcher that names none reads accelerate's
    default file."""
    if _is_accelerate_launch(cmdline):
        arg = _config_file_arg(cmdline)
    elif is_trl_cli(cmdline):
        arg, _ = _trl_config_arg(cmdline, cwd)
        if arg is not None:
            return True, _trl_config_path(arg, cwd)
    else:
        return False, None
    if arg is None:
        return True, _accelerate_default_config_file()
    return True, Path(arg) if Path(arg).is_absolute() else Path(cwd) / arg


@dataclass(frozen=True)
class AccelerateLaunch:
    """The launch this process descends from (`accelerate launch`, or a TRL CLI running
    accelerate's launcher), as far as its command line says."""

    config_file: Path | None  # its --config_file (absolute), or accelerate's default file; None: neither
    # config keys given as flags on its command line (`--mixed_precision bf16`); None: not known
    # (TRL mixes accelerate's flags with its own)
    typed: frozenset[str] | None
    named_by: str = "accelerate launch --config_file"  # how the log says the file was named


def find_accelerate_launch() -> AccelerateLaunch | None:
    """The launching ancestor of this process, if there is one."""
    try:
        ancestors = psutil.Process().parents()[:_MAX_ANCESTORS]
    except psutil.Error:
        return None
    for proc in ancestors:
        try:
            cmdline = proc.cmdline()
            is_launch, path = launch_config_file(cmdline, proc.cwd())
            if is_launch and _is_accelerate_launch(cmdline):
                return AccelerateLaunch(path, typed_launch_keys(cmdline))
            if is_launch:
                named_by = _trl_config_arg(cmdline, proc.cwd())[1] or "trl, accelerate's default file"
                return AccelerateLaunch(path, None, named_by)
        except psutil.Error:
            continue
    return None


def accelerate_launch_config_file() -> Path | None:
    """The config file of the `accelerate launch` ancestor of this process, if there is one."""
    launch = find_accelerate_launch()
    return launch.config_file if launch is not None else None


def typed_launch_keys(cmdline: Sequence[str]) -> frozenset[str]:
    """Config keys the user typed as `accelerate launch` flags (`--mixed_precision`, `--cpu`,
    `--fsdp_<key>`), in either spelling (`--fsdp_version 2`, `--fsdp-version=2`). Only the
    launcher's own arguments count: everything after the script path belongs to the script."""
    return frozenset(typed_launch_flags(cmdline).values())


def typed_launch_flags(cmdline: Sequence[str]) -> dict[str, str]:
    """{the flag as accelerate's parser names it (`fsdp_version`, `cpu`): the config key} for each
    config flag typed on the `accelerate launch` command line, as `typed_launch_keys` reads them."""
    flags = launch_flag_keys()
    names = (arg[2:].split("=", 1)[0].replace("-", "_") for arg in _launcher_args(cmdline) if arg.startswith("--"))
    return {name: flags[name] for name in names if name in flags}


def launch_flag_keys() -> dict[str, str]:
    """{a config flag of `accelerate launch`, as its parser names it (`fsdp_version`, `cpu`): its config key}."""
    flags = {flag.removeprefix("--"): key for key, flag in LAUNCH_FLAGS.items()}
    flags.update({f"fsdp_{key}": key for key in ENV_VARS.values()})
    flags["fsdp_transformer_layer_cls_to_wrap"] = "transformer_layer_cls_to_wrap"
    return flags


def _launcher_args(cmdline: Sequence[str]) -> list[str]:
    """The arguments of `accelerate launch` up to the training script (the first `.py` or the
    first positional argument after the flags that take none)."""
    args = []
    started = False
    for arg in cmdline:
        if not started:
            started = arg == "launch" or arg.endswith(("accelerate-launch", "accelerate.commands.launch", "launch.py"))
            continue
        if arg.endswith(".py") or arg == "-m":
            break
        args.append(arg)
    return args


def accelerate_default_config_path() -> Path:
    """Where accelerate keeps the config `accelerate config` writes and `accelerate launch`
    reads without `--config_file` (it may not exist)."""
    from accelerate.commands.config.config_args import default_config_file

    return Path(default_config_file)


def _accelerate_default_config_file() -> Path | None:
    path = accelerate_default_config_path()
    return path if path.is_file() else None


def with_launch_overrides(
    cfg: FSDPOffloadConfig,
    environ: Mapping[str, str] | None = None,
    *,
    typed: frozenset[str] | None = None,
    keep: frozenset[str] = frozenset(),
) -> tuple[FSDPOffloadConfig, dict[str, tuple[Any, Any]]]:
    """`cfg` (read from a config file) with the values the launcher exported: accelerate's order,
    the launch command line over the file.

    `accelerate launch --config_file f.yaml --mixed_precision bf16 --fsdp_activation_checkpointing
    true` exports the command line's values over the file's; accelerate runs with those, so the
    plugin must too (re-exporting the file's would silently undo the command line). The file still
    supplies the plugin's own keys, which accelerate never exports; `keep` names keys given in code
    (`patch()` keywords, `--set`), which win over both. The merge is validated again.

    Returns the merged config and `{key: (file value, launch value)}` for what the user typed:
    the flags in `typed` (the launch's command line) when it is known, otherwise every value the
    environment changed that the file had set (accelerate's own default for a key the file leaves
    unset is taken silently: nobody typed it). `environ` defaults to the environment as it was
    before any `patch()` exported into it.
    """
    environ = registry.environ_before_patching() if environ is None else environ
    launched = config_from_env(environ)
    if launched is None:
        return cfg, {}
    ignored = set(FSDP1_ONLY_ENV_KEYS) if launched.version == 2 else set()  # exported, but not read under FSDP2
    present = {key for var, key in ENV_VARS.items() if var in environ} - ignored | {
        key for key, var in LAUNCH_ENV_VARS.items() if var in environ and key != "num_processes"
    }
    adopted = {
        key: (getattr(cfg, key), getattr(launched, key))
        for key in sorted(present - PLUGIN_KEYS - keep)  # accelerate never exports the plugin's keys
        if getattr(launched, key) != getattr(cfg, key)
    }
    if not adopted:
        return cfg, {}
    try:
        merged = load_config(cfg, {dotted_key(key): plain(new) for key, (_, new) in adopted.items()})
    except ConfigError as error:  # say which values came from the launch, not only the file
        launch_problems = [
            Problem("the accelerate launch", _flag(key), f"{new!r} over {cfg.source}'s {old!r}")
            for key, (old, new) in adopted.items()
        ]
        raise ConfigError([*error.problems, *launch_problems]) from error
    reported = {key: values for key, values in adopted.items()
                if (key in typed if typed is not None else values[0] is not None)}
    return merged, reported


def _flag(key: str) -> str:
    """The `accelerate launch` flag (and exported variable) that carries `key`."""
    var = LAUNCH_ENV_VARS.get(key) or next(v for v, k in ENV_VARS.items() if k == key)
    flag = LAUNCH_FLAGS.get(key, f"--fsdp_{key}")
    return f"{flag} (${var})"


def dotted_key(key: str) -> str:
    """Where `--set` puts a config key: at the top for accelerate's launch keys, else in fsdp_config."""
    return key if key in LAUNCH_ENV_VARS else f"fsdp_config.{key}"


def override_keys(overrides: Mapping[str, Any] | Sequence[str] | None) -> frozenset[str]:
    """The config keys a set of overrides (`patch()` keywords, `--set K=V`) names, canonical."""
    if not overrides:
        return frozenset()
    if isinstance(overrides, Mapping):
        dotted = list(overrides)
        nested = [k for k, v in overrides.items() if k == "fsdp_config" and isinstance(v, Mapping)]
        dotted += [str(k) for name in nested for k in overrides[name]]
    else:
        dotted = [str(item).partition("=")[0] for item in ([overrides] if isinstance(overrides, str) else overrides)]
    keys = set()
    for item in dotted:
        name = str(item).strip().split(".")[-1 if not str(item).startswith("fsdp_config.") else 1]
        name = name.removeprefix("fsdp_")
        keys.add(ALIASES.get(name, name))
    return frozenset(keys)


def describe_overrides(changed: Mapping[str, tuple[Any, Any]]) -> str:
    if not changed:
        return ""
    parts = [f"{key}: {new!r} (the file says {old!r})" for key, (old, new) in changed.items()]
    return "; overridden by the launch command line: " + ", ".join(parts)


def discover_config(
    config: str | os.PathLike[str] | Mapping[str, Any] | FSDPOffloadConfig | None,
    overrides: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    launch: AccelerateLaunch | object | None = _FIND,
) -> tuple[FSDPOffloadConfig, str]:
    """Return the validated config and a sentence saying where it came from.

    Precedence is accelerate's: code (`overrides`, and a mapping or config object passed as
    `config`) over the launch command line over a file. So a file, wherever it was named (the
    argument, `$FSDP_OFFLOAD_CFG`, the launch's `--config_file`), takes the launch's exported
    values over its own. `launch` defaults to this process's `accelerate launch` ancestor.
    """
    overrides = dict(overrides or {})
    if config is not None and not isinstance(config, (str, os.PathLike)):  # written in code: wins over the launch
        cfg = load_config(config, overrides or None)
        return cfg, f"argument ({cfg.source})"
    if launch is _FIND:
        launch = find_accelerate_launch()
    assert launch is None or isinstance(launch, AccelerateLaunch)
    env_path = (environ if environ is not None else os.environ).get(ENV_CONFIG_PATH)
    if config is not None:
        file, label = config, f"argument ({os.fspath(config)})"
    elif env_path:
        file, label = env_path, f"${ENV_CONFIG_PATH}={env_path}"
    elif launch is not None and launch.config_file is not None:
        file, label = launch.config_file, f"{launch.named_by} {launch.config_file}"
    else:
        file, label = None, ""
    if file is not None:
        cfg, changed = with_launch_overrides(load_config(file, overrides or None), environ,
                                             typed=launch.typed if launch is not None else None,
                                             keep=override_keys(overrides))
        return cfg, label + describe_overrides(changed)
    env_cfg = config_from_env(registry.environ_before_patching() if environ is None else environ)
    if env_cfg is not None:
        if overrides:
            env_cfg = load_config(env_cfg, overrides)
        return env_cfg, "accelerate's FSDP_* environment variables"
    cfg = load_config({}, overrides or None) if overrides else FSDPOffloadConfig(source="<none found>")
    return cfg, ("no config found yet (nothing to patch for FSDP until TrainingArguments(fsdp=..., fsdp_config=...) "
                 "brings one)" + _how_a_launch_names_a_file(environ if environ is not None else os.environ, launch))


def _how_a_launch_names_a_file(environ: Mapping[str, str], launch: AccelerateLaunch | None) -> str:
    """How a config file would have reached this process, said where none did; the one line the
    user gets at `patch()`. Three starts name none:
    - a launcher of accelerate's (`accelerate launch`, `trl VERB`) given no file, with no default
      file written by `accelerate config`: it runs its defaults, no FSDP;
    - torchrun, which reads no config file: stock `Accelerator()` then runs plain DDP on GPUs, and
      on a machine without one every process alone;
    - plain `python train.py`: one process, no FSDP (accelerate reads a file only in its launch).
    """
    if launch is not None:
        return ("; the launcher that started this process named no accelerate config file and found no default "
                "one: name it, `accelerate launch --config_file fsdp2.yaml ...` (`trl VERB --accelerate_config "
                "fsdp2.yaml ...`)")
    world_size = environ.get("WORLD_SIZE", "")
    if world_size.isdigit() and int(world_size) >= 2:
        return (f"; this is one of {world_size} launched processes: a config file reaches every rank as "
                f"${ENV_CONFIG_PATH}=PATH on the launch command, or as patch(PATH)")
    if "WORLD_SIZE" in environ or "LOCAL_RANK" in environ:  # a launcher's single worker
        return ""
    return ("; this process was started without a launcher (one process, no FSDP): to train with a config "
            "file's fsdp_config, start it as `accelerate launch --config_file fsdp2.yaml "
            f"{this_script_command()}`")

