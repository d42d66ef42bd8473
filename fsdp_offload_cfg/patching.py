"""The public `patch()` / `unpatch()`: find the config, plan its patches, install them all or none.

The machinery (what a patch is, installing and reverting) is in `registry`; the patches
themselves are in `integrations`. This module only puts them together, in named steps:
discover the config, refuse what cannot work, plan, install, log.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from fsdp_offload_cfg import clean_exit, integrations, registry
from fsdp_offload_cfg._logging import get_logger
from fsdp_offload_cfg.config import ConfigError, FSDPOffloadConfig
from fsdp_offload_cfg.discovery import discover_config
from fsdp_offload_cfg.ranks import say_this_rank_is_gone, stay_while_the_note_is_unread
from fsdp_offload_cfg.registry import (
    SUPPORTED_VERSIONS,
    LaunchContext,
    Patch,
    PatchSession,
    UnsupportedVersionError,
    check_versions,
)

logger = get_logger("fsdp_offload_cfg.patching")

__all__ = [
    "SUPPORTED_VERSIONS",
    "LaunchContext",
    "Patch",
    "PatchSession",
    "UnsupportedVersionError",
    "active_config",
    "check_versions",
    "describe_patches",
    "patch",
    "unpatch",
]


def active_config() -> FSDPOffloadConfig | None:
    """The config of the applied patches (None when not patched); replacements read it live."""
    session = registry.active()
    return session.config if session is not None else None


def describe_patches(config: FSDPOffloadConfig, ctx: LaunchContext | None = None) -> list[str]:
    """Human-readable list of the patches `patch(config)` would apply in `ctx` (default: this process)."""
    ctx = ctx or LaunchContext.from_environ()
    lines = [f"{p.name}: {p.description}" for p in integrations.PATCHES if p.enabled(config, ctx)]
    if integrations.expandable_segments_wanted(config, ctx):
        lines.append(f"{registry.EXPANDABLE_SEGMENTS}: {integrations.EXPANDABLE_SEGMENTS_TEXT}")
    return lines


def patch(config: str | Path | Mapping[str, Any] | FSDPOffloadConfig | None = None, **overrides: Any) -> PatchSession:
    """Validate the user's FSDP config and patch accelerate / transformers to honour it.

    Config discovery, first hit wins: `config`; env `FSDP_OFFLOAD_CFG` (a path); the
    `--config_file` of the `accelerate launch` that started this process (or accelerate's default
    config file); accelerate's exported `FSDP_*` variables. Keyword `overrides` are fsdp_config
    keys (`patch(activation_cpu_offload=True)`). Calling it again with the same config is a
    no-op; with another config it cleanly re-applies. Raises `ConfigError` on a bad config,
    `UnsupportedVersionError` on untested library versions and `RuntimeError` once an
    `Accelerator` exists, before changing anything: a failing call leaves the previous
    `patch()` in force, all or nothing. Under a launcher, a `ConfigError` nobody catches ends
    the process with its problems and exit status 1, not a traceback.

    A successful call also makes the process wait at exit until gloo's worker threads are idle
    (`clean_exit`: otherwise a finished run can abort at exit); `unpatch()` leaves that in place.
    """
    ctx = LaunchContext.from_environ()
    _install_excepthook(launched=ctx.distributed)
    cfg, source = discover_config(config, overrides)
    previous = registry.active()
    if previous is not None and previous.config == cfg:
        return previous
    _refuse_after_accelerator(source)
    new = integrations.plan_for(cfg, source, ctx)
    unpatch()
    try:
        session = registry.install(new)
    except BaseException:
        if previous is not None:  # all or nothing: the config that worked stays in force
            registry.install(integrations.plan_for(previous.config, previous.source, ctx))
        raise
    clean_exit.install()
    _log(session)
    return session


def unpatch() -> None:
    """Restore every patched object and environment variable exactly; a no-op when not patched."""
    registry.uninstall()


def _refuse_after_accelerator(source: str) -> None:
    """`Accelerator()` reads the config when it is built: patching afterwards leaves ranks on
    different paths (rank 1 crashes in `prepare`, rank 0 trains without FSDP). Every rank built
    its Accelerator, so every rank refuses here alike."""
    if integrations.accelerator_state_exists():
        raise RuntimeError(
            f"fsdp_offload_cfg.patch() (config from {source}) was called after Accelerator() was created; "
            "the Accelerator has already read its settings. Call fsdp_offload_cfg.patch() first, at the top "
            "of the script, before creating the Accelerator or a Trainer."
        )


def _log(session: PatchSession) -> None:
    integrations.log_active(session)


def _install_excepthook(launched: bool) -> None:
    """What an exception nobody catches does besides its traceback, once per process:

    - with a process group up, it leaves a note in the store (`ranks.say_this_rank_is_gone`):
      the other ranks' next meeting (`prepare` opens with one) names this rank and its error at
      once instead of waiting for it in a collective until the process-group timeout; after
      the traceback, a rank 0 that hosts the store and failed its load stays until the others
      have read that note (`ranks.stay_while_the_note_is_unread`);
    - under a launcher (`launched`), a `ConfigError` prints as its problems instead of a
      traceback. Every rank prints its own, prefixed with its rank: the launcher kills the other
      ranks as soon as one exits, so a rank that stays silent and exits first would take the only
      message with it. The exception still propagates (a script may catch it); the process exits 1.
    """
    if getattr(sys.excepthook, "_fsdp_offload_cfg", False):
        return
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        say_this_rank_is_gone(error)
        if launched and isinstance(error, ConfigError):
            rank = os.environ.get("RANK", "?")
            when = "stopping" if registry.active() is not None else "nothing was patched"  # a run-time check, or patch()
            print(f"[fsdp_offload_cfg rank {rank}] invalid config, {when}:\n{error}", file=sys.stderr)
        else:
            previous(kind, error, tb)
        stay_while_the_note_is_unread(error)  # printed first: the user reads why while the peers come

    excepthook._fsdp_offload_cfg = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook
