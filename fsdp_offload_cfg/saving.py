"""Writing the trained model of a sharded run as `from_pretrained` reads it.

Two stock paths wrote nothing, or stopped, at the end of a run that had trained fine:

- `model.save_pretrained(dir)` (transformers' and PEFT's) of a model accelerate sharded with
  FSDP2: transformers 5 gathers sharded weights for saving only for a model it sharded itself
  (`distributed_config`), PEFT before 0.22 never; both handed `DTensor`s to safetensors, which
  stopped on every rank with "Attempted to access the data pointer on an invalid python storage"
  (transformers 4.x gathered each weight itself, on every rank; PEFT 0.22 gathers what it writes,
  on every rank, each rank what it chose).
- `trainer.save_model(dir)` under `SHARDED_STATE_DICT`, accelerate's default for FSDP2: it wrote
  nothing at all, silently (transformers #30491).

Both now write what accelerate's recipe (`state_dict=accelerator.get_state_dict(model)`) writes,
on rank 0, without its cost: the recipe keeps the whole gathered model on rank 0's host (an 8B
model, 15 GiB, where training held 1/8 of it per rank). A transformers model is written as each
weight is gathered, one at a time (`streamed_save`); a PEFT model gathers only what PEFT writes of
it, its adapters (`gathered_peft_state_dict`), where the recipe gathered the frozen base too: a
70B base (140 GB on rank 0's host) for 100 MB of adapters. The Trainer's own saves under
`FULL_STATE_DICT` (checkpoints included) take the same two paths (`saved_lightly`), and
`accelerator.save_model(model, dir)` the first (`build_accelerator_save_model`). The gathers
are collectives where stock made none, so every such save first agrees through the store that
all ranks are in the call (`ranks.every_rank_comes`): the DDP habit of saving on rank 0 only then
says so on that rank instead of leaving it in the gather until the watchdog kills the job.

The Trainer's own checkpoint saves under a sharded state dict get their folder on every rank
before the Trainer names the best checkpoint (`build_checkpoint_folder`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from fsdp_offload_cfg._logging import get_logger, is_rank0
from fsdp_offload_cfg.compat.saving import save_model_keeps, writes_safetensors
from fsdp_offload_cfg.ranks import distributed_ready, every_rank_comes
from fsdp_offload_cfg.streamed_save import (
    gathered_whole,
    sharded_by_fully_shard,
    streamed_save,
    streamed_state_dict_save,
)

logger = get_logger("fsdp_offload_cfg.saving")


def build_save_pretrained(original: Callable[..., Any], cfg: Any) -> Callable[..., Any]:
    """`save_pretrained(dir)` of a model accelerate sharded writes the whole model, on rank 0.

    A call with a `state_dict` (accelerate's recipe, `state_dict=accelerator.get_state_dict(model)`,
    and the Trainer's own saves) stays as it is. Without one the ranks gather it here and only
    rank 0 writes, whatever `is_main_process` each passed. A call some ranks never make raises on
    the ranks that made it, after the process-group timeout (the wait is logged each minute).
    `distributed_checkpoint=True`, transformers' save for a model it sharded itself, raises on
    every rank before anything is written, naming what works for this model instead.
    PEFT's `save_pretrained` takes the state dict through `**kwargs`; transformers' by name."""
    signature = inspect.signature(original)
    by_name = "state_dict" in signature.parameters
    extras = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), "kwargs")

    @functools.wraps(original)
    def save_pretrained(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = signature.bind(self, *args, **kwargs)
        given, extra = call.arguments, call.arguments.get(extras, {})
        if (given.get("state_dict", extra.get("state_dict")) is not None
                or getattr(self, "_hf_peft_config_loaded", False) or not sharded_by_fully_shard(self)
                or not distributed_ready()):
            return original(self, *args, **kwargs)
        if given.get("distributed_checkpoint"):
            raise ValueError(_NO_DISTRIBUTED_CHECKPOINT.format(model=type(self).__name__))
        _every_rank_or_raise(f"{type(self).__name__}.save_pretrained({given['save_directory']!r})",
                             "is_main_process=accelerator.is_main_process (only rank 0 writes), or use "
                             "accelerator.save_model(model, dir)")  # fmt: skip
        given["is_main_process"] = given.get("is_main_process", True) and dist.get_rank() == 0
        stream = streamed_save(self, writes_safetensors(given.get("safe_serialization")))
        with stream or contextlib.nullcontext():
            state_dict = stream.state_dict if stream is not None else gathered_state_dict(
                self, **{k: given[k] for k in _PEFT_SELECTION if k in given})  # fmt: skip
            if by_name:
                given["state_dict"] = state_dict
            else:
                given[extras] = {**extra, "state_dict": state_dict}
            return original(*call.args, **call.kwargs)

    return save_pretrained


# transformers' `distributed_checkpoint=True` (5.16 and 5.24 have it) writes each rank's slices for a model it
# sharded itself (`distributed_config`); for one accelerate sharded it stopped with "requires an
# FSDP- or TP-sharded model", having written config.json already. Said before anything is written,
# on every rank alike (no collective is involved), with the two ways that do work.
_NO_DISTRIBUTED_CHECKPOINT = (
    "{model}.save_pretrained(..., distributed_checkpoint=True) is transformers' sharded save for a model transformers "
    "sharded itself (from_pretrained(distributed_config=...)); this one was sharded by accelerate (FSDP2), and "
    "transformers cannot save it that way. For a sharded checkpoint without gathering the model, use "
    "accelerator.save_state(dir) with fsdp_state_dict_type: SHARDED_STATE_DICT (`accelerate merge-weights` makes one "
    "model of it later); for a model from_pretrained reads, call save_pretrained(dir) on every rank without "
    "distributed_checkpoint (the weights are gathered and rank 0 writes them). Nothing was written."
)


def build_accelerator_save_model(original: Callable[..., Any], cfg: Any) -> Callable[..., Any]:
    """`accelerator.save_model(model, dir)` of a model sharded by `fully_shard` writes the files
    stock writes, byte for byte, with rank 0 holding one gathered weight at a time.

    Stock gathers the whole state dict onto rank 0's host first (`get_state_dict`), then splits
    it into files of `max_shard_size`: the end of a run that trained in 1/8 of the model per rank
    needed all of it on one host. Here accelerate still decides the files (the split, the names,
    the index, the folder's cleaning) over stand-ins of the sharded weights (`streamed_save`),
    and each weight is gathered as its bytes are written, when accelerate's save returns. A call
    some ranks never make (stock: they wait in the gather until the watchdog kills the job)
    raises on the ranks that made it, naming the others, after the process-group timeout.
    `safe_serialization=False` (`torch.save`) and any other model are saved as before."""

    @functools.wraps(original)
    def save_model(self: Any, model: torch.nn.Module, save_directory: Any, max_shard_size: Any = "10GB",
                   safe_serialization: bool = True) -> Any:  # fmt: skip
        unwrapped = self.unwrap_model(model)
        if not safe_serialization or not sharded_by_fully_shard(unwrapped) or not distributed_ready():
            return original(self, model, save_directory, max_shard_size, safe_serialization)
        _every_rank_or_raise(f"accelerator.save_model(model, {os.fspath(save_directory)!r})",
                             "the same arguments (only rank 0 writes)")  # fmt: skip
        stream = streamed_state_dict_save(unwrapped)
        if stream is None:
            return original(self, model, save_directory, max_shard_size, safe_serialization)
        answer = lambda model, unwrap=True: stream.state_dict  # noqa: E731 - what stock's save_model asks for
        with _get_state_dict_answered(self, answer), stream, save_model_keeps(stream.stand_ins):
            return original(self, model, save_directory, max_shard_size, safe_serialization)

    return save_model


@contextlib.contextmanager
def _get_state_dict_answered(accelerator: Any, get_state_dict: Callable[..., Any]) -> Iterator[None]:
    """Within, `accelerator.get_state_dict` is `get_state_dict`: this accelerator only, this call only."""
    own = vars(accelerator).get("get_state_dict")  # an instance attribute someone set before, restored after
    accelerator.get_state_dict = get_state_dict
    try:
        yield
    finally:
        if own is None:
            del accelerator.get_state_dict
        else:
            accelerator.get_state_dict = own


def build_save_final_model(original: Callable[..., Any], cfg: Any) -> Callable[..., Any]:
    """`trainer.save_model(dir)` under a sharded state dict writes what `FULL_STATE_DICT` writes.

    `trl sft`, `trl dpo` and LlamaFactory end with `trainer.save_model(output_dir)`: with FSDP2's
    defaults and `save_strategy: "no"` the run kept no model at all. transformers' FSDP guide has
    users switch the plugin to `FULL_STATE_DICT` by hand first; this makes that save for the call
    and leaves the plugin's type, so checkpoints stay sharded. The Trainer's own calls
    (checkpoints) are left as they are, and so is a final model the user asked to keep sharded
    (axolotl's `final_state_dict_type`). A call made on some ranks only writes nothing, as
    before, and warns.

    Every save of a model sharded by `fully_shard` (this one, and the Trainer's own under
    `FULL_STATE_DICT`, checkpoints included) gathers no more than it writes at once
    (`saved_lightly`): a PEFT model's adapters alone, a transformers model one weight at a time."""

    @functools.wraps(original)
    def save_model(self: Any, output_dir: str | None = None, _internal_call: bool = False) -> Any:
        if not self.is_fsdp_enabled or not distributed_ready():
            return original(self, output_dir, _internal_call)
        if _internal_call or not _state_dict_sharded(self) or _final_model_sharded_by_choice(self):
            with saved_lightly(self.accelerator, _streams(self)):
                return original(self, output_dir, _internal_call)
        target = self.args.output_dir if output_dir is None else output_dir
        meeting = every_rank_comes("trainer-save-model", f"call Trainer.save_model({target!r})")
        if not meeting.everyone:
            logger.warning("Trainer.save_model(%r) wrote no model: with fsdp_state_dict_type SHARDED_STATE_DICT every "
                           "rank must call it, to gather the model, and %s. Call trainer.save_model() on every rank.",
                           target, meeting.why)  # fmt: skip
        else:
            if is_rank0():
                logger.info("Trainer.save_model(%r): the state dict is sharded (fsdp_state_dict_type "
                            "SHARDED_STATE_DICT, accelerate's default under FSDP2), where transformers writes no "
                            "model; writing it as from_pretrained reads it, gathered one weight at a time "
                            "(checkpoints stay sharded)", target)  # fmt: skip
            # the files are written as the scope closes, before the Hub push below
            with saved_lightly(self.accelerator, _streams(self)):
                state_dict = self.accelerator.get_state_dict(self.model)  # every rank: a collective
                if self.args.should_save or getattr(self, "is_distributed_loading_by_transformers", False):
                    self._save(target, state_dict=state_dict)  # as stock's FULL_STATE_DICT branch: the writer only
        return original(self, output_dir, _internal_call)  # writes nothing more; pushes to the Hub if asked

    return save_model


@contextlib.contextmanager
def saved_lightly(accelerator: Any, stream: bool = True) -> Iterator[None]:
    """Within a Trainer's save, `accelerator.get_state_dict` of a model sharded by `fully_shard`
    gathers no more than the save writes at once: a PEFT model's adapters alone
    (`gathered_peft_state_dict`), a transformers model one weight at a time as its files are
    written when the save returns (`streamed_save`), any other model whole, as before. The
    Trainer gathers through it under `FULL_STATE_DICT` at every checkpoint and for the final
    model (LlamaFactory's FSDP configs ask for `FULL_STATE_DICT`). Scoped to this accelerator and
    this call: anyone else asking for the state dict gets the whole model."""
    stock = accelerator.get_state_dict

    with contextlib.ExitStack() as streams:  # the streamed saves write their files as the save returns

        def get_state_dict(model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
            unwrapped = accelerator.unwrap_model(model)
            adapters = gathered_peft_state_dict(unwrapped)
            if adapters is not None:
                return adapters
            save = streamed_save(unwrapped, stream)
            return stock(model, unwrap) if save is None else streams.enter_context(save).state_dict

        with _get_state_dict_answered(accelerator, get_state_dict):
            yield


def build_checkpoint_folder(original: Callable[..., Any], cfg: Any) -> Callable[..., Any]:
    """`Trainer.save_model` makes the checkpoint's folder on every rank under FSDP.

    With a sharded state dict it writes nothing there: the folder appears when
    `_save_optimizer_and_scheduler` writes the shards, after `_save_checkpoint` has asked
    `os.path.exists` of it (behind a barrier) to name the best checkpoint. So each rank's answer
    depended on whether the other rank had got that far: the first to ask kept the previous best,
    and with `load_best_model_at_end` the ranks loaded different checkpoints, each its own shard:
    a model that was none of them, without a word (checkpoint rotation reads the same stale name).
    With the folder made here, before the barrier, every rank names the same checkpoint."""

    @functools.wraps(original)
    def save_model(self: Any, output_dir: str | None = None, _internal_call: bool = False) -> Any:
        result = original(self, output_dir, _internal_call)
        if output_dir is not None and _internal_call and self.is_fsdp_enabled:
            os.makedirs(output_dir, exist_ok=True)
        return result

    return save_model


def gathered_state_dict(model: torch.nn.Module, **peft_selection: Any) -> dict[str, torch.Tensor]:
    """What `save_pretrained` writes from (a collective: every rank calls it): on rank 0's host, a
    PEFT model's adapters (`gathered_peft_state_dict`), any other model whole, as
    `accelerator.get_state_dict` gives it under FSDP2; elsewhere the empty dict the gather leaves,
    but for a PEFT model stand-ins of every entry (`_stand_ins`). PEFT's `save_pretrained` picks its
    entries on every rank, writing only on the main one, and a `modules_to_save` or
    trainable-tokens wrapper raised KeyError on a rank whose dict lacked its entries.
    transformers 4.x writes its files on every rank, main or not: stand-ins there would be
    written over rank 0's weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    written = gathered_peft_state_dict(model, **peft_selection)
    if written is None:
        written = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0 or not _is_peft_model(model):
        return written
    return _stand_ins(get_model_state_dict(model, options=StateDictOptions()))  # this rank's shards, cheap


def _is_peft_model(model: torch.nn.Module) -> bool:
    peft = sys.modules.get("peft")  # never imported here: a PEFT model means PEFT is imported
    return peft is not None and isinstance(model, peft.PeftModel)


# The arguments of PEFT's `save_pretrained` that choose what it writes (its defaults: every
# adapter, embedding layers when targeted or resized).
_PEFT_SELECTION = ("selected_adapters", "save_embedding_layers")


def gathered_peft_state_dict(model: torch.nn.Module, selected_adapters: list[str] | None = None,
                             save_embedding_layers: str | bool = "auto") -> dict[str, torch.Tensor] | None:  # fmt: skip
    """The entries PEFT's `save_pretrained` writes of a PEFT model sharded by `fully_shard`,
    gathered on rank 0's host (empty elsewhere); None for any other model.

    Why: PEFT picks its adapters out of a whole state dict, so accelerate's recipe gathered the
    frozen base as well, on rank 0's host, only for PEFT to drop it. Which entries PEFT writes is
    asked of PEFT itself (`get_peft_model_state_dict`, with the save's own arguments) over
    stand-ins of the entries (`_stand_ins`), which costs nothing; those it picks are then
    gathered, in the state dict's order, the same on every rank (a collective each). A PEFT type
    whose saved values are computed rather than picked (prompt learning, AdaLoRA's rank pattern)
    gathers the whole model, as before."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not _is_peft_model(model) or not sharded_by_fully_shard(model):
        return None
    from peft.utils import get_peft_model_state_dict

    shards = get_model_state_dict(model, options=StateDictOptions())  # this rank's shards, named as when gathered
    stand_ins = _stand_ins(shards)
    name_of = {id(value): name for name, value in stand_ins.items()}
    picked: set[str] | None = set()
    for adapter in selected_adapters or list(model.peft_config):
        written = get_peft_model_state_dict(model, state_dict=stand_ins, adapter_name=adapter,
                                            save_embedding_layers=save_embedding_layers)  # fmt: skip
        tensors = [value for value in written.values() if isinstance(value, torch.Tensor)]
        if any(id(value) not in name_of for value in tensors):
            picked = None
            break
        picked.update(name_of[id(value)] for value in tensors)
    # rank 0's choice for all: PEFT's "auto" asks the Hub whether the embeddings were resized, and
    # ranks that chose apart would wait in different gathers
    choice = [sorted(picked) if picked is not None else None]
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    chosen = set(choice[0])
    gathered = {name: gathered_whole(value) for name, value in shards.items() if name in chosen}
    return gathered if dist.get_rank() == 0 else {}


def _stand_ins(shards: dict[str, Any]) -> dict[str, Any]:
    """A rank's shards (`get_model_state_dict`, named as when gathered), each tensor made a plain
    one of its whole shape and dtype backed by a single zero, for PEFT to pick from without
    gathering: PEFT 0.22 gathers every sharded entry it picks itself (each `DTensor` through
    `full_tensor()`, a collective), so handing it the shards made the question a gather, of
    different entries where ranks chose apart, and its answers new tensors that no longer named
    an entry. A plain tensor it leaves as it is. Zeros, not meta or this rank's shard, so that a
    PEFT type that computes from the values (an index, a top-k) runs the same on every rank and on
    the whole shape."""
    return {name: torch.zeros((), dtype=value.dtype).expand(value.shape) if isinstance(value, torch.Tensor) else value
            for name, value in shards.items()}  # fmt: skip


def _every_rank_or_raise(what: str, how: str) -> None:
    meeting = every_rank_comes("save-pretrained", f"call {what}")
    if not meeting.everyone:
        raise RuntimeError(
            f"{what} on rank {dist.get_rank()}: the model is sharded (FSDP2), so every rank must call it to gather "
            f"its weights, and {meeting.why}. Call it on every rank with {how}."
        )


def _streams(trainer: Any) -> bool:
    """Whether the Trainer's gather may hand stand-ins to its writer: the Trainer's own `_save`
    hands them to `save_pretrained` as they are, in safetensors, and so does ms-swift's on its
    common path (`_swift_saves_through_save_pretrained`). Another framework's `_save` may do
    anything with the state dict, and 4.57's `save_safetensors=False` writes with `torch.save`:
    those gather the whole model, as before."""
    from transformers import Trainer

    if not writes_safetensors(None, trainer.args):
        return False
    return type(trainer)._save is Trainer._save or _swift_saves_through_save_pretrained(trainer)


def _swift_saves_through_save_pretrained(trainer: Any) -> bool:
    """ms-swift's `_save` (4.6's `SwiftMixin._save_model`) hands the state dict to the model's
    `save_pretrained` in safetensors and uses it for nothing else, for a transformers model with
    no ms-swift tuner of its own (`tuners_map`), no template save callback, no DLRover flash
    checkpoint and `safe_serialization` on; there it streams as the Trainer's does, where before
    its final model was gathered whole on rank 0's host (an 8B model: 15 GiB). Any other ms-swift
    save gathers the whole model, as before."""
    save = type(trainer)._save
    if getattr(save, "__module__", None) != "swift.trainers.mixin":
        return False
    from transformers import PreTrainedModel

    tuners = getattr(sys.modules.get(save.__module__), "tuners_map", None)  # the name `_save_model` looks up
    args = trainer.args
    return (isinstance(trainer.model, PreTrainedModel) and tuners is not None
            and getattr(args, "tuner_type", None) not in tuners
            and not hasattr(getattr(trainer, "template", None), "save_callback")
            and not getattr(args, "use_flash_ckpt", False) and getattr(args, "safe_serialization", True) is True)


def _state_dict_sharded(trainer: Any) -> bool:
    return "SHARDED_STATE_DICT" in str(trainer.accelerator.state.fsdp_plugin.state_dict_type)


def _final_model_sharded_by_choice(trainer: Any) -> bool:
    """axolotl's `final_state_dict_type: SHARDED_STATE_DICT` in the Trainer's `fsdp_config`: the
    user asked for a sharded final model (a 405B model gathered whole does not fit rank 0's host),
    and axolotl merges the last checkpoint itself after `save_model`."""
    keys = {str(k).removeprefix("fsdp_"): v for k, v in (getattr(trainer.args, "fsdp_config", None) or {}).items()}
    return "SHARDED" in str(keys.get("final_state_dict_type", "")).upper()
