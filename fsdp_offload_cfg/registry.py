"""The patch machinery: what a patch is, the launch context it is decided in, and the installed session.

Both `integrations` (the patches themselves) and `patching` (the public `patch()`) use this
module; it imports neither, so there is no cycle to hide behind function-local imports.

- `Patch`: one reversible replacement, named by the module where the symbol is *looked up*
  (accelerate's `accelerator` module imports `fsdp2_prepare_model` by name, so patching
  `fsdp_utils` alone would change nothing).
- `LaunchContext`: what the launcher decided (process count, accelerator present). Predicates
  read it as an argument, so `explain` can ask "what would 8 processes get?" without writing
  `WORLD_SIZE` into its own environment.
- `Plan` -> `install` / `switch` / `uninstall`: every target is resolved and guarded before
  anything changes; a failure never leaves a half-patched process; uninstall puts back the
  exact original objects and environment values, and the CUDA allocator's expandable segments
  where the plan turned them on (`compat.allocator`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from packaging.version import Version

from fsdp_offload_cfg.compat import allocator
from fsdp_offload_cfg.config import FSDPOffloadConfig

# Tested ranges (inclusive lower bound, exclusive upper bound). Upper bounds are the next major
# release: patched internals (`fsdp2_prepare_model`, `AcceleratorState.__init__`) may change there.
SUPPORTED_VERSIONS: dict[str, tuple[str, str]] = {
    "torch": ("2.11", "3"),
    "accelerate": ("1.10", "2"),
    "transformers": ("4.57", "6"),
}


class UnsupportedVersionError(RuntimeError):
    """An installed library is outside the range this plugin's patches were written against."""


@dataclass(frozen=True)
class LaunchContext:
    """What the launcher (torchrun / accelerate launch), not the config, decides."""

    world_size: int = 1
    launcher: bool = False  # started by a launcher (LOCAL_RANK set), even as a single process
    accelerator: bool = False  # a device accelerate would pick over the CPU (CUDA, XPU, NPU)
    cuda_allocator: bool = False  # torch's CUDA caching allocator is this machine's (compat.allocator)

    @property
    def distributed(self) -> bool:
        """More than one process, or a launcher's worker: collectives are in play."""
        return self.world_size > 1 or self.launcher

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> LaunchContext:
        try:
            world_size = int(environ.get("WORLD_SIZE", "1"))
        except ValueError:
            world_size = 1
        return cls(world_size, environ.get("LOCAL_RANK") is not None, has_accelerator_device(), allocator.cuda_allocator_here())

    @classmethod
    def for_processes(cls, num_processes: int | None) -> LaunchContext:
        """The context a launch of `num_processes` would give on this machine (for `explain`)."""
        count = max(num_processes or 1, 1)
        return cls(count, count > 1, has_accelerator_device(), allocator.cuda_allocator_here())


def has_accelerator_device() -> bool:
    """Any device accelerate would pick over the CPU (CUDA, XPU, NPU; MPS excluded on purpose)."""
    import torch

    if torch.cuda.is_available():
        return True
    for name in ("xpu", "npu"):
        backend = getattr(torch, name, None)
        if backend is not None and backend.is_available():
            return True
    return False


@dataclass(frozen=True)
class Patch:
    """One replacement: `module.attribute` (attribute may be `Class.method`) wrapped by `build`."""

    name: str
    module: str
    attribute: str
    build: Callable[[Any, FSDPOffloadConfig], Any]  # (original function, config) -> replacement
    enabled: Callable[[FSDPOffloadConfig, LaunchContext], bool]
    requires: tuple[str, ...]  # distributions whose version guards this patch
    description: str
    # (module, attribute) of functions the replacement swaps only while it runs (for the
    # installed versions): checked to exist with the patch itself, before anything changes, where
    # their module is imported; else when it is (`Plan.waiting_swaps`); a lazy patch's, at its import.
    swaps: Callable[[FSDPOffloadConfig], list[tuple[str, str]]] = lambda cfg: []
    # The replacement does not depend on the config: a config switch leaves it installed. The
    # Trainer's patch is one, and switches the config from inside its own replacement.
    config_free: bool = False
    # The target is a framework's (TRL, PEFT, the Trainer's modules, transformers' models):
    # `patch()` never imports it; the replacement goes in when the module is first imported, by
    # whoever imports it (`post_import`). The Trainer's `training_args` imports PEFT: about 1.7 s
    # of imports a rank (`-X importtime`), for a script that never builds a Trainer; transformers'
    # `modeling_utils` imports dynamo and its kernels' integrations: 3-4 CPU-s in each launcher
    # process `patch()` runs in under `fsdp-offload-cfg run` (a framework's front end: `swift sft`,
    # `trl sft`), which never loads a model.
    lazy: bool = False


