"""A small registry of reversible, version-guarded patches, and the public `patch()` / `unpatch()`.

Every patch names the module where the symbol is *looked up* (accelerate's `accelerator` module
imports `fsdp2_prepare_model` by name, so patching `fsdp_utils` would change nothing), the
attribute, a builder that wraps the original, and a predicate saying whether the config needs it.
`patch()` resolves and guards every target first and only then swaps anything in, so a failure
never leaves a half-patched process; `unpatch()` puts back the exact original objects.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.version import Version

from fsdp_offload_cfg import clean_exit
from fsdp_offload_cfg._logging import get_logger, is_rank0
from fsdp_offload_cfg.config import ConfigError, FSDPOffloadConfig

logger = get_logger("fsdp_offload_cfg.patching")

# Tested ranges (inclusive lower bound, exclusive upper bound). Upper bounds are the next major
# release: patched internals (`fsdp2_prepare_model`, `AcceleratorState.__init__`) may change there.
SUPPORTED_VERSIONS: dict[str, tuple[str, str]] = {
    "torch": ("2.6", "3"),
    "accelerate": ("1.10", "2"),
    "transformers": ("4.57", "6"),
}


class UnsupportedVersionError(RuntimeError):
    """An installed library is outside the range this plugin's patches were written against."""


@dataclass(frozen=True)
class Patch:
    """One replacement: `module.attribute` (attribute may be `Class.method`) wrapped by `build`."""

    name: str
    module: str
    attribute: str
    build: Callable[[Any, FSDPOffloadConfig], Any]  # (original function, config) -> replacement
    enabled: Callable[[FSDPOffloadConfig], bool]
    requires: tuple[str, ...]  # distributions whose version guards this patch
    description: str
    # (module, attribute) of functions the replacement swaps only while it runs (for the
    # installed versions): checked to exist with the patch itself, before anything changes.
    swaps: Callable[[FSDPOffloadConfig], list[tuple[str, str]]] = lambda cfg: []


@dataclass
class _Applied:
    patch: Patch
    owner: Any  # module or class the attribute lives on
    attr: str
    original: Any  # the raw object from owner.__dict__ (classmethod objects kept as such)


@dataclass
class PatchSession:
    """What `patch()` applied; also a context manager that calls `unpatch()` on exit."""

    config: FSDPOffloadConfig
    source: str
    applied: list[_Applied]
    env_before: dict[str, str | None]

    @property
    def patch_names(self) -> list[str]:
        return [a.patch.name for a in self.applied]

    def __enter__(self) -> PatchSession:
        return self

    def __exit__(self, *exc: object) -> None:
        unpatch()


_SESSION: PatchSession | None = None


def active_config() -> FSDPOffloadConfig | None:
    """The config of the applied patches (None when not patched); replacements read it live."""
    return _SESSION.config if _SESSION is not None else None


def _registry() -> list[Patch]:
    from fsdp_offload_cfg import integrations

    return integrations.PATCHES


def describe_patches(config: FSDPOffloadConfig) -> list[str]:
    """Human-readable list of the patches `patch(config)` would apply."""
    return [f"{p.name}: {p.description}" for p in _registry() if p.enabled(config)]


def check_versions(distributions: set[str]) -> None:
    """Raise `UnsupportedVersionError` naming every installed library outside its tested range."""
    problems = []
    for dist in sorted(distributions):
        low, high = SUPPORTED_VERSIONS[dist]
        try:
            installed = Version(metadata.version(dist))
        except metadata.PackageNotFoundError:
            problems.append(f"{dist} is not installed (need >={low},<{high})")
            continue
        if not (Version(low) <= Version(installed.base_version) < Version(high)):
            problems.append(f"{dist}=={installed} is outside the supported range >={low},<{high}")
    if problems:
        raise UnsupportedVersionError(
            "fsdp_offload_cfg cannot patch this environment: " + "; ".join(problems)
            + ". Install a supported version or pin fsdp-offload-cfg to one that supports yours."
        )


def _resolve(patch: Patch) -> tuple[Any, str, Any]:
    module = importlib.import_module(patch.module)
    *owner_path, attr = patch.attribute.split(".")
    owner: Any = module
    for part in owner_path:
        owner = getattr(owner, part)
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    if raw is None:
        raise UnsupportedVersionError(
            f"patch {patch.name!r}: {patch.module}.{patch.attribute} does not exist in the installed "
            "version; this release of fsdp_offload_cfg does not support it"
        )
    return owner, attr, raw


def _resolve_swap(patch: Patch, module: str, attribute: str) -> None:
    if not callable(getattr(importlib.import_module(module), attribute, None)):
        raise UnsupportedVersionError(
            f"patch {patch.name!r} replaces or calls {module}.{attribute} during a load, and the installed version does not "
            "have it; this release of fsdp_offload_cfg does not support it"
        )


def _install(patch: Patch, owner: Any, attr: str, raw: Any, config: FSDPOffloadConfig) -> None:
    if isinstance(raw, classmethod):
        replacement: Any = classmethod(patch.build(raw.__func__, config))
    elif isinstance(raw, staticmethod):
        replacement = staticmethod(patch.build(raw.__func__, config))
    else:
        replacement = patch.build(raw, config)
    setattr(owner, attr, replacement)


