"""Checkpoint-backed meta tensors that read themselves from the files when their values are used.

Why: under "auto" and "sharded" every rank that can read the checkpoint builds the model on
`meta`, rank 0 included, so that `prepare` fills each rank's shards alone. A model that no rank
prepares (`if accelerator.is_main_process: m = from_pretrained(p)`, a copy for export or
evaluation) would answer `m.lm_head.weight.sum()` with a meta tensor, without a word, and
`copy.deepcopy(m)` with a copy nothing could fill. Reading every loaded model whole "just in case"
is the peak the loader exists to avoid, and a framework touching a model it will prepare (an
optimizer built on it, PEFT wrapping it, `.to(torch.bfloat16)`) must not read it either. So each
tensor reads itself, alone, at the first operation that needs its values. torch's own precedent
is `UninitializedParameter` (lazy modules): a parameter whose class changes once it holds data.

How: `mark` gives every meta tensor the record backs the class `PendingParameter` (parameters) or
`PendingTensor` (buffers), in place (same object, `__class__` set, as
`UninitializedParameter.materialize` does). Their `__torch_function__`:
  - what reads no value passes through: shapes, dtypes, devices, `is_*`, `requires_grad_`,
    setters, hooks, allocations shaped like it (`empty_like`, `new_zeros`, ...);
  - `detach()`, `.data` and a cast that stays on meta (`.to(torch.float32)`, `.bfloat16()`) give a
    derived pending tensor (read when its values are used, as the same op on the read tensor), so
    `param.data = param.data.to(torch.float32)` (LlamaFactory's upcast) and `model.to(dtype)`
    cast without a read;
  - anything else reads the tensor from its file on this rank, in place
    (`torch.utils.swap_tensors`: every holder of the object, ties and optimizers included, sees
    the values), takes it out of the record (so `prepare`, should it come, sends it from where it
    is real: `sharded.agree_sources`), and runs the op on the real tensor;
  - `copy.deepcopy` gives a pending tensor of the copy, backed by the copy's record, reading
    nothing (the copy is a loader-built model of its own: TRL's `create_reference_model`).
`release` turns them back into plain meta tensors when `prepare` starts filling the model;
inside `plain_meta()` (PEFT computing on a meta base on the ranks that receive rank 0's values,
DoRA's deferred norm) they behave as plain meta tensors.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_flatten

from fsdp_offload_cfg._logging import get_logger
from fsdp_offload_cfg.loading.file_reads import read_whole
from fsdp_offload_cfg.loading.local import LOCAL_LOADING_HINT
from fsdp_offload_cfg.safetensors_index import converted

logger = get_logger("fsdp_offload_cfg.loading")

KEY = "_fsdp_offload_cfg_pending"  # in the tensor's __dict__: its `_Backing` or `_Derived`
_plain = threading.local()  # `depth` > 0 inside `plain_meta()` on this thread

# Operations that read no value of their tensor arguments (by name: a method, its function form).
_READS_NOTHING = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "element_size",
    "is_contiguous", "is_floating_point", "is_complex", "is_signed", "is_inference", "is_pinned",
    "is_shared", "is_same_size", "get_device", "data_ptr", "untyped_storage", "result_type",
    "requires_grad_", "retain_grad", "register_hook", "register_post_accumulate_grad_hook", "detach_",
    "__hash__", "__setstate__", "_has_compatible_shallow_copy_type", "__set__",
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "new_tensor",
})
_VALUE_GETTERS = frozenset({"T", "mT", "H", "mH", "real", "imag"})  # properties that are views of the values
_CASTS = frozenset({"to", "type", "float", "double", "half", "bfloat16", "int", "long", "short", "bool"})


@dataclass
class _Backing:
    """A pending tensor's checkpoint tensor: `record.lookup(tensor)` while it is backed."""

    record: Any  # the model's `checkpoint.CheckpointRecord` (shared by all its pending tensors)
    name: str  # its first name in the model, for the log
    what: str  # the call that made the model, e.g. "load /ckpt", for the log


