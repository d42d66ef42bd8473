"""No KV cache in a forward with gradients of a model accelerate checkpoints.

transformers turns `use_cache` off in training for its own gradient checkpointing (the
`GradientCheckpointingLayer` and, on 5.x, `merge_with_config_defaults` warn "`use_cache=True` is
incompatible with gradient checkpointing"). accelerate's `fsdp_activation_checkpointing` wraps
the decoder layers in torch's `checkpoint_wrapper` instead, which transformers does not see: a
model whose config says `use_cache: true` (Llama, Qwen2, Mistral, ... by default) fills a
`DynamicCache` in its training forward, each checkpointed layer appends its keys and values to
it again when backward recomputes it, and on transformers 4.x the first backward stops with
"torch.utils.checkpoint: Recomputed values for the following tensors have different metadata
than during the forward pass" (saved `[.., 12, ..]`, recomputed `[.., 24, ..]`; transformers
#34928, LlamaFactory #9064). The transformers 5 Trainer sets `config.use_cache = False`, which
hides it there; a plain accelerate loop on 4.x, and the 4.x Trainer, crash. Even where nothing
crashes the cache holds every layer's keys and values for as long as the output lives, through
backward: the memory checkpointing was asked to save.

So a model accelerate checkpointed gets a forward pre-hook that passes `use_cache=False` to every
forward with gradients on: that is when a checkpointed layer is recomputed, in training mode or
not (a script that never calls `model.train()` keeps `from_pretrained`'s eval mode; transformers
asks for training mode too, for its own checkpointing, which it skips in eval mode).
Generation and evaluation run without gradients and keep the model's setting.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from fsdp_offload_cfg import model_state
from fsdp_offload_cfg._signatures import parameters


def cache_off_in_training(model: nn.Module) -> nn.Module | None:
    """Hook (once) the outermost module of `model` whose forward takes `use_cache` (the model, or
    the transformers model inside a PEFT wrapper, whose forward passes `**kwargs` on) so that its
    forwards with gradients build no cache; returns it, or None where no forward takes `use_cache`."""
    for module in model.modules():
        names = list(parameters(module.forward))
        if "use_cache" in names:
            break
    else:
        return None
    if model_state.get(module, "cache_off") is None:
        hook = functools.partial(_no_cache_while_training, position=names.index("use_cache"))
        model_state.put(module, "cache_off", module.register_forward_pre_hook(hook, with_kwargs=True))
    return module


def remove(model: nn.Module) -> None:
    handle = model_state.take(model, "cache_off")
    if handle is not None:
        handle.remove()




def _no_cache_while_training(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                             position: int) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """`position`: where `use_cache` sits among the forward's parameters (passed there by
    position, the call's own value stands)."""
    if not torch.is_grad_enabled() or kwargs.get("use_cache") is False or len(args) > position:
        return None
    return args, {**kwargs, "use_cache": False}
