"""A safetensors file written tensor by tensor, so that a writer holds one tensor at a time.

`safetensors.torch.save_file` takes every tensor of a file at once; a model gathered from its
shards for saving is then whole on the writer's host (an 8B model in float32: 30 GiB on rank 0,
for a file transformers 5 makes up to 50 GB). The format lets the header come first from shapes
and dtypes alone: an 8-byte little-endian length, a JSON header (`__metadata__`, then each tensor's
dtype, shape and byte range), padded with spaces to a multiple of 8, then the bytes in the
header's order. Tensors are laid out as safetensors lays them out (larger dtypes first, then by
name), which keeps every tensor aligned to its element size and makes the file byte for byte the
one `save_file` writes (tests/test_streamed_save.py checks both).
"""

from __future__ import annotations

import json
import struct
from typing import IO, Any

import torch

# safetensors' dtype names, in the order of its `Dtype` enum (the file lays out higher ones first)
_DTYPES: tuple[tuple[torch.dtype | None, str], ...] = (
    (torch.bool, "BOOL"), (torch.uint8, "U8"), (torch.int8, "I8"),
    (getattr(torch, "float8_e5m2", None), "F8_E5M2"), (getattr(torch, "float8_e4m3fn", None), "F8_E4M3"),
    (torch.int16, "I16"), (getattr(torch, "uint16", None), "U16"), (torch.float16, "F16"), (torch.bfloat16, "BF16"),
    (torch.int32, "I32"), (getattr(torch, "uint32", None), "U32"), (torch.float32, "F32"), (torch.float64, "F64"),
    (torch.int64, "I64"), (getattr(torch, "uint64", None), "U64"),
)  # fmt: skip
_NAME = {dtype: name for dtype, name in _DTYPES if dtype is not None}
_ORDER = {dtype: i for i, (dtype, _) in enumerate(_DTYPES) if dtype is not None}


def writable(dtype: torch.dtype) -> bool:
    """Whether this writer knows the dtype (a model in another, e.g. float8_e8m0, is saved whole)."""
    return dtype in _NAME


def layout(entries: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> list[str]:
    """The names (of name: dtype, shape) in the order their bytes follow the header: higher dtypes
    first, then by name."""
    return sorted(entries, key=lambda name: (-_ORDER[entries[name][0]], name))


def header(entries: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None) -> bytes:
    """The length prefix and JSON header of a file holding `entries` (name: dtype, shape), laid out
    in `layout` order."""
    fields: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in layout(entries):
        dtype, shape = entries[name]
        size = torch.Size(shape).numel() * dtype.itemsize
        fields[name] = {"dtype": _NAME[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(fields, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class FileWriter:
    """One file being written: the header at once, then each tensor's bytes as it comes, in
    `order`; a tensor is dropped as soon as its bytes are out."""

    def __init__(self, path: str, entries: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None) -> None:  # fmt: skip
        self.entries = entries
        self.order = layout(entries)
        self._next = 0  # index into `order` of the tensor the file takes next
        self._stream: IO[bytes] = open(path, "wb")  # noqa: SIM115 - held across append() calls; close() closes it
        self._stream.write(header(entries, metadata))

    def append(self, name: str, *parts: torch.Tensor) -> None:
        """The next tensor's bytes: the tensor, or its row blocks in order (a weight gathered from
        its row shards, written without joining them)."""
        expected = self.order[self._next]
        dtype, shape = self.entries[name]
        rows = sum(part.shape[0] if part.dim() else 1 for part in parts)
        fits = all(part.dtype == dtype and tuple(part.shape[1:]) == tuple(shape[1:]) for part in parts) and (
            rows == (shape[0] if shape else 1))
        if name != expected or not fits:
            got = ", ".join(f"{part.dtype} {tuple(part.shape)}" for part in parts)
            raise ValueError(f"{name} ({got}) written where the header has {expected} {dtype} {tuple(shape)}")
        for part in parts:
            self._stream.write(memoryview(part.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        self._stream.close()
