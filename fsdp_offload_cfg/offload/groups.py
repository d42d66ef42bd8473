"""Finding the offload groups of a model and hooking them.

A group is one unit of the forward (an FSDP unit, a decoder layer). Automatic choice, first that
yields anything: FSDP2 units (`FSDPModule` below the root), FSDP1 units (`FullyShardedDataParallel`
below the root), then modules whose class is named in transformers' `_no_split_modules`. Among
FSDP units, if the model declares `_no_split_modules` and some units match it, only those are
kept: accelerate also shards the embedding and the `[norm, lm_head]` tail as units of their own,
and those are not layers.

Each group is lifted through the wrappers around it (`CheckpointWrapper`, `OffloadWrapper`,
FSDP1's wrapper) so that the group's hooks see the checkpoint's saved inputs, which are saved
*outside* the wrapped layer; with the outermost wrapper as the boundary, checkpoint
recomputation (which calls the inner module) does not even fire the group hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

_WRAPPED_ATTRS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module")
# the names the group hooks carry: dynamo names a function it refused in its error, and these tell
# an error at our hooks from any other (`explain_compile_error`)
_HOOK_NAMES = ("fsdp_offload_cfg_enter_group", "fsdp_offload_cfg_exit_group")

LayerClasses = Iterable[type[nn.Module] | str]


def _wrapped(module: nn.Module) -> nn.Module | None:
    """The module directly inside a checkpoint/FSDP1 wrapper, or None if `module` is no wrapper."""
    for attr in _WRAPPED_ATTRS:
        inner = getattr(module, attr, None)
        if isinstance(inner, nn.Module):
            return inner
    return None


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside any chain of checkpoint/FSDP1 wrappers."""
    while (inner := _wrapped(module)) is not None:
        module = inner
    return module


