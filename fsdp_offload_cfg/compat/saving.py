"""How transformers writes a model's weights in `save_pretrained`, for a save that streams them
(`streamed_save`). The same in 4.57 through 5.24 in the parts used here:

- the weights of each file go through one call of `modeling_utils.safe_save_file(tensors, path,
  metadata=...)` (safetensors' `save_file`, imported under that name);
- transformers 5 reverts its load-time weight conversions before writing
  (`revert_weight_conversion`: fused MoE experts split back into one tensor per expert, renamed
  keys renamed back); a conversion that builds new tensors cannot take stand-ins for gathered
  weights, so such a model is saved as before. 4.57 only renames keys (VLMs' key mapping), but
  before a check that cannot take a renamed stand-in (`_keys_kept`): those are saved as before.
- 4.57's `save_pretrained(safe_serialization=False)` and `TrainingArguments.save_safetensors=False`
  write with `torch.save` instead (5.x always writes safetensors).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch


def weights_writer_module() -> ModuleType:
    """The module whose `safe_save_file` `save_pretrained` calls for each weights file."""
    from transformers import modeling_utils

    return modeling_utils


def saved_as_held(model: torch.nn.Module, state_dict: dict[str, Any]) -> bool:
    """Whether `save_pretrained` writes these very tensors (possibly renamed), not new ones built
    from them. Asked of transformers' own conversion over the stand-ins, which costs nothing."""
    revert = getattr(weights_writer_module(), "revert_weight_conversion", None)
    if revert is None:  # 4.57: no conversions, but keys renamed before its tied-weight check
        return _keys_kept(model)
    held = {id(value) for value in state_dict.values()}
    try:
        reverted = revert(model, dict(state_dict))
    except Exception:  # noqa: BLE001 - a conversion that cannot run on meta: saved as before
        return False
    return all(id(value) in held for value in reverted.values())


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
