"""Where each tensor's bytes are in a safetensors file, read from its header alone.

Kept free of transformers so that both the loader and the per-version interception code
(`compat.checkpoint_reading`) can use it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from dataclasses import dataclass

import torch

# safetensors dtype names (https://github.com/huggingface/safetensors, `Dtype`)
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}  # fmt: skip


class NotSliceable(Exception):
    """The checkpoint cannot be read slice by slice; `reason` says why (one line)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class FileTensor:
    """Where one tensor's bytes are: `offset` is absolute in the file, row-major, `dtype` as stored.

    `via`: the other float dtypes the model's tensor held, in order, between the file and the
    shard (the dtype transformers loaded it in, then each cast before prepare). A plain load
    rounds at each of them: a float32 checkpoint loaded in bfloat16 and upcast to float32 master
    weights holds bfloat16 values, so a read casts through them too (`converted`)."""

    path: str
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    via: tuple[torch.dtype, ...] = ()
    # a model tensor transformers builds from several checkpoint tensors whose bytes, one after
    # the other, are its own row-major bytes (`composed`): MoE experts stacked, gate and up
    # concatenated per expert. `path` and `offset` are then the first part's (the read order).
    parts: tuple[FileTensor, ...] = ()
    # two dims (neither 0) of `shape` that the file stores swapped: transformers transposes them
    # on load (Qwen3-VL-MoE's experts, stored `[E, hidden, 2 * intermediate]`). Dim-0 rows keep
    # their bytes in one range, so a rank still reads only its own experts, and turns each row
    # after the read (`rows_view`).
    transposed: tuple[int, int] | None = None

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape in the file (`shape`, the model's, with `transposed` swapped back)."""
        return _swapped(self.shape, self.transposed)

    def held_as(self, dtype: torch.dtype) -> FileTensor:
        """This tensor, after the model's tensor was cast to `dtype` (float to float only)."""
        last = self.via[-1] if self.via else self.dtype
        if dtype == last or not (dtype.is_floating_point and last.is_floating_point):
            return self
        return dataclasses.replace(self, via=(*self.via, dtype))


def composed(key: str, shape: tuple[int, ...], parts: list[FileTensor]) -> FileTensor:
    """One tensor of `shape` whose row-major bytes are the whole `parts` in order; raises
    `NotSliceable` unless they share a dtype and their elements add up to `shape`."""
    dtypes = {p.dtype for p in parts}
    numel = sum(math.prod(p.shape) for p in parts)
    if len(dtypes) != 1 or numel != math.prod(shape):
        raise NotSliceable(f"{key}: the checkpoint tensors it is built from ({len(parts)}, dtypes "
                           f"{sorted(map(str, dtypes))}) do not make up its shape {list(shape)}")
    first = parts[0]
    return FileTensor(first.path, key, first.dtype, tuple(shape), first.offset, parts=tuple(parts))


def byte_pieces(where: FileTensor, start: int, nbytes: int) -> list[tuple[str, int, int]]:
    """(path, absolute file offset, bytes) of bytes `start` to `start + nbytes` of the tensor
    `where`, in order: one piece for a tensor stored whole, one per part touched for a composed
    one (parts may lie in different files)."""
    if not where.parts:
        return [(where.path, where.offset + start, nbytes)]
    pieces, begin = [], 0
    for part in where.parts:
        size = math.prod(part.shape) * part.dtype.itemsize
        lo, hi = max(start, begin), min(start + nbytes, begin + size)
        if lo < hi:
            pieces.append((part.path, part.offset + lo - begin, hi - lo))
        begin += size
    return pieces


def rows_view(raw: torch.Tensor, where: FileTensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Whole dim-0 rows of `where` as read from the file (bytes, or values in the file's dtype),
    viewed in the model's layout as `shape` (`shape[0]` rows): a view, transposed where the file
    stores two dims swapped (`FileTensor.transposed`)."""
    values = raw.view(where.dtype)
    if where.transposed is None:
        return values.view(shape)
    return values.view(_swapped(shape, where.transposed)).transpose(*where.transposed)


def _swapped(shape: tuple[int, ...], dims: tuple[int, int] | None) -> tuple[int, ...]:
    if dims is None:
        return tuple(shape)
    out = list(shape)
    out[dims[0]], out[dims[1]] = out[dims[1]], out[dims[0]]
    return tuple(out)


def converted(values: torch.Tensor, where: FileTensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` (in the file's dtype) cast as a plain load casts them: through each dtype of
    `where.via`, then to `dtype`."""
    for step in where.via:
        values = values.to(step)
    return values.to(dtype)


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
        if entry["dtype"] not in DTYPES:
            raise NotSliceable(f"{key!r} has safetensors dtype {entry['dtype']}, which this reader does not know")
        out[key] = FileTensor(path, key, DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + n + begin)
    return out


def read_headers(files: list[str]) -> dict[str, FileTensor]:
    where: dict[str, FileTensor] = {}
    for path in files:
        where.update(read_header(path))
    return where
