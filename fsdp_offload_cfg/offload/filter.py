"""Which saved tensors may leave the compute device, and why the others stay.

Each rule guards a known failure of earlier offloaders (see DESIGN.md, "Hazards"):
- parameters and anything sharing their storage (`weight.t()`, FSDP's unsharded parameters,
  FSDP1 flat-parameter views) and buffers: they live on the device anyway, so a copy frees
  nothing; worse, FSDP resizes unsharded storage to zero on reshard and refills it in backward,
  so a copy taken in forward would be restored over a storage FSDP manages itself;
- tensor subclasses (DTensor, NF4, float8) and non-strided layouts: their storage is not the
  whole story, a byte copy would not restore them;
- non-floating tensors (masks, indices) and storages under `min_tensor_bytes`: the copy costs a
  launch and a pool slot for nothing (torchtune's 1 KB floor). The storage decides, not the view:
  keeping a 16-byte slice of a 1 MB activation keeps the whole megabyte on the device;
- tensors not on the compute device: on a CUDA run, CPU tensors are already on the host. On a
  CPU-only run the compute device *is* the CPU, so CPU tensors are offloaded into separate host
  buffers ("CPU proxy" mode): CI exercises the whole path without a GPU.
"""

from __future__ import annotations

from collections.abc import Container

import torch
from torch import nn


def _is_param_like(t: torch.Tensor) -> bool:
    """A parameter, or an autograd view of one (`weight.t()`, FSDP1 views of the flat parameter)."""
    if isinstance(t, nn.Parameter):
        return True
    base = t._base
    return base is not None and isinstance(base, nn.Parameter)


def keep_reason(
    t: torch.Tensor,
    compute_device: torch.device,
    min_bytes: int,
    param_ptrs: Container[int],
) -> str | None:
    """Why `t` must stay where it is, or None when it may be offloaded.

    `param_ptrs` holds the storage addresses of parameters and buffers alive right now.
    """
    if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
        return "subclass"
    if t.layout != torch.strided or t.is_quantized:
        return "subclass"
    if _is_param_like(t):
        return "parameter"
    if t.device != compute_device:
        return "other_device"
    if not t.is_floating_point():
        return "non_float"
    storage = t.untyped_storage()
    if storage.nbytes() < min_bytes or storage.data_ptr() == 0:
        return "small"  # judged by storage: a kept small view would pin its whole base on the device
    if storage.data_ptr() in param_ptrs:
        return "parameter"
    return None