@dataclass(frozen=True)
class Plan:
    """What one config needs here, after every check that can refuse it."""

    config: FSDPOffloadConfig
    source: str
    patches: list[Patch]
    env: dict[str, str]  # variables to export (what accelerate launch would have exported)
    # how this plan was made, for a config that arrives later (the Trainer's `fsdp_config`): the
    # patch that receives it plans it the same way without importing the planner (a cycle)
    replan: Callable[[FSDPOffloadConfig, str], Plan] | None = None
    # turn the CUDA allocator's expandable segments on while this plan is in force (decided by
    # `integrations.common.expandable_segments_wanted`)
    expandable_segments: bool = False
    # (patch, module, attribute) of swapped functions whose module nobody had imported: checked
    # when it is. Importing it to check would cost a launcher that never uses it the module: FSDP2's
    # `fully_shard` brings DTensor and sympy, 2.5-3.2 CPU-s (`benchmarks/launcher_patch.py`); a
    # training process imports it with transformers' models or at `prepare`, and the check stops
    # that import, before the patch that swaps it has run.
    waiting_swaps: tuple[tuple[Patch, str, str], ...] = ()


@dataclass
class _Applied:
    patch: Patch
    owner: Any  # module or class the attribute lives on
    attr: str
    original: Any  # the raw object from owner.__dict__ (classmethod objects kept as such)
    replacement: Any  # what was set: revert only while it is still there


@dataclass
class PatchSession:
    """What `patch()` applied; also a context manager that undoes it on exit."""

    config: FSDPOffloadConfig
    source: str
    applied: list[_Applied]
    env_before: dict[str, str | None]  # every variable this session set, as it was before
    replan: Callable[[FSDPOffloadConfig, str], Plan] | None = None  # its plan's (see `Plan.replan`)
    # what the patches did to objects while the session was active (activation offload enabled
    # on prepared models): undone by `uninstall`, last first
    undo: list[Callable[[], None]] = field(default_factory=list)
    # lazy patches whose module nobody has imported yet, with the callback that installs each
    pending: list[tuple[Patch, Callable[[Any], None]]] = field(default_factory=list)
    # the plan's waiting swaps, with the callback that checks each at its module's import
    swap_checks: list[tuple[str, Callable[[Any], None]]] = field(default_factory=list)
    # this session turned the CUDA allocator's expandable segments on: `uninstall` turns them off
    expandable_segments: bool = False

    @property
    def patch_names(self) -> list[str]:
        """The patches in force, and those that go in when their framework is imported."""
        allocator = [EXPANDABLE_SEGMENTS] if self.expandable_segments else []
        return [a.patch.name for a in self.applied] + [p.name for p, _ in self.pending] + allocator

    def __enter__(self) -> PatchSession:
        return self

    def __exit__(self, *exc: object) -> None:
        uninstall()


_ACTIVE: PatchSession | None = None  # the installed session; replacements read its config live
# how the allocator setting is listed among the patches (`explain`, rank 0's line)
EXPANDABLE_SEGMENTS = "cuda-expandable-segments"


def active() -> PatchSession | None:
    return _ACTIVE


def displaced() -> list[str]:
    """The active session's patches that something replaced since they went in (a framework's own
    copy, installed after `patch()`), each as "`module.attribute` (patch `name`) by `whose`":
    where what a patch does did not happen, the cause is then outside this package, and the
    error that says it names them. Where two of ours wrap one attribute (the Trainer's
    `save_model`), the last one applied is the one there."""
    if _ACTIVE is None:
        return []
    from fsdp_offload_cfg._signatures import qualified_name

    last = {(id(a.owner), a.attr): a for a in _ACTIVE.applied}
    return [f"{a.patch.module}.{a.patch.attribute} (patch `{a.patch.name}`) by {qualified_name(now)}"
            for a in last.values() if (now := _current(a.owner, a.attr)) is not a.replacement]


def displaced_said() -> str:
    """`displaced()` as the loader's guard adds it to its error about a model left on meta (a
    prepare replaced after `patch()` may never fill it); "" where every patch is in place."""
    replaced = displaced()
    if not replaced:
        return ""
    return (" Replaced since fsdp_offload_cfg.patch(), so the loader's fill may never run: "
            + "; ".join(replaced) + ". Where a framework does this, please report it to fsdp_offload_cfg.")


