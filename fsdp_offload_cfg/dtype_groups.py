"""One original dtype per `fully_shard` group: a module whose trainable parameters differ in dtype
from the rest of its wrap unit gets its own group first.

Why: FSDP2 packs a group's parameters into one all-gather and one reduce-scatter, so it asserts,
at the first forward (`_init_mp_dtypes`), that the group's trainable parameters share one
original dtype. transformers 5.24 keeps the MoE router gate in float32 in bf16 models of 24
families (`_keep_in_fp32_modules_strict`: DeepSeek-V2/V3, GLM-4.5 MoE, Kimi, ...). A decoder
layer wrapped as one unit, as accelerate's `TRANSFORMER_BASED_WRAP` and TRL's `prepare_fsdp` do,
then holds a bf16 body and a float32 gate, and training stops with "FSDP expects uniform original
parameter dtype". transformers' own FSDP path (`distributed/mixin.py`) gives the modules of its
dtype plan their own group, deepest first; accelerate's and TRL's wrapping do not.

How, against that prior art: the dtypes are read from the parameters themselves at the moment a
unit is sharded, not from a model's dtype plan, so a module a user kept in float32 by hand is
found too, and accelerate's fp32 upcast under mixed precision (after which nothing differs) has
already happened. On `meta` the parameters carry rank 0's dtypes (the loader rebuilds every rank
from rank 0's spec), so meta models are split exactly like loaded ones, on every rank alike.
Only trainable parameters count, as in FSDP's own check: a frozen float32 module in a bf16 unit
(or bf16 base weights around fp32 LoRA adapters under mixed precision) needs no group of its own,
and giving every LoRA layer its own group would multiply the collectives per layer.

`shard_groups.fsdp2_groups(model)` applies this rule to each `fully_shard` call of a prepare:
for each unit it shards the largest sub-modules whose trainable parameters are all of a dtype
other than the unit's dominant one (by element count), then the unit itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

import torch
from torch import nn


class DtypeGroupError(RuntimeError):
    """A parameter of another dtype sits directly on a module that also holds the unit's dtype:
    no module boundary separates them, so no `fully_shard` group can."""


def odd_dtype_modules(unit: Sequence[nn.Module], ignored: set[int] = frozenset()) -> list[nn.Module]:
    """The largest sub-modules of `unit` (the modules one `fully_shard` call would manage) whose
    trainable parameters all have a dtype other than the unit's dominant one, in tree order.

    Parameters already in a group of their own (under an `FSDPModule`) and `ignored` ones (ids)
    are not the unit's. Raises `DtypeGroupError` where an odd-dtype parameter cannot be split off.
    """
    from torch.distributed.fsdp import FSDPModule

    def trainable(module: nn.Module, recurse: bool) -> list[tuple[str, nn.Parameter]]:
        named = module.named_parameters(recurse=False) if not recurse else _unit_parameters(module, FSDPModule)
        return [(n, p) for n, p in named if p.requires_grad and id(p) not in ignored]

    numel: Counter[torch.dtype] = Counter()
    for module in unit:
        for _, p in trainable(module, recurse=True):
            numel[p.dtype] += p.numel()
    if len(numel) < 2:
        return []
    main = numel.most_common(1)[0][0]
    picked: list[nn.Module] = []

    def visit(module: nn.Module, path: str, is_unit: bool) -> None:
        dtypes = {p.dtype for _, p in trainable(module, recurse=True)}
        if not is_unit and dtypes and main not in dtypes and len(dtypes) == 1:
            picked.append(module)
            return
        stuck = [n for n, p in trainable(module, recurse=False) if p.dtype != main]
        if stuck and len(dtypes) > 1:
            raise DtypeGroupError(
                f"{type(module).__name__} ({path or 'the unit'}) holds trainable parameters of dtype "
                f"{_dtype_names(dtypes)} directly ({', '.join(stuck)} differ from the unit's {_name(main)}); "
                "FSDP2 needs one dtype per fully_shard group and no sub-module separates them. Cast them to "
                f"{_name(main)}, freeze them, or use mixed_precision (bf16/fp16), under which accelerate keeps "
                "every trainable parameter in float32"
            )
        for name, child in module.named_children():
            if not isinstance(child, FSDPModule):
                visit(child, f"{path}.{name}" if path else name, False)

    for module in unit:
        visit(module, "", len(unit) == 1)
    return picked


def _unit_parameters(module: nn.Module, fsdp_module: type) -> Iterator[tuple[str, nn.Parameter]]:
    """`module`'s parameters, minus those under a sub-module that is already its own FSDP group."""
    seen: set[int] = set()
    stack = [("", module)]
    while stack:
        prefix, m = stack.pop()
        for name, p in m.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield prefix + name, p
        for name, child in reversed(list(m.named_children())):
            if not isinstance(child, fsdp_module):
                stack.append((f"{prefix}{name}.", child))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_names(dtypes: set[torch.dtype]) -> str:
    return " and ".join(sorted(_name(d) for d in dtypes))