@dataclass
class _Derived:
    """A tensor derived from a pending one without reading it: `op(source)` once it is read."""

    source: torch.Tensor
    op: Callable[[torch.Tensor], Any]


class _Pending:
    """The behaviour both pending classes share (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        _note_cast(func, args)
        if getattr(_plain, "depth", 0) or _reads_nothing(func, args, kwargs):
            with DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return out if getattr(_plain, "depth", 0) else _derived(func, args, kwargs, out)
        for arg in tree_flatten((args, kwargs))[0]:
            if is_pending(arg):
                materialize(arg)
        return func(*args, **kwargs)  # no argument of ours is pending now: torch's own dispatch

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        if id(self) in memo:
            return memo[id(self)]
        with DisableTorchFunctionSubclass():
            value = torch.empty_like(self, device="meta")
        new = nn.Parameter(value, requires_grad=self.requires_grad) if isinstance(self, nn.Parameter) else value
        memo[id(self)] = new  # first: the record's own copy (below) reaches this tensor again
        info = self.__dict__[KEY]
        where = info.record.lookup(self) if isinstance(info, _Backing) else None
        if isinstance(info, _Backing) and where is None:
            return new  # no longer backed: a plain meta tensor, as the original behaves
        info = copy.deepcopy(info, memo)
        if where is not None:
            info.record.add(new, where)
        new.__class__ = type(self)
        new.__dict__[KEY] = info
        return new


class PendingParameter(_Pending, nn.Parameter):
    """A parameter on meta whose values are in the checkpoint files (see the module docstring)."""


class PendingTensor(_Pending, torch.Tensor):
    """A buffer on meta whose values are in the checkpoint files, or a tensor derived from a
    pending one (see the module docstring)."""


def is_pending(t: Any) -> bool:
    return isinstance(t, _Pending)


def mark(model: nn.Module, record: Any, what: str) -> None:
    """Make every meta tensor of `model` that `record` backs pending (in place)."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in named:
        if t.is_meta and not is_pending(t) and record.lookup(t) is not None:
            t.__class__ = PendingParameter if isinstance(t, nn.Parameter) else PendingTensor
            t.__dict__[KEY] = _Backing(record, name, what)


def release(model: nn.Module) -> None:
    """Every pending tensor of `model` becomes a plain meta tensor again (`prepare` fills it). A
    derived one the model holds (`model.to(dtype)` replaces each buffer by its cast) enters its
    source's record, read through the dtypes on the way."""
    for t in [*model.parameters(), *model.buffers()]:
        if is_pending(t):
            _adopt(t)
            _unmark(t)


def _adopt(t: torch.Tensor) -> None:
    chain = [t]
    while isinstance(info := chain[-1].__dict__.get(KEY), _Derived) and is_pending(info.source):
        chain.append(info.source)
    root = chain[-1].__dict__.get(KEY)
    where = root.record.lookup(chain[-1]) if isinstance(root, _Backing) and len(chain) > 1 else None
    if where is None:
        return
    with DisableTorchFunctionSubclass():
        for step in reversed(chain[:-1]):
            where = where.held_as(step.dtype)
    root.record.add(t, where)


@contextmanager
def plain_meta() -> Iterator[None]:
    """Inside, on this thread, pending tensors compute on meta like plain meta tensors, reading
    nothing (PEFT's DoRA `update_layer` on a loader-built base layer: `dora.defer_norms`)."""
    _plain.depth = getattr(_plain, "depth", 0) + 1
    try:
        yield
    finally:
        _plain.depth -= 1