def _discover(config: Any, overrides: Mapping[str, Any]) -> tuple[FSDPOffloadConfig, str]:
    from fsdp_offload_cfg.discovery import discover_config

    return discover_config(config, overrides)


def patch(config: str | Path | Mapping[str, Any] | FSDPOffloadConfig | None = None, **overrides: Any) -> PatchSession:
    """Validate the user's FSDP config and patch accelerate / transformers to honour it.

    Config discovery, first hit wins: `config`; env `FSDP_OFFLOAD_CFG` (a path); the
    `--config_file` of the `accelerate launch` that started this process (or accelerate's default
    config file); accelerate's exported `FSDP_*` variables. Keyword `overrides` are fsdp_config
    keys (`patch(activation_cpu_offload=True)`). Calling it again with the same config is a
    no-op; with another config it cleanly re-applies. Raises `ConfigError` on a bad config,
    `UnsupportedVersionError` on untested library versions and `RuntimeError` once an
    `Accelerator` exists, before changing anything: a failing call leaves the previous
    `patch()` in force, all or nothing.

    A successful call also makes the process wait at exit until gloo's worker threads are idle
    (`clean_exit`: otherwise a finished run can abort at exit); `unpatch()` leaves that in place.
    """
    global _SESSION
    cfg, source = _discover(config, overrides)
    if _SESSION is not None and _SESSION.config == cfg:
        return _SESSION
    _refuse_after_accelerator(source)
    wanted = _checked_patches(cfg)
    previous = _SESSION
    unpatch()
    try:
        _SESSION = _apply(cfg, source, wanted)
    except BaseException:
        if previous is not None:  # all or nothing: the config that worked stays in force
            _SESSION = _apply(previous.config, previous.source, [a.patch for a in previous.applied])
        raise
    clean_exit.install()
    _log_once(_SESSION)
    return _SESSION


def _checked_patches(cfg: FSDPOffloadConfig) -> list[Patch]:
    """The patches `cfg` needs, after every check that can refuse it: runnable here, versions in
    range, every target present. Runs while the previous session (if any) is still in force."""
    from fsdp_offload_cfg.integrations import environment_problems

    problems = environment_problems(cfg)
    if problems:
        raise ConfigError("\n".join(problems))
    wanted = [p for p in _registry() if p.enabled(cfg)]
    check_versions({dist for p in wanted for dist in p.requires})
    for p in wanted:
        _resolve(p)
        for module, attribute in p.swaps(cfg):
            _resolve_swap(p, module, attribute)
    return wanted


def _apply(cfg: FSDPOffloadConfig, source: str, wanted: list[Patch]) -> PatchSession:
    """Install `wanted` and export the config's environment; on failure revert both and raise."""
    from fsdp_offload_cfg.integrations import export_accelerate_env

    resolved = [(p, *_resolve(p)) for p in wanted]  # every target exists before anything changes
    env_before = export_accelerate_env(cfg)
    applied: list[_Applied] = []
    try:
        for p, owner, attr, raw in resolved:
            _install(p, owner, attr, raw, cfg)
            applied.append(_Applied(p, owner, attr, raw))
    except BaseException:
        _revert(applied, env_before)
        raise
    return PatchSession(cfg, source, applied, env_before)


def accelerator_state_exists() -> bool:
    """An `Accelerator` (accelerate's shared `AcceleratorState`) was built in this process."""
    state = sys.modules.get("accelerate.state")
    return state is not None and bool(state.AcceleratorState._shared_state)


def _refuse_after_accelerator(source: str) -> None:
    """`Accelerator()` reads the config when it is built: patching afterwards leaves ranks on
    different paths (rank 1 crashes in `prepare`, rank 0 trains without FSDP). Every rank built
    its Accelerator, so every rank refuses here alike."""
    if accelerator_state_exists():
        raise RuntimeError(
            f"fsdp_offload_cfg.patch() (config from {source}) was called after Accelerator() was created; "
            "the Accelerator has already read its settings. Call fsdp_offload_cfg.patch() first, at the top "
            "of the script, before creating the Accelerator or a Trainer."
        )


def _revert(applied: list[_Applied], env_before: Mapping[str, str | None]) -> None:
    for a in reversed(applied):
        setattr(a.owner, a.attr, a.original)
    for key, value in env_before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def unpatch() -> None:
    """Restore every patched object and environment variable exactly; a no-op when not patched."""
    global _SESSION
    if _SESSION is None:
        return
    _revert(_SESSION.applied, _SESSION.env_before)
    _SESSION = None


def replace_config(cfg: FSDPOffloadConfig, source: str) -> None:
    """Re-apply with a config found later (the Trainer's `fsdp_config`), keeping it active."""
    cfg = dataclasses.replace(cfg, source=source)
    if _SESSION is not None and _SESSION.config == cfg:
        return
    patch(cfg)


def _log_once(session: PatchSession) -> None:
    if not is_rank0():
        return
    logger.info(
        "config from %s; patches: %s",
        session.source,
        ", ".join(session.patch_names) or "none",
    )
