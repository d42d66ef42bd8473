"""Run a callback right after a module is first imported, without importing it ourselves.

Why: a patch of a framework module (TRL's `prepare_fsdp`, PEFT's adapter injection) used to
import that framework inside `patch()`. Frameworks set things up at their own import, in their
own order: LlamaFactory shims `transformers`' package checks before TRL caches them, so a TRL
imported earlier by `patch()` cached `_mergekit_available = (False, None)` (a truthy tuple) and
LlamaFactory's DPO failed to import. So `patch()` imports no framework: the patch is applied when
the framework's module finishes executing, whoever imports it, before any other module can bind
the patched name (`from trl.models.utils import prepare_fsdp` runs after the hook).

How: a meta-path finder in front of the others, which only answers for modules with a pending
callback. It lets the other finders find the module and wraps their loader, so that the
module's own code runs unchanged and the callbacks run right after it (`wrapt`'s post-import
hooks work the same way).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]

_lock = threading.RLock()
_pending: dict[str, list[Callback]] = {}  # module name -> callbacks still to run when it is imported
_finding: set[str] = set()  # names this finder is resolving through the others (no recursion)


def when_imported(name: str, callback: Callback) -> None:
    """Call `callback(module)` once `name` is imported: now if it already is, else right after
    its code has run."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    with _lock:
        _pending.setdefault(name, []).append(callback)
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())


def cancel(name: str, callback: Callback) -> None:
    """Forget a callback that has not run yet (a no-op when it has)."""
    with _lock:
        callbacks = _pending.get(name, [])
        if callback in callbacks:
            callbacks.remove(callback)
        if not callbacks:
            _pending.pop(name, None)


def pending(name: str) -> bool:
    with _lock:
        return bool(_pending.get(name))


def _run(name: str, module: ModuleType) -> None:
    with _lock:
        callbacks = _pending.pop(name, [])
    for callback in callbacks:
        callback(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        with _lock:
            if fullname not in _pending or fullname in _finding:
                return None
            _finding.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            with _lock:
                _finding.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, fullname)
        return spec


class _Loader(importlib.abc.Loader):
    """The real loader, with the callbacks run after `exec_module`; everything else delegated."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader, self._name = loader, name

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _run(self._name, module)

    def __getattr__(self, attr: str) -> Any:  # get_resource_reader, get_filename, is_package, ...
        return getattr(self._loader, attr)
