"""Reused host buffers for offloaded activations, with a byte cap.

Why a pool: allocating pinned memory (`cudaHostAlloc`) synchronises the device, so pinning on
the fly in every forward would serialise the copy streams with compute (torchtitan's reason for
its slab pool). Shapes repeat from step to step, so blocks keyed by rounded size are reused from
the second step on and the pool stops growing. With variable sequence lengths a request takes the
smallest idle block of up to twice its size, so blocks of nearby sizes do not pile up.

Why a cap: host RAM is finite too. Past `max_bytes` the pool first drops idle blocks of other
sizes; if that is not enough, `acquire` returns None and the caller keeps the tensor on the
device (a slower step beats an OOM-killed host).

Reuse across streams: a block last read by a device reload carries that reload's event in
`ready`; the next writer waits on it on the device (no host sync). Freeing a pinned block is safe
at any time: torch's caching host allocator itself waits for the copies that used it.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from fsdp_offload_cfg.offload.stats import POOL

_GRAIN = 512  # bytes; sizes are rounded up to this so near-equal shapes share blocks


def round_size(nbytes: int) -> int:
    return (nbytes + _GRAIN - 1) // _GRAIN * _GRAIN


class HostBlock:
    """One host buffer; `ready` is the device event its last reader recorded (CUDA only)."""

    __slots__ = ("ready", "size", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.size = tensor.numel()
        self.ready: torch.cuda.Event | None = None


class HostPool:
    """Size-bucketed free lists of host byte buffers (pinned when the compute device is CUDA)."""

    def __init__(self, pinned: bool, max_bytes: int | None = None) -> None:
        self.pinned = pinned
        self.max_bytes = max_bytes
        self.total_bytes = 0  # in use + idle
        self._free: defaultdict[int, list[HostBlock]] = defaultdict(list)
        self._closed = False

    def acquire(self, nbytes: int) -> HostBlock | None:
        """A block of at least `nbytes`, or None when the cap forbids it."""
        size = round_size(nbytes)
        fit = self._best_fit(size)
        if fit is not None:
            return self._free[fit].pop()
        if not self._make_room(size):
            return None
        tensor = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        self._grow(size)
        return HostBlock(tensor)

    def _best_fit(self, size: int) -> int | None:
        """Smallest idle size in [size, 2*size): with variable sequence lengths, idle blocks of
        nearby sizes are reused instead of piling up (waste bounded by 2x)."""
        fits = [s for s, blocks in self._free.items() if blocks and size <= s < 2 * size]
        return min(fits, default=None)

    def release(self, block: HostBlock) -> None:
        """Give a block back; after `close()` it is dropped instead."""
        if self._closed:
            self._grow(-block.size)
        else:
            self._free[block.size].append(block)

    def idle_bytes(self) -> int:
        return sum(b.size for blocks in self._free.values() for b in blocks)

    def close(self) -> None:
        """Drop idle blocks now and blocks still in use when they come back."""
        self._closed = True
        self._drop_idle(self.total_bytes)

    def _make_room(self, size: int) -> bool:
        if self.max_bytes is None:
            return True
        excess = self.total_bytes + size - self.max_bytes
        if excess > 0:
            self._drop_idle(excess)
        return self.total_bytes + size <= self.max_bytes

    def _drop_idle(self, nbytes: int) -> None:
        """Free idle blocks, largest first, until `nbytes` are released or none are left."""
        for size in sorted(self._free, reverse=True):
            blocks = self._free[size]
            while blocks and nbytes > 0:
                blocks.pop()
                self._grow(-size)
                nbytes -= size
        for size in [s for s, b in self._free.items() if not b]:
            del self._free[size]

    def _grow(self, delta: int) -> None:
        self.total_bytes += delta
        if delta > 0:
            POOL.add(delta)
        else:
            POOL.sub(-delta)
