"""Which saved tensors may leave the compute device, and why the others stay.

Each rule guards a known failure of earlier offloaders (docs/offload.md, "What is never offloaded, and why"):
- parameters and anything sharing their storage (`weight.t()`, FSDP's unsharded parameters,
  FSDP1 flat-parameter views) and buffers: they live on the device anyway, so a copy frees
  nothing; worse, FSDP resizes unsharded storage to zero on reshard and refills it in backward,
  so a copy taken in forward would be restored over a storage FSDP manages itself;
- tensor subclasses (DTensor, NF4, float8) and non-strided layouts: their storage is not the
  whole story, a byte copy would not restore them;
- integer and bool tensors (masks, indices) and storages under `min_tensor_bytes`: the copy costs a
  launch and a pool slot for nothing (torchtune's 1 KB floor). The storage decides, not the view:
  keeping a 16-byte slice of a 1 MB activation keeps the whole megabyte on the device;
- tensors not on the compute device: on a CUDA run, CPU tensors are already on the host. On a
  CPU-only run the compute device *is* the CPU, so CPU tensors are offloaded into separate host
  buffers ("CPU proxy" mode): CI exercises the whole path without a GPU.
"""

from __future__ import annotations

import weakref
from collections.abc import Container

import torch
from torch import nn


class ParamStorages:
    """Storage addresses of parameters and buffers, each confirmed live when it is looked up.

    Why not a plain set of addresses: FSDP2 frees an unsharded parameter's memory at reshard
    (`untyped_storage().resize_(0)`) and keeps the tensor, and the allocator hands that address
    to the next activation. A set gathered at the start of a pass or group would then keep that
    activation as a "parameter", by the luck of the allocator (different counts from run to run).
    Here an address counts only while the tensor it was read from still has its storage there.
    """

    def __init__(self, *modules: nn.Module) -> None:
        # address -> the parameter/buffer (local shard of a DTensor) it was read from, weakly:
        # a pass must not keep FSDP's unsharded parameters alive
        self._by_ptr: dict[int, weakref.ref[torch.Tensor]] = {}
        for module in modules:
            self.add(module)

    def add(self, module: nn.Module) -> None:
        for t in (*module.parameters(), *module.buffers()):
            local = getattr(t, "_local_tensor", t)
            ptr = _storage_ptr(local)
            if ptr:
                self._by_ptr[ptr] = weakref.ref(local)

    def __contains__(self, ptr: object) -> bool:
        ref = self._by_ptr.get(ptr)  # type: ignore[call-overload]
        tensor = ref() if ref is not None else None
        return tensor is not None and _storage_ptr(tensor) == ptr


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a subclass without a plain storage
        return 0


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

    `param_ptrs` holds the storage addresses of parameters and buffers alive right now
    (`ParamStorages`: confirmed live at lookup, so a recycled address is an activation's).
    """
    if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
        return "subclass"
    if t.layout != torch.strided or t.is_quantized:
        return "subclass"
    if _is_param_like(t):
        return "parameter"
    if t.device != compute_device:
        return "other_device"
    if not (t.is_floating_point() or t.is_complex()):  # complex: RoPE via `view_as_complex` saves big ones
        return "non_float"
    storage = t.untyped_storage()
    if storage.nbytes() < min_bytes or storage.data_ptr() == 0:
        return "small"  # judged by storage: a kept small view would pin its whole base on the device
    if storage.data_ptr() in param_ptrs:
        return "parameter"
    return None