def environ_before_patching() -> dict[str, str]:
    """The environment as it was before the active session exported its variables: what the
    launcher and the user set. A second `patch()` must not read the first one's exports back as
    the launch command line's values."""
    environ = dict(os.environ)
    if _ACTIVE is not None:
        for key, value in _ACTIVE.env_before.items():
            if value is None:
                environ.pop(key, None)
            else:
                environ[key] = value
    return environ


# -------------------------------------------------------------------------------------------
# Checks
# -------------------------------------------------------------------------------------------


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


def resolve(patch: Patch) -> tuple[Any, str, Any]:
    """(owner, attribute, raw original) of a patch target; `UnsupportedVersionError` if absent."""
    module = importlib.import_module(patch.module)
    *owner_path, attr = patch.attribute.split(".")
    owner: Any = module
    for part in owner_path:
        owner = getattr(owner, part)
    raw = _current(owner, attr)
    if raw is None:
        raise UnsupportedVersionError(
            f"patch {patch.name!r}: {patch.module}.{patch.attribute} does not exist in the installed "
            "version; this release of fsdp_offload_cfg does not support it"
        )
    return owner, attr, raw


def _current(owner: Any, attr: str) -> Any:
    return owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)


def _checked(patch: Patch, cfg: FSDPOffloadConfig) -> tuple[Any, str, Any]:
    """`resolve(patch)` of a lazy patch at its framework's import, once every function it swaps
    under `cfg` is there too (imported now: the framework's import is under way)."""
    target = resolve(patch)
    for module, attribute in patch.swaps(cfg):
        _check_swap(patch, importlib.import_module(module), attribute)
    return target


def _check_swap(patch: Patch, module: Any, attribute: str) -> None:
    if not callable(getattr(module, attribute, None)):
        raise UnsupportedVersionError(
            f"patch {patch.name!r} replaces or calls {module.__name__}.{attribute} while it runs, and the installed "
            "version does not have it; this release of fsdp_offload_cfg does not support it"
        )


def plan(cfg: FSDPOffloadConfig, source: str, patches: list[Patch], ctx: LaunchContext,
         env: dict[str, str], replan: Callable[[FSDPOffloadConfig, str], Plan] | None = None,
         expandable_segments: bool = False) -> Plan:
    """The patches `cfg` needs in `ctx`, with versions in range and every target present."""
    wanted = [p for p in patches if p.enabled(cfg, ctx)]
    check_versions({dist for p in wanted for dist in p.requires})
    now = [p for p in wanted if not (p.lazy and p.module not in sys.modules)]  # the others: `_checked` at their import
    for p in now:
        resolve(p)
    waiting = []
    for p in now:  # after every import the targets made
        for module, attribute in p.swaps(cfg):
            if module in sys.modules:
                _check_swap(p, sys.modules[module], attribute)
            else:
                waiting.append((p, module, attribute))
    return Plan(cfg, source, wanted, env, replan, expandable_segments, tuple(waiting))


# -------------------------------------------------------------------------------------------
# Install, switch, uninstall
# -------------------------------------------------------------------------------------------


def install(new: Plan) -> PatchSession:
    """Install a plan as the active session (none may be active); all or nothing."""
    global _ACTIVE
    assert _ACTIVE is None, "uninstall the active session first"
    env_before = _export(new.env)
    applied: list[_Applied] = []
    try:
        _install_all(new, new.patches, applied)
        _set_expandable_segments(False, new.expandable_segments)
    except BaseException:
        _revert(applied, env_before)
        raise
    _ACTIVE = PatchSession(new.config, new.source, applied, env_before, new.replan,
                           expandable_segments=new.expandable_segments)
    _install_later(_ACTIVE, new)
    _tell_the_guard()
    return _ACTIVE


def _tell_the_guard() -> None:
    """The loader's guard, a floor below, says what `displaced_said` finds (it cannot import this)."""
    from fsdp_offload_cfg.loading import guard

    guard.left_on_meta_because = displaced_said


def switch(new: Plan) -> PatchSession:
    """Make `new` the active session's config, leaving config-free patches in place.

    The Trainer's patch calls this from inside its own replacement: that replacement stays
    installed (and running) throughout; only the config-dependent patches are swapped.
    """
    session = _ACTIVE
    assert session is not None, "switch needs an active session"
    kept = [a for a in session.applied if a.patch.config_free and a.patch in new.patches]
    dropped = [a for a in session.applied if a not in kept]
    _revert(dropped, {})
    _restore_env({k: v for k, v in session.env_before.items() if k not in new.env})
    for key, value in _export(new.env).items():
        session.env_before.setdefault(key, value)
    _cancel_pending(session)
    applied = list(kept)
    kept_patches = {a.patch for a in kept}
    try:
        _install_all(new, [p for p in new.patches if p not in kept_patches], applied)
    except BaseException:
        _revert([a for a in applied if a not in kept], {})
        raise
    _set_expandable_segments(session.expandable_segments, new.expandable_segments)
    session.expandable_segments = new.expandable_segments
    order = {p.name: i for i, p in enumerate(new.patches)}
    session.applied = sorted(applied, key=lambda a: order[a.patch.name])
    session.config, session.source = new.config, new.source
    _install_later(session, new)
    return session


