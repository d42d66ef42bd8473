"""What this plugin keeps on a module: one record, under one attribute.

As `fully_shard` keeps one state object per module, every piece of state the loader, the
offload and the budget attach to a model lives in one `ModuleState` under `ATTR`, so a reader
finds all of it in one place and a module whose record is empty carries nothing of ours: each
field is cleared where its use ends (`take`), and the record goes with its last field. What a
field holds, on which module, and until when, is written beside it.

Reads of the loader's fields (`found`) also look through a wrapper that forwards attribute
reads to the model inside it (PEFT's `PeftModel` to its base model), as reading the attribute
itself did: a loaded model wrapped after the load is still the loader's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

ATTR = "_fsdp_offload_cfg"


@dataclass
class ModuleState:
    # the loader (`loading/`), on the model it built, until `load_into_sharded` has filled it:
    loader_source: bool = False  # built on meta by the loader: prepare fills it
    load_call: Any = None  # its `pairing.LoadCall`: pairs this load with rank 0's of the same call
    checkpoint: Any = None  # its `checkpoint.CheckpointRecord`: which file tensor fills which tensor
    meta_guard: Any = None  # forward pre-hook: a forward before prepare fills the model or refuses
    state_guard: Any = None  # state_dict pre-hook: the same for `state_dict()`
    # on a DoRA layer built on meta, until its magnitude is computed or loaded (`loading/dora.py`):
    dora_pending: Any = None
    # on the model the offload hooks, until its handle is removed (`offload/api.py`):
    offload: Any = None
    # on a model accelerate checkpoints, from its prepare until `unpatch()`: the forward pre-hook
    # that turns the KV cache off in training forwards (`training_cache.py`):
    cache_off: Any = None
    # on a sharded vision-language model, from its prepare until `unpatch()`: the forward pre-hook
    # (and its state) that runs the vision tower on a rank whose batch has no images (`vision_sync.py`):
    vision_sync: Any = None
    # on the model a budget plans, from the first plan until the planner is removed (`budget.py`):
    planner: Any = None
    # on a model whose forward TRL's redirection swaps for its distillation loss, for the length
    # of that call (`integrations/trl.py`): the loss's head (`estimate.heads.ChunkedDistillation`),
    # which a budget planning inside the call counts in place of the model's own head
    loss_head: Any = None
    # on each layer's checkpoint wrapper a budget installs, for as long as the wrapper exists:
    checkpoint_fn: Any = None  # the wrapper's own checkpoint function, while it passes through
    budget_wrapper: bool = False  # made by the budget (not by the script): the budget's removal unwraps it


def state_of(module: nn.Module) -> ModuleState | None:
    """The module's own record, if it has one."""
    return module.__dict__.get(ATTR)


def get(module: nn.Module, field: str) -> Any:
    """One field of the module's own record (None without one)."""
    state = state_of(module)
    return None if state is None else getattr(state, field)


def found(module: nn.Module, field: str) -> Any:
    """A field of the module's own record, else of the record a wrapper forwards reads to."""
    value = get(module, field)
    if value is not None and value is not False:
        return value
    try:
        inner = type(module).__getattr__(module, ATTR)  # PEFT's forwarding to its base model, if any
    except AttributeError:
        return None
    return getattr(inner, field) if isinstance(inner, ModuleState) else None


def put(module: nn.Module, field: str, value: Any) -> None:
    """Set a field of the module's own record, making the record if it has none."""
    state = module.__dict__.setdefault(ATTR, ModuleState())
    setattr(state, field, value)


def take(module: nn.Module, field: str) -> Any:
    """Clear a field of the module's own record and return what it held; a record left empty goes."""
    state = state_of(module)
    if state is None:
        return None
    value = getattr(state, field)
    setattr(state, field, ModuleState.__dataclass_fields__[field].default)
    if state == ModuleState():
        del module.__dict__[ATTR]
    return value


__all__ = ["ATTR", "ModuleState", "found", "get", "put", "state_of", "take"]
