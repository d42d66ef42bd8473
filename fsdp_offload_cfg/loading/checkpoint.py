"""Run transformers' own `from_pretrained` without reading a single weight, and record where each
tensor lives in the safetensors files.

Why run the original at all: config resolution, dtype ("auto", `_keep_in_fp32_modules`), key
renames, missing/unexpected-key reports, tying, non-persistent buffers (computed by
`_init_weights` or `__init__`), generation config — all stay exactly transformers' behaviour.
Only the functions that read weight bytes are swapped for the duration of the call; which ones
depends on the transformers version and lives in `compat.checkpoint_reading`. A checkpoint that
cannot be read slice by slice (not safetensors, keys fused or converted on load, shapes that
differ, two keys for one tensor) raises `NotSliceable`.

The model comes back with every checkpoint-backed tensor on `meta` (right dtype, flagged as
loaded, tied), missing keys and non-persistent buffers materialised and initialised as in a
plain load, and a `CheckpointRecord` in its `model_state` that `load_into_sharded` reads.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fsdp_offload_cfg import model_state
from fsdp_offload_cfg.compat.checkpoint_reading import Capture, no_read_loading
from fsdp_offload_cfg.safetensors_index import FileTensor, NotSliceable, read_header

__all__ = ["CheckpointRecord", "FileTensor", "NotSliceable", "meta_from_pretrained",
           "read_header", "record_of"]  # fmt: skip


@dataclass
class CheckpointRecord:
    """Which checkpoint tensor fills which model tensor, by tensor identity (not by name), so that
    it survives wrappers that rename modules (PEFT's `base_model.model.` and `.base_layer.`)."""

    files: tuple[str, ...]
    _by_id: dict[int, tuple[torch.Tensor, FileTensor]] = field(default_factory=dict)
    read_early: int = 0  # bytes read before prepare, tensor by tensor, where values were used (`pending.py`)

    def __deepcopy__(self, memo: dict[int, Any]) -> CheckpointRecord:
        """The record of a copy of the model (`copy.deepcopy(model)`): the same files behind the
        copy's tensors. Keyed by identity, so the default copy would keep the original's ids."""
        new = CheckpointRecord(self.files, read_early=self.read_early)
        memo[id(self)] = new  # first: copying a pending tensor below reaches this record again
        for t, where in list(self._by_id.values()):
            new.add(copy.deepcopy(t, memo), where)
        return new

    def add(self, tensor: torch.Tensor, where: FileTensor) -> None:
        self._by_id.setdefault(id(tensor), (tensor, where))

    def lookup(self, tensor: torch.Tensor) -> FileTensor | None:
        entry = self._by_id.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else None

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        """`tensor` (on meta, before prepare) now holds `dtype`: its values are read through it."""
        entry = self._by_id.get(id(tensor))
        if entry is not None and entry[0] is tensor:
            self._by_id[id(tensor)] = (tensor, entry[1].held_as(dtype))

    def forget(self, tensor: torch.Tensor) -> None:
        """`tensor` no longer matches its checkpoint tensor (it was resized): rank 0 sends it."""
        if self.lookup(tensor) is not None:
            del self._by_id[id(tensor)]

    def __len__(self) -> int:
        return len(self._by_id)


def record_of(model: nn.Module) -> CheckpointRecord | None:
    """The record of the (sub)module `meta_from_pretrained` built, wherever wrappers put it."""
    for module in model.modules():
        record = model_state.found(module, "checkpoint")
        if isinstance(record, CheckpointRecord):
            return record
    return None


def meta_from_pretrained(call: Callable[[], Any]) -> Any:
    """`call()` (the original `from_pretrained`) with no weight read; see the module docstring."""
    capture = Capture()
    with no_read_loading(capture):
        result = call()
    if capture.keymap is None:
        raise NotSliceable("transformers did not read this checkpoint through safetensors")
    model = result[0] if isinstance(result, tuple) else result
    record = _record(model, capture)
    unbacked = [n for n, t in _named_tensors(model) if t.is_meta and record.lookup(t) is None]
    if unbacked:
        raise NotSliceable(f"tensors left on meta with no checkpoint tensor behind them ({unbacked[:3]})")
    model_state.put(model, "checkpoint", record)
    return result


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


def _record(model: nn.Module, capture: Capture) -> CheckpointRecord:
    """Bind each checkpoint tensor to the model tensor it filled. A tied tensor is filled from its
    tie source (transformers ties outputs to inputs after loading), never from a tie target."""
    tied_targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    record = CheckpointRecord(tuple(capture.files or ()))
    for name, tensor in sorted(_named_tensors(model), key=lambda item: item[0] in tied_targets):
        if name in capture.keymap:  # the dtype transformers loaded it in is the first it held
            record.add(tensor, capture.keymap[name].held_as(tensor.dtype))
    return record

