"""What a rank read, counted independently of the loader: the kernel's count of bytes this
process's `read`/`pread` calls returned, and the bytes a rank must read to fill its own slices."""

from __future__ import annotations

import os

import torch

KERNEL_SLACK = 4096  # bytes the kernel may count besides the checkpoint reads (store traffic)


def rchar() -> int:
    """`/proc/self/io`'s `rchar`: every byte this process has read so far."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def needed_and_row(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of this rank's own slices of every tensor, the largest row of any tensor): what a
    rank must read, and the most it may read beyond that (a slice boundary inside one row)."""
    from torch.distributed.tensor import DTensor

    needed, row = 0, 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith("inv_freq"):  # computed at init, not in the checkpoint
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        needed += local.numel() * local.element_size()
        if tensor.dim() > 0:
            row = max(row, tensor.numel() // tensor.shape[0] * tensor.element_size())
    return needed, row


def checkpoint_tensor_bytes(path: str) -> int:
    """The tensor bytes of the checkpoint directory `path` (its safetensors files less their
    headers), as safetensors itself loads them: the size a read-once check compares against."""
    from safetensors.torch import load_file

    return sum(t.numel() * t.element_size() for name in os.listdir(path) if name.endswith(".safetensors")
               for t in load_file(os.path.join(path, name)).values())
