"""Find the user's config without being told: the file they launched with.

Order, first hit wins: explicit argument; env `FSDP_OFFLOAD_CFG`; the `--config_file` of the
`accelerate launch` process that started this one (workers are its descendants), or accelerate's
default config file when that launch named none; accelerate's exported `FSDP_*` variables.
The `FSDP_*` variables are the last resort because `accelerate launch` drops every key it does
not know (this plugin's keys and typos alike) when exporting them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from fsdp_offload_cfg.config import (
    ENV_VARS,
    FSDP1_ONLY_ENV_KEYS,
    LAUNCH_ENV_VARS,
    PLUGIN_KEYS,
    FSDPOffloadConfig,
    config_from_env,
    load_config,
)

ENV_CONFIG_PATH = "FSDP_OFFLOAD_CFG"
_MAX_ANCESTORS = 6


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


def accelerate_launch_config_file() -> Path | None:
    """The config file of the `accelerate launch` ancestor of this process, if there is one."""
    try:
        ancestors = psutil.Process().parents()[:_MAX_ANCESTORS]
    except psutil.Error:
        return None
    for proc in ancestors:
        try:
            cmdline = proc.cmdline()
            if not _is_accelerate_launch(cmdline):
                continue
            arg = _config_file_arg(cmdline)
            if arg is None:
                return _accelerate_default_config_file()
            path = Path(arg)
            return path if path.is_absolute() else Path(proc.cwd()) / path
        except psutil.Error:
            continue
    return None


def _accelerate_default_config_file() -> Path | None:
    from accelerate.commands.config.config_args import default_config_file

    path = Path(default_config_file)
    return path if path.is_file() else None


def with_launch_overrides(
    cfg: FSDPOffloadConfig, environ: Mapping[str, str] = os.environ
) -> tuple[FSDPOffloadConfig, dict[str, tuple[Any, Any]]]:
    """`cfg` (read from the launch's config file) with the values the launcher actually exported.

    `accelerate launch --config_file f.yaml --mixed_precision bf16 --fsdp_activation_checkpointing
    true` exports the command line's values over the file's; accelerate runs with those, so the
    plugin must too (re-exporting the file's would silently undo the command line). The file still
    supplies the plugin's own keys, which accelerate never exports. Returns the merged config and
    `{key: (file value, launch value)}` for every key the launch changed.
    """
    launched = config_from_env(environ)
    if launched is None:
        return cfg, {}
    ignored = set(FSDP1_ONLY_ENV_KEYS) if launched.version == 2 else set()  # exported, but not read under FSDP2
    present = {key for var, key in ENV_VARS.items() if var in environ} - ignored | {
        key for key, var in LAUNCH_ENV_VARS.items() if var in environ and key != "num_processes"
    }
    changed = {
        key: (getattr(cfg, key), getattr(launched, key))
        for key in sorted(present - PLUGIN_KEYS)  # accelerate never exports the plugin's keys: the file is their source
        if getattr(launched, key) != getattr(cfg, key)
    }
    if not changed:
        return cfg, {}
    return dataclasses.replace(cfg, **{key: new for key, (_, new) in changed.items()}), changed


def describe_overrides(changed: Mapping[str, tuple[Any, Any]]) -> str:
    if not changed:
        return ""
    parts = [f"{key}: {new!r} (the file says {old!r})" for key, (old, new) in changed.items()]
    return "; overridden by the launch command line: " + ", ".join(parts)


def discover_config(
    config: str | os.PathLike[str] | Mapping[str, Any] | FSDPOffloadConfig | None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[FSDPOffloadConfig, str]:
    """Return the validated config and a sentence saying where it came from."""
    overrides = dict(overrides or {})
    if config is not None:
        cfg = load_config(config, overrides or None)
        return cfg, f"argument ({cfg.source})"
    env_path = os.environ.get(ENV_CONFIG_PATH)
    if env_path:
        return load_config(env_path, overrides or None), f"${ENV_CONFIG_PATH}={env_path}"
    launch_file = accelerate_launch_config_file()
    if launch_file is not None:
        cfg, changed = with_launch_overrides(load_config(launch_file, overrides or None))
        return cfg, f"accelerate launch --config_file {launch_file}" + describe_overrides(changed)
    env_cfg = config_from_env()
    if env_cfg is not None:
        if overrides:
            env_cfg = load_config(env_cfg, overrides)
        return env_cfg, "accelerate's FSDP_* environment variables"
    cfg = load_config({}, overrides or None) if overrides else FSDPOffloadConfig(source="<none found>")
    return cfg, "no config found (nothing to patch for FSDP)"