def materialize(t: torch.Tensor, warn: bool = True) -> int:
    """Give the pending tensor `t` its values, in place; returns the bytes read from the files.
    The first read of a model warns once (`warn=False`: the caller logs its own line).

    A tensor its record no longer backs (resized, or read by another path) just becomes plain."""
    info = t.__dict__.get(KEY)
    if isinstance(info, _Derived):
        read = materialize(info.source, warn) if is_pending(info.source) else 0
        with DisableTorchFunctionSubclass():
            value = None if info.source.is_meta else info.op(info.source)
        _unmark(t)
        if value is not None:
            torch.utils.swap_tensors(t, value)
        return read
    where = info.record.lookup(t) if isinstance(info, _Backing) else None
    if where is None:
        _unmark(t)
        return 0
    if warn and not info.record.read_early:
        logger.warning("rank %s reads `%s` of the model made by `%s` from the files before prepare, as a plain load "
                       "holds it (its other tensors are read the same way when their values are used). %s",
                       _rank(), info.name, info.what, LOCAL_LOADING_HINT)  # fmt: skip
    _unmark(t)
    nbytes = read_in_place(t, where)
    info.record.forget(t)
    info.record.read_early += nbytes
    return nbytes


def materialize_all(module: nn.Module) -> int:
    """Read every pending tensor of `module` (each once, ties included), with no warning of its own
    (the caller logs why); returns the bytes read."""
    return sum(materialize(t, warn=False) for t in [*module.parameters(), *module.buffers()] if is_pending(t))


def read_in_place(t: torch.Tensor, where: Any) -> int:
    """Replace the contents of meta tensor `t` with its checkpoint tensor (cast to `t.dtype`), in
    place: the same Python object, wherever it is held. Returns the bytes read."""
    value = converted(read_whole(where), where, t.dtype)
    real = nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else value
    torch.utils.swap_tensors(t, real)
    return value.numel() * value.element_size()


def _unmark(t: torch.Tensor) -> None:
    t.__dict__.pop(KEY, None)
    t.__class__ = nn.Parameter if isinstance(t, nn.Parameter) else torch.Tensor


def _note_cast(func: Any, args: tuple) -> None:
    """`tensor.data = value` of another dtype (`model.to(dtype)`, LlamaFactory's upcast): the
    record reads the tensor through that dtype, as a plain load's values went through it."""
    descriptor = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") != "__set__" or getattr(descriptor, "__name__", "") != "data" or len(args) < 2:
        return
    target, value = args[0], args[1]
    info = target.__dict__.get(KEY) if is_pending(target) else None
    if isinstance(info, _Backing) and isinstance(value, torch.Tensor):
        info.record.cast(target, value.dtype)


def _reads_nothing(func: Any, args: tuple, kwargs: dict) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: `.data` is derived, views of the values are not
        return getattr(getattr(func, "__self__", None), "__name__", "") not in _VALUE_GETTERS
    if name in _CASTS:
        return _stays_on_meta(args, kwargs)
    return name in _READS_NOTHING or name == "detach"


def _stays_on_meta(args: tuple, kwargs: dict) -> bool:
    """A cast (`to`, `type`, `float`, ...) that names no device but meta, and no tensor to match."""
    targets = [*args[1:], kwargs.get("device"), kwargs.get("other")]
    for target in targets:
        if isinstance(target, torch.Tensor):
            return False
        if isinstance(target, (str, torch.device, int)) and not isinstance(target, bool):
            try:
                if torch.device(target).type != "meta":
                    return False
            except (RuntimeError, TypeError):
                continue  # a dtype string for `.type("torch.FloatTensor")`: not a device
    return True


def _derived(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """`out` of `detach()`, `.data` or a cast of a pending tensor: a pending tensor derived from it."""
    name = getattr(func, "__name__", "")
    source = args[0] if args else None
    derives = name in ("detach", *_CASTS) or (name == "__get__" and getattr(func.__self__, "__name__", "") == "data")
    if not (derives and is_pending(source) and isinstance(out, torch.Tensor) and out is not source and out.is_meta):
        return out
    rest = args[1:]
    out.__class__ = PendingTensor
    out.__dict__[KEY] = _Derived(source, lambda real: func(real, *rest, **kwargs))
    return out


def _rank() -> str:
    import torch.distributed as dist

    return str(dist.get_rank()) if dist.is_available() and dist.is_initialized() else "0"
