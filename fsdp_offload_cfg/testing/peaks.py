"""Device memory figures the benchmarks report and the tests check, read from the allocator."""

from __future__ import annotations

import torch
from torch import nn


class NonGradientPeak:
    """The device's allocated peak over forward and backward without the gradients in it.

    Why: "fwd+bwd" counts the gradients as backward makes them. The `none` row peaks as backward
    starts, before most exist; an offloading row peaks near backward's end, next to nearly all of
    them (1.4 GiB in bf16 for the 16 x 2048 shape). Its ratio to `none` then reads
    gradients as activations. The "fwd+bwd" column, which counts them, is the other part.

    How, with the allocator alone (no figure of the offload's own): a tensor hook on each decoder
    layer's output fires as that layer's backward starts. At each firing the allocated peak since
    the last one, less the gradients alive at the last one, is read, and the peak reset. Gradients
    only grow in backward, so each reading is at least the true non-gradient bytes at its
    interval's peak. It overstates them by at most the gradients made within one interval: one
    layer's, or the head's in the first interval (forward and the loss's backward).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.peak = 0
        self.grads_then = 0  # gradient bytes at the last reading: a floor for those alive since
        self.hooks = [layer.register_forward_hook(self._on_layer_output) for layer in model.model.layers]

    def _on_layer_output(self, module: nn.Module, args: object, out: object) -> None:
        hidden = out[0] if isinstance(out, tuple) else out
        if torch.is_grad_enabled() and isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda grad: self.read())  # recomputed outputs never get a gradient

    def read(self) -> None:
        self.peak = max(self.peak, torch.cuda.max_memory_allocated() - self.grads_then)
        torch.cuda.reset_peak_memory_stats()
        self.grads_then = self._gradient_bytes()

    def _gradient_bytes(self) -> int:
        """Bytes of the storages under the gradients, each once: FSDP2's sharded gradients are
        views into one reduce-scatter output per layer."""
        storages = {}
        for param in self.model.parameters():  # under FSDP2, the unsharded ones while a layer is
            grad = param.grad
            if grad is not None:
                storage = (grad.to_local() if hasattr(grad, "to_local") else grad).untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
