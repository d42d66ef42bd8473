"""Which transformers functions read checkpoint data in `from_pretrained`, and their no-read twins.

`load_strategy: sharded` runs transformers' own `from_pretrained` on every rank (config, dtype,
renames, missing keys, ties and non-persistent buffers stay transformers' behaviour) with the
functions that read weight bytes swapped, for the duration of the call only, by twins that put an
empty meta tensor where the data would go and record which file tensor fills which model tensor
(`Capture.keymap`). Where those functions are depends on the transformers generation:

- 5.x (`core_model_loading`): `_get_resolved_checkpoint_files`, `convert_and_load_state_dict_in_model`
  (keys mapped with transformers' own `rename_source_key`; a `WeightConverter` that only stacks
  whole tensors, as MoE experts are, gives one composed record; any other conversion transforms
  the data whole: `NotSliceable`), `spawn_materialize` (an empty meta tensor of the cast dtype);
- 4.x: `_get_resolved_checkpoint_files` and `load_shard_file` (keys already renamed by
  `_get_key_renaming_mapping`; dtype from `_infer_parameter_dtype`, as its own loader casts).

`swap_targets()` names them so that `patch()` checks they exist before it changes anything.
"""

from __future__ import annotations

import copy
import importlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from fsdp_offload_cfg.safetensors_index import DTYPES, FileTensor, NotSliceable, composed, read_headers


@dataclass
class Capture:
    files: list[str] | None = None
    keymap: dict[str, FileTensor] | None = None  # model state-dict name -> checkpoint tensor


_MU = "transformers.modeling_utils"
Twin = Callable[[Callable[..., Any], Capture], Callable[..., Any]]  # (original, capture) -> replacement


def _interception() -> tuple[list[tuple[str, str, Twin]], list[tuple[str, str]]]:
    """On the installed transformers: (module, attribute, twin factory) of every function swapped,
    and (module, attribute) of the functions the twins call in their place."""
    try:
        import transformers.core_model_loading  # noqa: F401
    except ImportError:  # transformers 4.x
        twins = [(_MU, "_get_resolved_checkpoint_files", _resolve), (_MU, "load_shard_file", _load_shard_file_4x)]
        return twins, [(_MU, "_infer_parameter_dtype"), (_MU, "_load_parameter_into_model")]
    return [
        (_MU, "_get_resolved_checkpoint_files", _resolve),
        (_MU, "convert_and_load_state_dict_in_model", _convert_5x),
        ("transformers.core_model_loading", "spawn_materialize", lambda original, capture: _spawn_5x),
    ], []


def swap_targets() -> list[tuple[str, str]]:
    """(module, attribute) of every function `no_read_loading` swaps, or calls in their place."""
    twins, called = _interception()
    return [(module, attr) for module, attr, _ in twins] + called


@contextmanager
def no_read_loading(capture: Capture) -> Iterator[None]:
    """Within this context, `from_pretrained` reads headers only and fills `capture`."""
    swapped: list[tuple[Any, str, Any]] = []
    try:
        for module, attr, twin in _interception()[0]:
            owner = importlib.import_module(module)
            original = getattr(owner, attr)
            setattr(owner, attr, twin(original, capture))
            swapped.append((owner, attr, original))
        yield
    finally:
        for owner, attr, original in reversed(swapped):
            setattr(owner, attr, original)


def _resolve(original: Callable[..., Any], capture: Capture) -> Callable[..., Any]:
    def resolve(*args: Any, **kwargs: Any) -> Any:
        files, metadata = original(*args, **kwargs)
        if not files:
            raise NotSliceable("the weights are not in checkpoint files (e.g. passed as state_dict)")
        others = [os.path.basename(f) for f in files if not str(f).endswith(".safetensors")]
        if others:
            raise NotSliceable(f"checkpoint files are not safetensors ({', '.join(others[:3])})")
        capture.files = files  # the same list: from_pretrained may still append extra files to it
        return files, metadata

    return resolve


def _check_first_state_dict(capture: Capture) -> None:
    if capture.keymap is not None:
        raise NotSliceable("more than one state dict is loaded (e.g. a PEFT adapter checkpoint)")
    if capture.files is None:
        raise NotSliceable("the weights are not in safetensors checkpoint files")


# ---- transformers 5.x -------------------------------------------------------------------------


