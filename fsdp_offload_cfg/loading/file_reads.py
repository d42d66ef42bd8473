"""Reading a checkpoint tensor's bytes (`FileTensor`) from its safetensors files.

Every read is an `os.preadv` into a buffer the caller owns (why not mmap: see `sharded.py`). A
composed tensor (one model tensor transformers builds from several checkpoint tensors, such as
MoE experts stacked on load: `checkpoint_reading.map_keys_5x`) reads part by part, from
whichever files its parts are in, so its readers need not know it is one.
"""

from __future__ import annotations

import math
import os
from types import TracebackType

import torch

from fsdp_offload_cfg.loading.layout import Region
from fsdp_offload_cfg.safetensors_index import FileTensor, byte_pieces, rows_view


class OpenFiles:
    """The files one load reads, each opened once (in the order first read) and closed on exit."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def fd(self, path: str) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    @property
    def paths(self) -> list[str]:
        return list(self._fds)

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def read_range(files: OpenFiles, where: FileTensor, into: memoryview, start: int) -> None:
    """Bytes `start` to `start + len(into)` of `where` (row-major, as stored) into `into`."""
    done = 0
    for path, offset, nbytes in byte_pieces(where, start, len(into)):
        _pread(files.fd(path), into[done:done + nbytes], offset, path)
        done += nbytes


def read_whole(where: FileTensor) -> torch.Tensor:
    """The whole tensor, in the file's dtype, in the model's layout, contiguous as a plain load
    holds it (transformers' `Transpose` copies too)."""
    raw = torch.empty(math.prod(where.shape) * where.dtype.itemsize, dtype=torch.uint8)
    with OpenFiles() as files:
        read_range(files, where, as_bytes(raw), 0)
    return rows_view(raw, where, where.shape).contiguous()


def read_region(where: FileTensor, region: Region) -> torch.Tensor:
    """`where[region]`, in the file's dtype: one range where the region is contiguous (FSDP2's
    dim-0 shards always are), else safetensors' slicing (a composed or transposed tensor: read
    whole, then indexed, as no placement FSDP2 makes by default asks for it)."""
    byte_range = file_range(region, where)
    shape = tuple(s.stop - s.start for s in region)
    if byte_range is not None:
        raw = torch.empty(byte_range[1], dtype=torch.uint8)
        with OpenFiles() as files:
            read_range(files, where, as_bytes(raw), byte_range[0])
        return rows_view(raw, where, shape)
    if where.parts or where.transposed:
        return read_whole(where)[region]
    from safetensors import safe_open

    with safe_open(where.path, framework="pt") as f:
        return f.get_slice(where.key)[region]


def file_range(region: Region, where: FileTensor) -> tuple[int, int] | None:
    """(byte offset, bytes) of `where[region]` in the file, if it is one range there. For a
    transposed tensor only whole dim-0 rows are (their bytes are the same in both layouts)."""
    if where.transposed is not None and any(s.start != 0 or s.stop != n for s, n in zip(region[1:], where.shape[1:])):
        return None
    return contiguous_range(region, where.shape, where.dtype.itemsize)


def contiguous_range(region: Region, shape: tuple[int, ...], itemsize: int) -> tuple[int, int] | None:
    """(byte offset, bytes) of `region` in a row-major tensor of `shape`, if it is one range."""
    lengths = [s.stop - s.start for s in region]
    first_long = next((i for i, n in enumerate(lengths) if n != 1), len(shape))
    if any(region[i].start != 0 or region[i].stop != shape[i] for i in range(first_long + 1, len(shape))):
        return None
    stride, start = 1, 0
    for s, n in zip(reversed(region), reversed(shape)):
        start += s.start * stride
        stride *= n
    numel = 1
    for n in lengths:
        numel *= n
    return start * itemsize, numel * itemsize


def _pread(fd: int, into: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:]], offset + done)
        if n <= 0:
            raise OSError(f"{path}: unexpected end of file at byte {offset + done} (truncated?)")
        done += n
