"""The guard on a loader-built model between `from_pretrained` and `prepare`.

A model the loader built holds meta tensors until `prepare` fills it (`load_into_sharded`). Used
before that, it would compute on meta and answer with meta tensors, without a word. So where this
rank's checkpoint record backs a meta tensor, the tensor reads itself from the files when its
values are used (`pending.py`), and the forward of the model, or of any part holding a meta
tensor, and its `state_dict()` read all of them (one warning: the load then behaves as a plain
load on this rank); elsewhere the forward raises, saying to prepare the model first or to load it
inside `local_loading()`. `load_into_sharded` releases the guard as it starts filling the model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch import nn

from fsdp_offload_cfg import model_state
from fsdp_offload_cfg._logging import counted, get_logger
from fsdp_offload_cfg._sizes import show_size
from fsdp_offload_cfg.loading import dora, pending
from fsdp_offload_cfg.loading.checkpoint import record_of
from fsdp_offload_cfg.loading.local import LOCAL_LOADING_HINT

logger = get_logger("fsdp_offload_cfg.loading")

# > 0 while a library reads `state_dict()` of a loader-built model for its keys and shapes only
# (PEFT matching a saved adapter's keys): the state_dict guard must not read the model whole then.
_keys_only_depth = 0


def guard_until_prepared(model: nn.Module, what: str) -> None:
    """Guard the use of `model` before `prepare` while it holds meta tensors (a model loaded but
    never prepared would otherwise return meta outputs without a word):

    - each meta tensor this rank's checkpoint record backs (rank 0 under "broadcast", every rank
      that reads the files under "auto" and "sharded") reads itself from the files when its
      values are used (`pending.py`), and the first forward or `state_dict()` reads all of them:
      a load made on this rank alone (an export, an evaluation on the main process) then behaves
      like a plain load;
    - elsewhere the forward of the model, and of every part that holds a meta tensor
      (`model.model(...)`, `model.lm_head(...)`), raises, saying to prepare it first.

    The hooks hold no reference to the model (only its call and the part's name), so that a
    `copy.deepcopy` of the model is guarded as itself, not through the original."""
    record = record_of(model)
    if record is not None:
        pending.mark(model, record, what)
    for name, module in model.named_modules():  # the model, and each part that holds a meta tensor itself
        if _holds_meta(module, recurse=module is model):
            hook = functools.partial(_fill_or_refuse, what=what, part=name)
            model_state.put(module, "meta_guard", module.register_forward_pre_hook(hook))
    if model_state.get(model, "meta_guard") is not None and record is not None:
        hook = functools.partial(_fill_unless_keys_only, what=what)
        model_state.put(model, "state_guard", model.register_state_dict_pre_hook(hook))


def _holds_meta(module: nn.Module, recurse: bool) -> bool:
    return any(t.is_meta for t in [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)])


# What a floor above can tell about a model left on meta that this one cannot see: the registry
# names the patches a framework replaced after `patch()` (`registry.displaced_said`), set when it
# installs a session; nothing until then.
left_on_meta_because: Callable[[], str] = str


def _fill_or_refuse(module: nn.Module, *_: Any, what: str, part: str = "") -> None:
    """Before `module` runs: read its pending tensors (and compute DoRA magnitudes owed), or raise
    naming the tensors no file backs on this rank."""
    if not _holds_meta(module, recurse=True) or _fill_from_files(module, what):
        return
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    shown = f"its part `{part}`, " if part else ""
    raise RuntimeError(
        f"fsdp_offload_cfg: the model made by `{what}` is still on the meta device on rank {dist.get_rank()} "
        f"({shown}{counted(len(left), 'tensor')}, e.g. {left[0]}): the loader fills it in `accelerator.prepare(model)` "
        f"(or `fsdp2_prepare_model`). Prepare it before calling it. {LOCAL_LOADING_HINT}{left_on_meta_because()}"
    )


def _fill_unless_keys_only(module: nn.Module, *args: Any, what: str) -> None:
    if not _keys_only_depth:
        _fill_or_refuse(module, *args, what=what)


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


def _fill_from_files(module: nn.Module, what: str) -> bool:
    """Read every meta tensor of `module` from the files on this rank if each is pending (or a
    DoRA magnitude owed from its base); True when nothing is left on meta."""
    tensors = [*module.parameters(), *module.buffers()]
    computed = dora.pending_names(module)  # DoRA magnitudes: computed from the base once it is read
    owed = {id(module.get_parameter(n)) for n in computed}
    if any(t.is_meta and not pending.is_pending(t) and id(t) not in owed for t in tensors):
        return False
    nbytes = pending.materialize_all(module)
    dora.fill_pending(module, computed, rank=0, world_size=1)
    if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        return False  # pending but no longer backed (resized on meta): nothing can fill it here
    release_meta_guards(module, forward_only=True)  # a state_dict hook cannot remove itself while it runs
    if nbytes:
        logger.warning("rank %d uses the model made by `%s` before prepare: it read %s from the files (as a plain "
                       "load holds it). %s", dist.get_rank(), what, show_size(nbytes), LOCAL_LOADING_HINT)  # fmt: skip
    return True


def release_meta_guards(model: nn.Module, forward_only: bool = False) -> None:
    """Called by `load_into_sharded`: the model is being filled, its forward may run again, and
    its pending tensors are plain meta tensors again (`prepare` reads them, not their first use)."""
    if not forward_only:
        pending.release(model)
    for module in model.modules():
        for field in ("meta_guard",) if forward_only else ("meta_guard", "state_guard"):
            handle = model_state.take(module, field)
            if handle is not None:
                handle.remove()
