"""Two activation offloaders on one model stop the run, naming both: autograd hands
each saved tensor to the innermost saved-tensor hooks only, so one of the two moved nothing,
silently (ms-swift's own callback took every activation and ours moved 0 bytes)."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks

from fsdp_offload_cfg.offload import enable_activation_offload, offload_stats, reset_offload_stats
from fsdp_offload_cfg.offload.collisions import OffloaderCollisionError
from fsdp_offload_cfg.offload.options import ActivationOffloadConfig
from fsdp_offload_cfg.testing.offload_models import Block, Net, batch, llama_step, tiny_llama

ON = ActivationOffloadConfig(enabled=True, mode="sync", min_tensor_bytes=0)


def test_save_on_cpu_around_the_model_is_refused_naming_it():
    net = Net(n=3)
    enable_activation_offload(net, ON, layer_classes=[Block])
    with save_on_cpu(), pytest.raises(OffloaderCollisionError, match=r"save_on_cpu.*around the model's forward"):
        net(torch.randn(4, 32))


def _framework_hooks() -> tuple[object, object]:
    """Saved-tensor hooks as a framework's callback defines them (here: ms-swift's module)."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    pack.__module__ = unpack.__module__ = "swift.trainers.callback"
    return pack, unpack


def test_a_frameworks_offloader_inside_the_layers_is_refused_naming_it():
    model = tiny_llama(2)
    enable_activation_offload(model, ON)
    contexts = []

    def enter(module: torch.nn.Module, args: object) -> None:  # a per-layer offloader, as ms-swift's callback
        ctx = saved_tensors_hooks(*_framework_hooks())
        ctx.__enter__()
        contexts.append(ctx)

    for layer in model.model.layers:
        layer.register_forward_pre_hook(enter, prepend=True)
    with pytest.raises(OffloaderCollisionError, match=r"ms-swift's activation_cpu_offload callback.*inside "
                                                      r"LlamaDecoderLayer.*fsdp_activation_cpu_offload"):
        llama_step(model, batch())
    while contexts:
        contexts.pop().__exit__(None, None, None)


def test_checkpointing_composes_and_is_not_a_collision():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_llama(2)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    enable_activation_offload(model, ON)
    reset_offload_stats()
    llama_step(model, batch())
    assert offload_stats()["offloaded_bytes"] > 0
