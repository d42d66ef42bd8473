"""Every tied parameter in exactly one `fully_shard` group: a unit that holds one of a tie's
parameters takes in every module that holds the others.

Why: FSDP2 refuses a parameter that two groups would manage ("shared with a parameter already
managed by another FSDP group"), or crashes on it later (`_init_sharding_spec_tp`: the second
group finds a DTensor of the first). accelerate's `fsdp2_prepare_model` keeps the input and output
embeddings of a causal LM together, and nothing else: T5 and BART tie four modules (`shared`,
`encoder.embed_tokens`, `decoder.embed_tokens`, `lm_head`), BERT's and RoBERTa's MLM heads tie the
decoder's weight to the word embeddings and its bias to the head's own `bias`. Stock accelerate
stops on all four families, with the loader on or off.

How, against that prior art: as the dtype groups do, the ties are read from the model itself at
the moment a unit is sharded (`named_modules(remove_duplicate=False)`, the same parameter object
under two names), not from `_tied_weights_keys`, so ties made by hand count as well. The unit
grows to the smallest set of modules that holds every holder of each tie it touches, then drops
what an earlier group already manages (accelerate's tail lists the embeddings again after a
policy wrapped them). Growing never moves a parameter out of a group: a holder that an earlier
group already manages while the unit holds the same parameter directly cannot be joined, and that
stops the prepare with both names before `fully_shard` runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


class TieGroupError(RuntimeError):
    """A tied parameter would end up in two `fully_shard` groups."""


def tied_holders(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """For each parameter held under more than one name: (qualified name, holding module) pairs."""
    holders: dict[int, list[tuple[str, nn.Module]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((f"{prefix}.{name}" if prefix else name, module))
    return {key: found for key, found in holders.items() if len(found) > 1}


def with_tied_holders(unit: Sequence[nn.Module], model: nn.Module) -> list[nn.Module]:
    """`unit` (the modules one `fully_shard` call gets) grown by every module that holds a
    parameter tied to one the unit would manage; the outermost modules only, less a listed module
    whose parameters are all ties an earlier group manages. Unchanged where no tie is involved.
    Raises `TieGroupError` where a tie cannot be kept in one group."""
    ties = tied_holders(model)
    grown = list(unit)
    while ties:
        reach = _reachable_parameters(grown)
        pending = [key for key, param in reach.items() if key in ties and not _sharded(param)]
        extra = [m for key in pending for _, m in ties[key] if not _within(m, grown)]
        if not extra:
            break
        grown = _outermost([*grown, *extra])
    grown = [m for m in grown if not _only_sharded_ties(m, ties)]
    _refuse_split_ties(grown, ties)
    return grown


def _sharded(param: nn.Parameter) -> bool:
    """Already an earlier group's: `fully_shard` turns the parameters it manages into DTensors."""
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def _reachable_parameters(unit: Sequence[nn.Module]) -> dict[int, nn.Parameter]:
    """The parameters under the unit that no existing FSDP group's module holds: what
    `fully_shard(unit)` would take."""
    from torch.distributed.fsdp import FSDPModule

    found: dict[int, nn.Parameter] = {}
    stack = list(unit)
    while stack:
        module = stack.pop()
        for param in module._parameters.values():
            if param is not None:
                found[id(param)] = param
        stack.extend(child for child in module.children() if not isinstance(child, FSDPModule))
    return found


def _within(module: nn.Module, unit: Sequence[nn.Module]) -> bool:
    return any(any(module is d for d in m.modules()) for m in unit)


def _outermost(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """`modules` without duplicates and without those inside another of them, in order."""
    kept: list[nn.Module] = []
    for module in modules:
        inside_another = any(m is not module and any(module is d for d in m.modules()) for m in modules)
        if not inside_another and not any(module is k for k in kept):
            kept.append(module)
    return kept


def _only_sharded_ties(module: nn.Module, ties: dict[int, list[tuple[str, nn.Module]]]) -> bool:
    """accelerate's tail lists the embeddings again after a wrap policy grouped them (with the
    tie's other holder): such a module brings nothing left to shard."""
    params = list(module.parameters())
    return bool(params) and all(id(p) in ties and _sharded(p) for p in params)


def _refuse_split_ties(unit: Sequence[nn.Module], ties: dict[int, list[tuple[str, nn.Module]]]) -> None:
    """A tied parameter that an earlier group manages, still held by a module this unit would take."""
    for key, param in _reachable_parameters(unit).items():
        if key in ties and _sharded(param):
            here = [name for name, m in ties[key] if _within(m, unit)]
            there = [name for name, m in ties[key] if not _within(m, unit)] or here[1:]
            raise TieGroupError(
                f"the tied parameters {here[0]} and {there[0]} would be sharded by two fully_shard groups, which "
                "FSDP2 refuses: wrap the modules that hold them in one unit (list both classes, or neither, in "
                "transformer_layer_cls_to_wrap), or untie them before prepare")
