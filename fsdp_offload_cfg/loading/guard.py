"""The guard on a loader-built model between `from_pretrained` and `prepare`.

A model the loader built holds meta tensors until `prepare` fills it (`load_into_sharded`). Used
before that, it would compute on meta and answer with meta tensors, without a word. So its
forward, and that of every part holding a meta tensor, and its `state_dict()` are guarded: where
this rank's checkpoint record backs every meta tensor, the first use reads the model whole from
the files (one warning: the load then behaves as a plain load on this rank); elsewhere the use
raises, saying to prepare the model first or to load it inside `local_loading()`.
`load_into_sharded` releases the guard as it starts filling the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch import nn

from fsdp_offload_cfg import model_state
from fsdp_offload_cfg._logging import get_logger
from fsdp_offload_cfg.loading import dora
from fsdp_offload_cfg.loading.checkpoint import materialize_from_files, record_of

logger = get_logger("fsdp_offload_cfg.loading")

# > 0 while a library reads `state_dict()` of a loader-built model for its keys and shapes only
# (PEFT matching a saved adapter's keys): the state_dict guard must not read the model whole then.
_keys_only_depth = 0
LOCAL_LOADING_HINT = (
    "If only some ranks load this model (an eval copy, a teacher or reference model that is never passed "
    "to prepare), load it inside `with fsdp_offload_cfg.local_loading():` for a full copy on the ranks "
    "that call it."
)


def guard_until_prepared(model: nn.Module, what: str) -> None:
    """Guard the use of `model` before `prepare` while it holds meta tensors (a model loaded but
    never prepared would otherwise return meta outputs without a word):

    - where this rank's checkpoint record backs every meta tensor (rank 0 under "broadcast", every
      rank under "sharded"), the first forward or `state_dict()` reads the model whole from the
      files on this rank, with one warning: a load made on this rank alone (an export, an
      evaluation on the main process) then behaves like a plain load;
    - elsewhere the forward of the model, and of every part that holds a meta tensor
      (`model.model(...)`, `model.lm_head(...)`), raises, saying to prepare it first."""
    rank = dist.get_rank()
    names = {id(m): n for n, m in model.named_modules()}

    def fill_or_refuse(module: nn.Module, *_: Any) -> None:
        if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]) or _fill_from_files(model, what, rank):
            return
        left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
        if left:
            part = f"its part `{names.get(id(module), type(module).__name__)}`, " if module is not model else ""
            raise RuntimeError(
                f"fsdp_offload_cfg: the model made by `{what}` is still on the meta device on rank {rank} "
                f"({part}{len(left)} tensors, e.g. {left[0]}): the loader fills it in `accelerator.prepare(model)` "
                f"(or `fsdp2_prepare_model`). Prepare it before calling it. {LOCAL_LOADING_HINT}"
            )

    def holds_meta(module: nn.Module, recurse: bool) -> bool:
        return any(t.is_meta for t in [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)])

    for module in model.modules():  # the model, and each part that holds a meta tensor itself
        if holds_meta(module, recurse=module is model):
            model_state.put(module, "meta_guard", module.register_forward_pre_hook(fill_or_refuse))
    def fill_unless_keys_only(module: nn.Module, *args: Any) -> None:
        if not _keys_only_depth:
            fill_or_refuse(module, *args)

    if model_state.get(model, "meta_guard") is not None and record_of(model) is not None:
        model_state.put(model, "state_guard", model.register_state_dict_pre_hook(fill_unless_keys_only))


@contextmanager
def state_dict_keys_only() -> Iterator[None]:
    """Inside, `state_dict()` of a loader-built model returns its meta tensors as they are: for a
    caller that only matches keys and shapes (PEFT loading a saved adapter calls it on the whole
    model), where the guard would otherwise read the model whole from the files on every rank."""
    global _keys_only_depth
    _keys_only_depth += 1
    try:
        yield
    finally:
        _keys_only_depth -= 1


def _fill_from_files(model: nn.Module, what: str, rank: int) -> bool:
    """Read `model` whole from the files on this rank if its record backs every meta tensor;
    True when nothing is left on meta."""
    record = record_of(model)
    tensors = [*model.parameters(), *model.buffers()]
    computed = dora.pending_names(model)  # DoRA magnitudes: computed from the base once it is read
    owed = {id(model.get_parameter(n)) for n in computed}
    if record is None or any(t.is_meta and record.lookup(t) is None and id(t) not in owed for t in tensors):
        return False
    nbytes = materialize_from_files(model)
    dora.fill_pending(model, computed, rank=0, world_size=1)
    release_meta_guards(model, forward_only=True)  # a state_dict hook cannot remove itself while it runs
    logger.warning("rank %d uses the model made by `%s` before prepare: it read it whole from the files "
                   "(%.2f GiB, as a plain load). %s", rank, what, nbytes / 2**30, LOCAL_LOADING_HINT)  # fmt: skip
    return True


def release_meta_guards(model: nn.Module, forward_only: bool = False) -> None:
    """Called by `load_into_sharded`: the model is being filled, its forward may run again."""
    for module in model.modules():
        for field in ("meta_guard",) if forward_only else ("meta_guard", "state_guard"):
            handle = model_state.take(module, field)
            if handle is not None:
                handle.remove()