def _convert_5x(original: Callable[..., Any], capture: Capture) -> Callable[..., Any]:
    def convert(model: nn.Module, state_dict: dict[str, Any], load_config: Any, *args: Any, **kwargs: Any) -> Any:
        _check_first_state_dict(capture)
        if getattr(load_config, "hf_quantizer", None) is not None:
            raise NotSliceable("the checkpoint is quantized")
        keymap = map_keys_5x(model, state_dict, load_config.weight_mapping or [], capture.files)
        result = original(model, state_dict, load_config, *args, **kwargs)
        info = result[0]
        loaded = set(model.state_dict()) - set(info.missing_keys) - {k[0] for k in info.mismatched_keys}
        if loaded != set(keymap):
            diff = sorted(loaded ^ set(keymap))[:5]
            raise NotSliceable(f"transformers mapped checkpoint keys differently from a 1:1 rename ({diff})")
        capture.keymap = keymap
        return result

    return convert


def _spawn_5x(thread_pool: Any, tensor: Any, device: Any = None, dtype: Any = None, **kwargs: Any) -> Callable:
    if isinstance(tensor, torch.Tensor):
        raise NotSliceable("the checkpoint yields in-memory tensors, not safetensors slices")
    empty = torch.empty(tuple(tensor.get_shape()), dtype=dtype or DTYPES[tensor.get_dtype()], device="meta")
    return lambda: empty


def map_keys_5x(
    model: nn.Module, state_dict: dict[str, Any], weight_mapping: list[Any], files: list[str]
) -> dict[str, FileTensor]:
    """Model state-dict name -> checkpoint tensor, computed the way transformers renames keys
    (`rename_source_key`, with the model's `base_model_prefix`), or `NotSliceable` when a key
    is converted rather than renamed, changes shape, or two keys land on one tensor."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    where = read_headers(files)
    mapping = copy.deepcopy(weight_mapping)  # transforms keep state (e.g. "was used"): leave theirs alone
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    converter_of = {p: c for c in converters for p in c.source_patterns}  # as transformers picks it
    prefix = getattr(model, "base_model_prefix", None)
    expected = model.state_dict()
    keymap: dict[str, FileTensor] = {}
    # converted tensors: model name -> (its converter, its checkpoint keys per source pattern in
    # the order transformers collects them, which is this loop's: `dot_natural_key`, expert 0 first)
    gathered: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for key in sorted(state_dict, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if name not in expected and key in expected:
            name, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=expected)
        if name not in expected:
            continue  # unexpected: transformers reports and ignores it
        if pattern is None:
            _add(keymap, name, key, where, tuple(expected[name].shape))
            continue
        converter, keys = gathered.setdefault(name, (converter_of[pattern], {}))
        keys.setdefault(pattern, []).append(key)
    for name, (converter, keys) in gathered.items():
        if name in keymap:
            raise NotSliceable(f"checkpoint key {keymap[name].key!r} and a converted key both map to {name!r}")
        keymap[name] = _composed_from(name, converter, keys, where, tuple(expected[name].shape))
    return keymap


def _composed_from(name: str, converter: Any, keys: dict[str, list[str]], where: dict[str, FileTensor],
                   shape: tuple[int, ...]) -> FileTensor:
    """The model tensor `name` that `converter` builds from the checkpoint tensors `keys`, as one
    `FileTensor` of parts, where the conversion only lays whole tensors one after another:
    - `MergeModulelist(dim=0)`: the experts stacked, `[E, *expert]`;
    - `MergeModulelist(dim=0), Concatenate(dim=1)`: each source stacked, then concatenated per
      expert (`gate_up_proj`: expert e's gate rows, then its up rows);
    - `Concatenate(dim=0)`: the sources one after another (a fused qkv).
    - `Transpose` of two dims other than 0, on one tensor (`_transposed`).
    Anything else (a chunk, an interleave, a transpose of dim 0, a dequantization) is `NotSliceable`."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose

    ops = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
    lists = [keys.get(p, []) for p in converter.source_patterns]
    first = next(k for keyed in lists for k in keyed)
    if ops == [(Transpose, None)] and len(lists) == 1 and len(lists[0]) == 1 and first in where:
        return _transposed(name, converter.operations[0], where[first], shape)
    stack, stack_and_join, join = ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)],
                                   [(Concatenate, 0)])
    if (ops not in (stack, stack_and_join, join) or len(converter.target_patterns) != 1
            or any(not keyed for keyed in lists) or (ops == stack and len(lists) != 1)):
        names = ", ".join(_op_name(op) for op in converter.operations)
        raise NotSliceable(f"checkpoint key {first!r} is converted on load ({names} -> {name!r}), "
                           "which is not a plain stacking of whole tensors")
    missing = [k for keyed in lists for k in keyed if k not in where]
    if missing:
        raise NotSliceable(f"checkpoint key {missing[0]!r} is not in the safetensors headers")
    tensors = [[where[k] for k in keyed] for keyed in lists]
    if ops == join:  # the sources one after another
        parts = [t for keyed in tensors for t in keyed]
        fits = len({t.shape[1:] for t in parts}) == 1
        wanted = (sum(t.shape[0] for t in parts), *parts[0].shape[1:])
    else:  # expert by expert: expert e's tensor of each source, in the sources' order
        experts = len(tensors[0])
        parts = [keyed[e] for e in range(experts) for keyed in tensors if e < len(keyed)]
        fits = all(len(keyed) == experts and len({t.shape for t in keyed}) == 1 for keyed in tensors) and (
            len({keyed[0].shape[1:] for keyed in tensors}) == 1)
        wanted = (experts, sum(keyed[0].shape[0] for keyed in tensors), *tensors[0][0].shape[1:])
        if ops == stack:
            wanted = (experts, *tensors[0][0].shape)
    if not fits or wanted != shape:
        raise NotSliceable(f"{first!r} and the {len(parts) - 1} checkpoint tensors converted with it do not "
                           f"stack to {name!r}'s shape {list(shape)}")
    return composed(f"{first} and {len(parts) - 1} more, stacked", shape, parts)


