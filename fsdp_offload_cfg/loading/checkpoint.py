"""Run transformers' own `from_pretrained` without reading a single weight, and record where each
tensor lives in the safetensors files.

Why run the original at all: config resolution, dtype ("auto", `_keep_in_fp32_modules`), key
renames, missing/unexpected-key reports, tying, non-persistent buffers (computed by
`_init_weights`), generation config — all stay exactly transformers' behaviour. Only three
functions are swapped for the duration of the call:

- `_get_resolved_checkpoint_files`: the files must all be `.safetensors`, else `NeedsBroadcast`
  (a `.bin`/GGUF file can only be read whole, before anything else is read);
- `convert_and_load_state_dict_in_model`: maps checkpoint keys to model keys with transformers'
  own `rename_source_key`; a key that goes through a `WeightConverter` (fused experts, split
  qkv, ...), a shape mismatch or two keys for one tensor mean the data must be transformed
  whole: `NeedsBroadcast`. Pure renames are fine (the bytes are the same);
- `spawn_materialize`: returns an empty meta tensor of the dtype transformers would cast to.

The model comes back with every checkpoint-backed tensor on `meta` (right dtype, flagged as
loaded, tied), missing keys and non-persistent buffers materialised and initialised as in a
plain load, and a `CheckpointRecord` under `CHECKPOINT_ATTR` that `load_into_sharded` reads.
"""

from __future__ import annotations

import copy
import json
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

CHECKPOINT_ATTR = "_fsdp_offload_cfg_checkpoint"

# safetensors dtype names (https://github.com/huggingface/safetensors, `Dtype`)
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}  # fmt: skip


class NeedsBroadcast(Exception):
    """The checkpoint cannot be read slice by slice; `reason` says why (one line)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class FileTensor:
    """Where one tensor's bytes are: `offset` is absolute in the file, row-major, `dtype` as stored."""

    path: str
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


@dataclass
class CheckpointRecord:
    """Which checkpoint tensor fills which model tensor, by tensor identity (not by name), so that
    it survives wrappers that rename modules (PEFT's `base_model.model.` and `.base_layer.`)."""

    files: tuple[str, ...]
    _by_id: dict[int, tuple[torch.Tensor, FileTensor]] = field(default_factory=dict)

    def add(self, tensor: torch.Tensor, where: FileTensor) -> None:
        self._by_id.setdefault(id(tensor), (tensor, where))

    def lookup(self, tensor: torch.Tensor) -> FileTensor | None:
        entry = self._by_id.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else None

    def __len__(self) -> int:
        return len(self._by_id)