def uninstall() -> None:
    """Restore every patched object and environment variable exactly, and undo what the patches
    did while active (`on_uninstall`); a no-op when none is active."""
    global _ACTIVE
    if _ACTIVE is not None:
        while _ACTIVE.undo:
            _ACTIVE.undo.pop()()
        _cancel_pending(_ACTIVE)
        _revert(_ACTIVE.applied, _ACTIVE.env_before)
        _set_expandable_segments(_ACTIVE.expandable_segments, False)
        _ACTIVE = None


def on_uninstall(undo: Callable[[], None]) -> None:
    """Have `uninstall` call `undo` (a replacement that changed an object, e.g. hooked a model)."""
    if _ACTIVE is not None:
        _ACTIVE.undo.append(undo)


def _install_all(new: Plan, patches: list[Patch], applied: list[_Applied]) -> None:
    """Every patch whose target is imported (lazy ones whose framework is not wait: `_install_later`)."""
    now = [p for p in patches if not (p.lazy and p.module not in sys.modules)]
    resolved = [(p, *resolve(p)) for p in now]  # every target exists before anything changes
    for p, owner, attr, raw in resolved:
        _apply(p, owner, attr, raw, new.config, applied)


def _apply(p: Patch, owner: Any, attr: str, raw: Any, config: FSDPOffloadConfig, applied: list[_Applied]) -> None:
    if isinstance(raw, classmethod):
        replacement: Any = classmethod(p.build(raw.__func__, config))
    elif isinstance(raw, staticmethod):
        replacement = staticmethod(p.build(raw.__func__, config))
    else:
        replacement = p.build(raw, config)
    setattr(owner, attr, replacement)
    applied.append(_Applied(p, owner, attr, raw, replacement))


def _set_expandable_segments(now: bool, wanted: bool) -> None:
    """Turn the allocator's expandable segments on or back off where that changes. Off is torch's
    default, which the allocator had before: a plan only turns them on where the user's
    allocator variable is unset or silent about them."""
    if now != wanted:
        allocator.set_expandable(wanted)


def _install_later(session: PatchSession, new: Plan) -> None:
    """Lazy patches whose framework is not imported yet go in right after its import; the swaps
    whose module is not imported yet are checked right after its import."""
    from fsdp_offload_cfg import post_import

    installed = {a.patch for a in session.applied}
    for p in new.patches:
        if p.lazy and p not in installed:

            def on_import(module: Any, p: Patch = p) -> None:
                session.pending[:] = [(q, cb) for q, cb in session.pending if q is not p]
                if _ACTIVE is session:
                    _apply(p, *_checked(p, session.config), session.config, session.applied)

            session.pending.append((p, on_import))
            post_import.when_imported(p.module, on_import)
    for p, name, attribute in new.waiting_swaps:

        def check(module: Any, p: Patch = p, attribute: str = attribute) -> None:  # kept listed: cancel is a no-op once run
            if _ACTIVE is session:
                _check_swap(p, module, attribute)

        session.swap_checks.append((name, check))
        post_import.when_imported(name, check)


def _cancel_pending(session: PatchSession) -> None:
    from fsdp_offload_cfg import post_import

    for p, callback in session.pending:
        post_import.cancel(p.module, callback)
    for name, callback in session.swap_checks:
        post_import.cancel(name, callback)
    session.pending.clear()
    session.swap_checks.clear()


def _export(env: Mapping[str, str]) -> dict[str, str | None]:
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    return before


def _restore_env(before: Mapping[str, str | None]) -> None:
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _revert(applied: list[_Applied], env_before: Mapping[str, str | None]) -> None:
    """Put each original back, unless something replaced ours since (a framework's own copy,
    e.g. axolotl's `fsdp2_prepare_model`): restoring the original would undo theirs."""
    for a in reversed(applied):
        if _current(a.owner, a.attr) is a.replacement:
            setattr(a.owner, a.attr, a.original)
    _restore_env(env_before)