def _transposed(name: str, op: Any, stored: FileTensor, shape: tuple[int, ...]) -> FileTensor:
    """The model tensor `name` that transformers' `Transpose(dim0, dim1)` makes of `stored`: the
    file's tensor itself where the shapes already agree (what `check_dims` leaves alone: a
    checkpoint saved by transformers 5), else the file's tensor read with those dims swapped,
    where neither is dim 0 (whose rows then keep their bytes together)."""
    if stored.shape == shape and getattr(op, "check_dims", False):
        return stored
    a, b = sorted(d % len(stored.shape) for d in (op.dim0, op.dim1))
    if a == 0 or a == b:
        raise NotSliceable(f"checkpoint key {stored.key!r} is converted on load ({_op_name(op)} -> {name!r}), "
                           "which moves dim 0: its rows are not one range in the file")
    turned = replace(stored, shape=shape, transposed=(a, b))
    if turned.stored_shape != stored.shape:
        raise NotSliceable(f"{stored.key!r} has shape {list(stored.shape)}; transposed ({a}, {b}) it is not "
                           f"{name!r}'s shape {list(shape)}")
    return turned


def _op_name(op: Any) -> str:
    if hasattr(op, "dim0"):
        return f"{type(op).__name__}({op.dim0}, {op.dim1})"
    dim = getattr(op, "dim", None)
    return type(op).__name__ + ("" if dim is None else f"(dim={dim})")


def _add(keymap: dict[str, FileTensor], name: str, key: str, where: dict[str, FileTensor], shape: tuple) -> None:
    if key not in where:
        raise NotSliceable(f"checkpoint key {key!r} is not in the safetensors headers")
    if name in keymap:
        raise NotSliceable(f"checkpoint keys {keymap[name].key!r} and {key!r} both map to {name!r}")
    if where[key].shape != shape:
        raise NotSliceable(f"{key!r} has shape {list(where[key].shape)}, the model {list(shape)}")
    keymap[name] = where[key]


# ---- transformers 4.x -------------------------------------------------------------------------


def _load_shard_file_4x(original: Callable[..., Any], capture: Capture) -> Callable[..., Any]:
    """Twin of 4.x `load_shard_file(args)`: the same tuple in, `(error_msgs, disk_offload_index)` out."""
    import transformers.modeling_utils as mu

    def load_shard_file(args: tuple) -> tuple[list[str], Any]:
        shard_file, state_dict, _, is_quantized, device_map, _, renaming, _, model, _, _, offload_index, fp32_regex = args[:13]
        if state_dict is not None or not str(shard_file).endswith(".safetensors"):
            raise NotSliceable("the weights are not in safetensors checkpoint files")
        if is_quantized:
            raise NotSliceable("the checkpoint is quantized")
        if device_map is not None and "disk" in device_map.values():
            raise NotSliceable("device_map offloads weights to disk")
        if capture.files is None:
            raise NotSliceable("the weights are not in safetensors checkpoint files")
        keymap = capture.keymap if capture.keymap is not None else {}
        where = read_headers([shard_file])
        for key in sorted(where):
            name = renaming.get(key)
            if name is None:
                continue  # unexpected or mismatched: transformers reports and ignores it
            current = model.get_parameter_or_buffer(name)
            _add(keymap, name, key, where, tuple(current.shape))
            stored = torch.empty(where[key].shape, dtype=where[key].dtype, device="meta")
            _, cast = mu._infer_parameter_dtype(model, name, stored, fp32_regex, None)
            mu._load_parameter_into_model(model, name, stored if cast is None else stored.to(cast))
        capture.keymap = keymap
        return [], offload_index

    return load_shard_file
