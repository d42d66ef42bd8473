"""What a model holds, by name: the contract rank 0 sends before any tensor data.

A `ModelSpec` lists every parameter and buffer (persistent or not) with its dtype, shape and
every name it is reachable under (tied weights are one tensor with several names). Rank 0
describes its real model; every other rank checks its own meta model against that and rebuilds
it to match, so that all ranks agree on names, dtypes and ties before the first collective that
carries data (a mismatch found later surfaces as a gloo size mismatch or an NCCL hang).

Names leave out the segments of torch's `checkpoint_wrapper` (`_checkpoint_wrapped_module`), as
its `state_dict()` does: a framework may wrap layers for checkpointing between rank 0's
description and `fully_shard` (axolotl's `fsdp2_prepare_model` does, inside the sharding step),
and the sharded model is still the model rank 0 described. `tensor_at` and `owner` find a
tensor by such a name through the wrappers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

MAX_NAMES_IN_ERROR = 20
WRAPPER = "_checkpoint_wrapped_module"  # torch's checkpoint_wrapper holds the wrapped module under it


def canonical_name(name: str) -> str:
    """`name` without checkpoint-wrapper segments: the name a checkpoint and `state_dict()` use."""
    return ".".join(part for part in name.split(".") if part != WRAPPER)


def unwrapped(module: nn.Module) -> nn.Module:
    """The module inside any checkpoint wrappers around `module` (itself when there are none)."""
    while WRAPPER in module._modules:
        module = module._modules[WRAPPER]
    return module


def owner(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    """(the module that registers the tensor at `fqn`, its attribute name), through wrappers:
    `get_submodule` reaches past a wrapper (it forwards attributes), but the tensor is registered
    on the module inside it."""
    module_name, _, attr = fqn.rpartition(".")
    return unwrapped(model.get_submodule(module_name)), attr


def tensor_at(model: nn.Module, fqn: str, is_param: bool) -> torch.Tensor:
    module, attr = owner(model, fqn)
    return (module._parameters if is_param else module._buffers)[attr]


def named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter, then every buffer, each once, by canonical name."""
    return _canonical([*model.named_parameters(), *model.named_buffers()])


@dataclass(frozen=True)
class TensorSpec:
    names: tuple[str, ...]  # every FQN of this tensor; names[0] is the one `named_parameters()` yields
    dtype: torch.dtype
    shape: tuple[int, ...]
    is_param: bool
    requires_grad: bool = False

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class ModelSpec:
    tensors: tuple[TensorSpec, ...]  # sorted by name: the order every rank sends and receives in

    def by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _aliases(named: list[tuple[str, torch.Tensor]]) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """Group (name, tensor) pairs by tensor identity, in first-seen order."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, t in named:
        groups.setdefault(id(t), ([], t))[0].append(name)
    return [(tuple(names), t) for names, t in groups.values()]


def _canonical(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    return [(canonical_name(n), t) for n, t in named]


def describe(model: nn.Module) -> ModelSpec:
    """Every parameter and buffer of `model` with all its names; no data is read."""
    tensors = [
        TensorSpec(names, p.dtype, tuple(p.shape), True, p.requires_grad)
        for names, p in _aliases(_canonical(model.named_parameters(remove_duplicate=False)))
    ]
    tensors += [
        TensorSpec(names, b.dtype, tuple(b.shape), False)
        for names, b in _aliases(_canonical(model.named_buffers(remove_duplicate=False)))
    ]
    return ModelSpec(tuple(sorted(tensors, key=lambda t: t.name)))


def _short(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMES_IN_ERROR])
    return shown + (f", ... ({len(names) - MAX_NAMES_IN_ERROR} more)" if len(names) > MAX_NAMES_IN_ERROR else "")


def mismatch(
    expected: ModelSpec, actual: ModelSpec, *, what: str, check_dtype: bool = False, check_ties: bool = True
) -> str | None:
    """Describe how `actual` differs from `expected` by name, shape, ties (and dtype), or None.

    With `check_dtype`, a floating dtype may differ (it is cast on load, e.g. a bf16 checkpoint into
    fp32 master weights); any other dtype must be equal (int64/bool buffers are never cast).
    """
    exp = {n: t for t in expected.tensors for n in t.names}
    act = {n: t for t in actual.tensors for n in t.names}
    problems = []
    missing = sorted(set(act) - set(exp))
    unexpected = sorted(set(exp) - set(act))
    if missing:
        problems.append(f"missing from the source (rank 0): {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected in the source (not in the model): {_short(unexpected)}")
    common = sorted(set(exp) & set(act))
    shapes = [f"{n} {list(exp[n].shape)} vs {list(act[n].shape)}" for n in common if exp[n].shape != act[n].shape]
    if shapes:
        problems.append(f"shape differs (source vs model): {_short(shapes)}")
    kinds = [n for n in common if exp[n].is_param != act[n].is_param]
    if kinds:
        problems.append(f"parameter on one side, buffer on the other: {_short(kinds)}")
    ties = sorted({f"{exp[n].names} vs {act[n].names}" for n in common if set(exp[n].names) != set(act[n].names)})
    if ties and check_ties:
        problems.append(f"tied differently (source vs model): {_short(ties)}")
    if check_dtype:
        dtypes = [
            f"{n} {exp[n].dtype} -> {act[n].dtype}"
            for n in common
            if exp[n].dtype != act[n].dtype and not (exp[n].dtype.is_floating_point and act[n].dtype.is_floating_point)
        ]
        if dtypes:
            problems.append(f"non-float dtype differs (would need a cast): {_short(dtypes)}")
    if not problems:
        return None
    return f"{what}: " + "; ".join(problems)


def _set(model: nn.Module, fqn: str, value: torch.Tensor, *, is_param: bool) -> None:
    module, attr = owner(model, fqn)
    (module._parameters if is_param else module._buffers)[attr] = value


def rebuild_on_meta(model: nn.Module, spec: ModelSpec) -> None:
    """Replace every parameter and buffer of `model` by a meta tensor shaped, typed and tied as in
    `spec` (the caller has checked the names match).

    Why not `model.to("meta")`: it makes a new Parameter per module, silently untying shared
    weights, and `tie_weights()` re-ties from the config, which need not be what rank 0 did. Here a
    tied group becomes one Parameter under all its names, exactly as on rank 0.
    """
    for t in spec.tensors:
        value = torch.empty(t.shape, dtype=t.dtype, device="meta")
        if t.is_param:
            value = nn.Parameter(value, requires_grad=t.requires_grad)
        for name in t.names:
            _set(model, name, value, is_param=t.is_param)


def meta_tensor_names(model: nn.Module) -> list[str]:
    """Names of parameters and buffers still on the meta device (DTensors: their local shard)."""
    names = []
    for name, t in named_tensors(model):
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.is_meta:
            names.append(name)
    return names


def retie(model: nn.Module, spec: ModelSpec) -> None:
    """Point every alias of a tied tensor back at the object under its first name (a no-op when
    the ties held, as they do for FSDP's DTensor parameters)."""
    for t in spec.tensors:
        first = tensor_at(model, t.name, t.is_param)
        for name in t.names[1:]:
            current = tensor_at(model, name, t.is_param)
            if current is not first:
                _set(model, name, first, is_param=t.is_param)