def read_header(path: str) -> dict[str, FileTensor]:
    """Every tensor of one safetensors file; raises if the file is shorter than its header says
    (a truncated download), naming the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise OSError(f"{path}: truncated or not a safetensors file (header of {n} bytes, file of {size})")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    out = {}
    for key, entry in header.items():
        begin, end = entry["data_offsets"]
        if 8 + n + end > size:
            raise OSError(f"{path}: truncated ({size} bytes, tensor {key!r} ends at {8 + n + end})")
        if entry["dtype"] not in _DTYPES:
            raise NeedsBroadcast(f"{key!r} has safetensors dtype {entry['dtype']}, which this reader does not know")
        out[key] = FileTensor(path, key, _DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + n + begin)
    return out


def record_of(model: nn.Module) -> CheckpointRecord | None:
    """The record of the (sub)module `meta_from_pretrained` built, wherever wrappers put it."""
    for module in model.modules():
        record = getattr(module, CHECKPOINT_ATTR, None)
        if isinstance(record, CheckpointRecord):
            return record
    return None


@dataclass
class _Capture:
    files: list[str] | None = None
    keymap: dict[str, FileTensor] | None = None  # model state-dict name -> checkpoint tensor


def meta_from_pretrained(call: Callable[[], Any]) -> Any:
    """`call()` (the original `from_pretrained`) with no weight read; see the module docstring."""
    capture = _Capture()
    with _meta_loading(capture):
        result = call()
    if capture.keymap is None:
        raise NeedsBroadcast("transformers did not read this checkpoint through safetensors")
    model = result[0] if isinstance(result, tuple) else result
    setattr(model, CHECKPOINT_ATTR, _record(model, capture))
    return result


def _record(model: nn.Module, capture: _Capture) -> CheckpointRecord:
    """Bind each checkpoint tensor to the model tensor it filled. A tied tensor is filled from its
    tie source (transformers ties outputs to inputs after loading), never from a tie target."""
    tied_targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    record = CheckpointRecord(tuple(capture.files or ()))
    for name, tensor in sorted(named, key=lambda item: item[0] in tied_targets):
        if name in capture.keymap:
            record.add(tensor, capture.keymap[name])
    return record


@contextmanager
def _meta_loading(capture: _Capture) -> Iterator[None]:
    import transformers.core_model_loading as core
    import transformers.modeling_utils as mu

    original_resolve = mu._get_resolved_checkpoint_files
    original_convert = mu.convert_and_load_state_dict_in_model
    original_spawn = core.spawn_materialize

    def resolve(*args: Any, **kwargs: Any) -> Any:
        files, metadata = original_resolve(*args, **kwargs)
        if not files:
            raise NeedsBroadcast("the weights are not in checkpoint files (e.g. passed as state_dict)")
        others = [os.path.basename(f) for f in files if not str(f).endswith(".safetensors")]
        if others:
            raise NeedsBroadcast(f"checkpoint files are not safetensors ({', '.join(others[:3])})")
        capture.files = files  # the same list: from_pretrained may still append extra files to it
        return files, metadata

    def convert(model: nn.Module, state_dict: dict[str, Any], load_config: Any, *args: Any, **kwargs: Any) -> Any:
        if capture.keymap is not None:
            raise NeedsBroadcast("more than one state dict is loaded (e.g. a PEFT adapter checkpoint)")
        if capture.files is None:
            raise NeedsBroadcast("the weights are not in safetensors checkpoint files")
        if getattr(load_config, "hf_quantizer", None) is not None:
            raise NeedsBroadcast("the checkpoint is quantized")
        keymap = map_keys(model, state_dict, load_config.weight_mapping or [], capture.files)
        result = original_convert(model, state_dict, load_config, *args, **kwargs)
        info = result[0]
        loaded = set(model.state_dict()) - set(info.missing_keys) - {k[0] for k in info.mismatched_keys}
        if loaded != set(keymap):
            diff = sorted(loaded ^ set(keymap))[:5]
            raise NeedsBroadcast(f"transformers mapped checkpoint keys differently from a 1:1 rename ({diff})")
        capture.keymap = keymap
        return result

    def spawn(thread_pool: Any, tensor: Any, device: Any = None, dtype: Any = None, **kwargs: Any) -> Callable:
        shape, stored = _shape_and_dtype(tensor)
        empty = torch.empty(shape, dtype=dtype or stored, device="meta")
        return lambda: empty

    mu._get_resolved_checkpoint_files = resolve
    mu.convert_and_load_state_dict_in_model = convert
    core.spawn_materialize = spawn
    try:
        yield
    finally:
        mu._get_resolved_checkpoint_files = original_resolve
        mu.convert_and_load_state_dict_in_model = original_convert
        core.spawn_materialize = original_spawn


def _shape_and_dtype(tensor: Any) -> tuple[tuple[int, ...], torch.dtype]:
    if isinstance(tensor, torch.Tensor):
        raise NeedsBroadcast("the checkpoint yields in-memory tensors, not safetensors slices")
    return tuple(tensor.get_shape()), _DTYPES[tensor.get_dtype()]


def map_keys(
    model: nn.Module, state_dict: dict[str, Any], weight_mapping: list[Any], files: list[str]
) -> dict[str, FileTensor]:
    """Model state-dict name -> checkpoint tensor, computed the way transformers renames keys
    (`rename_source_key`, with the model's `base_model_prefix`), or `NeedsBroadcast` when a key
    is converted rather than renamed, changes shape, or two keys land on one tensor."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    where: dict[str, FileTensor] = {}
    for path in files:
        where.update(read_header(path))
    mapping = copy.deepcopy(weight_mapping)  # transforms keep state (e.g. "was used"): leave theirs alone
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None)
    expected = model.state_dict()
    keymap: dict[str, FileTensor] = {}
    for key in sorted(state_dict, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if name not in expected and key in expected:
            name, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=expected)
        if name not in expected:
            continue  # unexpected: transformers reports and ignores it
        if pattern is not None:
            raise NeedsBroadcast(f"checkpoint key {key!r} is converted on load (pattern {pattern!r} -> {name!r})")
        if key not in where:
            raise NeedsBroadcast(f"checkpoint key {key!r} is not in the safetensors headers")
        if name in keymap:
            raise NeedsBroadcast(f"checkpoint keys {keymap[name].key!r} and {key!r} both map to {name!r}")
        if where[key].shape != tuple(expected[name].shape):
            raise NeedsBroadcast(f"{key!r} has shape {list(where[key].shape)}, the model {list(expected[name].shape)}")
        keymap[name] = where[key]
    return keymap