def own_class(module: nn.Module) -> type[nn.Module]:
    """The class its user wrote: inside any checkpoint/FSDP1 wrapper, without the `FSDP<class>`
    subclass FSDP2 swaps in."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(unwrap(module)).__mro__ if not issubclass(c, FSDPModule))


def _class_names(module: nn.Module) -> set[str]:
    """Names along the MRO: FSDP2 renames classes (`FSDPLlamaDecoderLayer`) but keeps the base."""
    return {c.__name__ for c in type(unwrap(module)).__mro__}


def _matches(module: nn.Module, classes: Sequence[type[nn.Module] | str]) -> bool:
    names = _class_names(module)
    inner = unwrap(module)
    return any(c in names if isinstance(c, str) else isinstance(inner, c) for c in classes)


def _no_split_names(model: nn.Module) -> list[str]:
    for m in model.modules():  # the root first; FSDP1/DDP roots hold it one level down
        names = getattr(m, "_no_split_modules", None)
        if names:
            return list(names)
    return []


def _fsdp_units(model: nn.Module) -> list[nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        return []
    for kind in (FSDPModule, FullyShardedDataParallel):
        units = [m for m in model.modules() if isinstance(m, kind) and m is not model]
        if units:
            return units
    return []


def find_units(model: nn.Module, layer_classes: LayerClasses | None = None) -> list[nn.Module]:
    """The group modules before lifting; explicit `layer_classes` win over detection."""
    if layer_classes is not None:
        classes = list(layer_classes)
        return [m for m in model.modules() if m is not model and unwrap(m) is m and _matches(m, classes)]
    no_split = _no_split_names(model)
    units = _fsdp_units(model)
    if units:
        layers = [m for m in units if no_split and _matches(m, no_split)]
        return layers or units
    if no_split:
        return [m for m in model.modules() if m is not model and unwrap(m) is m and _matches(m, no_split)]
    return []


def lift_to_boundaries(model: nn.Module, units: Iterable[nn.Module]) -> list[nn.Module]:
    """Outermost wrapper of each unit, nested ones dropped, in registration (= forward) order."""
    parent: dict[int, nn.Module] = {}
    for m in model.modules():
        for child in m.children():
            parent.setdefault(id(child), m)
    lifted: dict[int, nn.Module] = {}
    for unit in units:
        b = unit
        while (p := parent.get(id(b))) is not None and p is not model and _wrapped(p) is b:
            b = p
        lifted[id(b)] = b
    ids = set(lifted)

    def nested(m: nn.Module) -> bool:
        p = parent.get(id(m))
        while p is not None:
            if id(p) in ids:
                return True
            p = parent.get(id(p))
        return False

    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted((m for m in lifted.values() if not nested(m)), key=lambda m: order.get(id(m), 0))


class GroupHooks:
    """Entry and exit hooks on every boundary, and nothing on the modules inside it; registered after FSDP's own hooks (FSDP2 prepends its
    pre-forward unshard), so at entry an FSDP2 boundary's unsharded parameters exist. Parameters
    unsharded after the entry (FSDP1 inside its forward, an FSDP2 layer inside a wrapper) need no
    hook of their own: they are saved as parameters or views of them, which the filter keeps by
    type (`filter._is_param_like`; tests/test_offload_dist.py covers FSDP1's flat and original
    parameters). A hook on the module inside a checkpoint wrapper would run inside the
    checkpointed region, where dynamo cannot trace it and splits a compiled layer's graph:
    gradients then differ in the last bits.

    Each boundary's hooks take one of two forms, for `torch.compile`:
      - traced (the default): a model compiled whole inlines every layer's call, hooks included,
        into one graph; there our forward steps aside (`api._wrap_forward`), the hooks find no
        pass and return, and dynamo traces that as nothing at all;
      - opaque (`torch.compiler.disable`d), for a boundary compiled on its own (`layer.compile()`,
        or `torch.compile(layer)` in the model): dynamo compiles such a layer's forward and runs
        its hooks as frames of their own, where a traced hook would meet what dynamo cannot trace
        (autograd's graph task, the saved-tensor hooks stack) and graph-break, or, under
        `fullgraph=True`, stop the run. An opaque hook runs eagerly, before and after the
        compiled forward, as the offload needs.
    An opaque hook inlined into a larger graph would break it, so the form follows how each
    boundary is compiled, checked at each eager forward (`match_compilation`).
    """

    def __init__(self, boundaries: Sequence[nn.Module], enter: Callable[[int, nn.Module], None],
                 exit_: Callable[[int], None]) -> None:
        self._boundaries = list(boundaries)
        self._enter, self._exit = enter, exit_
        self._opaque = [False] * len(self._boundaries)  # the form each boundary's hooks have now
        self._handles = [self._register(i) for i in range(len(self._boundaries))]

    def _hook_pair(self, index: int, opaque: bool) -> tuple[Callable[..., None], Callable[..., None]]:
        enter, exit_ = self._enter, self._exit

        def pre(module: nn.Module, _args: Any) -> None:
            enter(index, module)

        def post(_module: nn.Module, _args: Any, _out: Any) -> None:
            exit_(index)

        pre.__name__ = pre.__qualname__ = _HOOK_NAMES[0]
        post.__name__ = post.__qualname__ = _HOOK_NAMES[1]
        if opaque:
            import torch._dynamo  # here: `import fsdp_offload_cfg` stays light

            pre, post = torch._dynamo.disable(pre, recursive=True), torch._dynamo.disable(post, recursive=True)
        return pre, post

    def _register(self, index: int) -> tuple[RemovableHandle, RemovableHandle]:
        pre, post = self._hook_pair(index, opaque=False)
        boundary = self._boundaries[index]
        return boundary.register_forward_pre_hook(pre), boundary.register_forward_hook(post)

    def match_compilation(self, root: nn.Module) -> None:
        """Give each boundary the hook form its compilation needs (see the class docstring).

        Swapped in place, under the same handles: the hooks keep their place among the boundary's
        others (FSDP2's unshard before them, any hook registered since after them), as they were
        when the offload was enabled."""
        compiled = _compiled_on_their_own(root)
        for index, boundary in enumerate(self._boundaries):
            opaque = id(boundary) in compiled
            if opaque != self._opaque[index]:
                pre, post = self._hook_pair(index, opaque)
                pre_handle, post_handle = self._handles[index]
                boundary._forward_pre_hooks[pre_handle.id] = pre
                boundary._forward_hooks[post_handle.id] = post
                self._opaque[index] = opaque

    def explain_compile_error(self, error: Exception, root: nn.Module) -> OffloadCompileError | None:
        """dynamo's refusal of our hooks inside a compiled graph, said in the user's terms; None for
        any other error.

        A layer wrapped by `torch.compile(layer, fullgraph=True)` (accelerate's regional
        compilation with `dynamo_use_fullgraph`) has its hooks inlined into its graph by torch
        below 2.13, and by any torch when its class has a `__call__` of its own (transformers'
        `GradientCheckpointingLayer` up to 5.16 at least). No offload hook can run there: dynamo
        says "Skip calling `torch.compiler.disable()`d function" and hints to remove the call, in
        our code, which the user cannot act on."""
        if type(error).__name__ != "Unsupported" or not any(name in str(error) for name in _HOOK_NAMES):
            return None
        boundaries = {id(b) for b in self._boundaries}
        wrapped = [name for name, m in root.named_modules() if id(_compile_wrapped(m)) in boundaries]
        where = f"{wrapped[0]} (and {len(wrapped) - 1} more)" if len(wrapped) > 1 else (wrapped or ["a layer"])[0]
        return OffloadCompileError(
            f"activation offload: torch.compile traced the offload's layer hooks into the compiled graph of {where}, "
            "where they cannot run under fullgraph=True. dynamo inlines the hooks of a layer wrapped by "
            "torch.compile(layer) when torch is older than 2.13 or the layer class has a __call__ of its own "
            "(transformers' GradientCheckpointingLayer up to 5.16 at least). Compile each layer in place instead "
            "(layer.compile(fullgraph=True)), or without fullgraph (accelerate: dynamo_use_fullgraph: false; the layer "
            "then graph-breaks at the offload's hooks only, and trains exactly), or upgrade torch to 2.13 or newer and "
            "transformers to 5.24 or newer.")

    def remove(self) -> None:
        for pair in self._handles:
            for handle in pair:
                handle.remove()
        self._handles = []


class OffloadCompileError(RuntimeError):
    """torch.compile put the offload's hooks inside a compiled graph, where they cannot run."""


def _compile_wrapped(module: nn.Module) -> nn.Module | None:
    """The module inside a `torch.compile(module)` wrapper (an `OptimizedModule`), or None."""
    inner = module._modules.get("_orig_mod") if type(module).__name__ == "OptimizedModule" else None
    return inner if isinstance(inner, nn.Module) else None


def _compiled_on_their_own(root: nn.Module) -> set[int]:
    """Modules under `root` that run as a compiled region of their own: compiled in place
    (`module.compile()`), or wrapped by `torch.compile(module)` (accelerate's regional compilation)."""
    found = set()
    for module in root.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            found.add(id(module))
        if (inner := _compile_wrapped(module)) is not None:
            found.add(id(inner))
    return found


__all__ = ["GroupHooks", "OffloadCompileError", "find_units", "lift_to_boundaries", "unwrap"]
