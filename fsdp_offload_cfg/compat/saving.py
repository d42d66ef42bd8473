"""How transformers writes a model's weights in `save_pretrained`, for a save that streams them
(`streamed_save`). The same in 4.57 through 5.24 in the parts used here:

- the weights of each file go through one call of `modeling_utils.safe_save_file(tensors, path,
  metadata=...)` (safetensors' `save_file`, imported under that name);
- transformers 5 reverts its load-time weight conversions before writing
  (`revert_weight_conversion`: fused MoE experts split back into one tensor per expert, renamed
  keys renamed back); it runs on meta stand-ins too, so the save asks it which tensors it builds
  and from which key (`built_from`), and builds each from the gathered weight when it is written
  (`reverted`). A conversion that needs several keys for one tensor is saved as before. 4.57
  only renames keys (VLMs' key mapping), but before a check that cannot take a renamed stand-in
  (`_keys_kept`): those are saved as before.
- 4.57's `save_pretrained(safe_serialization=False)` and `TrainingArguments.save_safetensors=False`
  write with `torch.save` instead (5.x always writes safetensors).

And how accelerate writes one in `Accelerator.save_model`, the same in 1.10 through 1.16: each
file through `accelerate.utils.other.safe_save_file` (called by `save`), after
`accelerator.clean_state_dict_for_safetensors` has dropped the names it takes for shared storage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch


def weights_writer_module() -> ModuleType:
    """The module whose `safe_save_file` `save_pretrained` calls for each weights file."""
    from transformers import modeling_utils

    return modeling_utils


def accelerate_writer_module() -> ModuleType:
    """The module whose `safe_save_file` `Accelerator.save_model` calls for each weights file."""
    from accelerate.utils import other

    return other


@contextlib.contextmanager
def save_model_keeps(stand_ins: dict[str, Any]) -> Iterator[None]:
    """Within, `Accelerator.save_model` keeps every one of these stand-ins: it drops tensors it
    takes for views of one storage (`clean_state_dict_for_safetensors`, by storage pointer), and
    every meta tensor's pointer is 0, so stand-ins of one size would be dropped as ties of each
    other. The stand-ins pass as they are (each is a weight of its own, as `get_state_dict`'s
    gathered tensors are); anything else in the state dict is cleaned by accelerate as before."""
    from accelerate import accelerator

    clean = accelerator.clean_state_dict_for_safetensors
    held = {id(value) for value in stand_ins.values()}

    def cleaned(state_dict: dict[str, Any]) -> dict[str, Any]:
        kept = clean({name: value for name, value in state_dict.items() if id(value) not in held})
        return {name: value if id(value) in held else kept[name]
                for name, value in state_dict.items() if id(value) in held or name in kept}  # fmt: skip

    accelerator.clean_state_dict_for_safetensors = cleaned
    try:
        yield
    finally:
        accelerator.clean_state_dict_for_safetensors = clean


def built_from(model: torch.nn.Module, stand_ins: dict[str, Any]) -> dict[str, str] | None:
    """What `save_pretrained` writes that is not one of these stand-ins (possibly renamed): each
    tensor transformers 5 builds anew in its reverse conversion (a MoE's fused experts split back
    into one tensor per expert), by its saved name, with the one key it is built from. {} where
    every tensor written is a stand-in; None where a built tensor needs more than one key (a
    many-to-one conversion), or the conversion cannot run on meta tensors: saved as before.
    Asked of transformers' own conversion over the stand-ins (the whole, then each key that does
    not come through alone), which costs nothing."""
    revert = getattr(weights_writer_module(), "revert_weight_conversion", None)
    if revert is None:  # 4.57: no conversions, but keys renamed before its tied-weight check
        return {} if _keys_kept(model) else None
    held = {id(value) for value in stand_ins.values()}
    try:
        whole = revert(model, dict(stand_ins))
        built = {name: value for name, value in whole.items() if id(value) not in held}
        through = {id(value) for value in whole.values()}  # the stand-ins written as they are
        sources: dict[str, str] = {}
        for key in [key for key, value in stand_ins.items() if built and id(value) not in through]:
            for name, part in revert(model, {key: stand_ins[key]}).items():
                if name not in built or name in sources or _spec(part) != _spec(built[name]):
                    return None
                sources[name] = key
    except Exception:  # noqa: BLE001 - a conversion that cannot run on meta: saved as before
        return None
    return sources if sources.keys() == built.keys() else None


def reverted(model: torch.nn.Module, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors `save_pretrained` writes built from `key`'s whole weight `tensor`, by saved name
    (see `built_from`)."""
    return weights_writer_module().revert_weight_conversion(model, {key: tensor})


@contextlib.contextmanager
def split_as_gathered(stand_ins: dict[str, Any]) -> Iterator[None]:
    """Within, `save_pretrained` splits its files as it would split the gathered tensors.

    huggingface_hub's split (`split_torch_state_dict_into_shards`) keeps tensors that are views of
    one storage together in one file, counted once: the experts transformers 5 builds from one
    fused tensor are such views. On meta it tells no storage apart (no id), and counted each
    built expert at the size of the whole fused tensor: a file per few experts. The tensors built
    on meta keep the meta views' storage, whose sharing and size are the gathered tensors'; here
    it is their storage id, and the split is the one the gathered tensors get. The stand-ins
    themselves (meta, no id) are split as before."""
    from huggingface_hub.serialization._base import split_state_dict_into_shards_factory
    from huggingface_hub.serialization._torch import get_torch_storage_id, get_torch_storage_size

    module = weights_writer_module()
    split = module.split_torch_state_dict_into_shards
    held = {id(value) for value in stand_ins.values()}

    def storage_id(tensor: torch.Tensor) -> Any:
        if tensor.device.type == "meta" and id(tensor) not in held:
            storage = tensor.untyped_storage()
            return "meta", storage._cdata, storage.nbytes()
        return get_torch_storage_id(tensor)

    def split_torch_state_dict_into_shards(state_dict: dict[str, Any], *, filename_pattern: str = "model{suffix}.safetensors",
                                           max_shard_size: int | str = "5GB") -> Any:  # fmt: skip
        return split_state_dict_into_shards_factory(state_dict, max_shard_size=max_shard_size,
                                                    filename_pattern=filename_pattern,
                                                    get_storage_size=get_torch_storage_size,
                                                    get_storage_id=storage_id)  # fmt: skip

    module.split_torch_state_dict_into_shards = split_torch_state_dict_into_shards
    try:
        yield
    finally:
        module.split_torch_state_dict_into_shards = split


def writes_safetensors(safe_serialization: Any, trainer_args: Any = None) -> bool:
    """False where 4.57 was asked to write with `torch.save` (the call's `safe_serialization`, or
    the Trainer's `save_safetensors`)."""
    return safe_serialization is not False and getattr(trainer_args, "save_safetensors", True) is not False


def _keys_kept(model: torch.nn.Module) -> bool:
    """4.57 renames a VLM's keys (`_checkpoint_conversion_mapping`) and a model's own
    (`_fix_state_dict_keys_on_save`: granite_speech) before it checks tied weights, and for a
    meta tensor that check looks the name up on the model (`get_parameter`), where a renamed one
    is not found ("LlavaForConditionalGeneration has no attribute `language_model.model`")."""
    from transformers import PreTrainedModel

    return (not getattr(model, "_checkpoint_conversion_mapping", None)
            and type(model)._fix_state_dict_keys_on_save is PreTrainedModel._fix_state_dict_keys_on_save)  # fmt: skip


def _spec(tensor: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    return tensor.shape, tensor.dtype
