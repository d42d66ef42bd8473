"""Which part of each full tensor every rank holds after sharding.

A `Target` pairs a tensor's spec (as rank 0 holds it) with this rank's destination and, for every
global rank, the region of the full tensor that rank owns. Every rank computes the same plan
from the DTensor layouts alone (no communication). The broadcast strategy uses all regions
(rank 0 cuts the full tensor per rank); a per-rank reader (strategy "sharded") only needs its
own region, e.g. `safe_open(...).get_slice(name)[region]`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from fsdp_offload_cfg.loading.spec import ModelSpec, TensorSpec, named_tensors

if TYPE_CHECKING:  # imported where used: DTensor brings sympy, 2 CPU-s of a launcher that never loads (registry.Plan)
    from torch.distributed.tensor import DTensor

Region = tuple[slice, ...]


@dataclass(frozen=True)
class Copies:
    """The ranks holding the same slice of a tensor as this rank, in replica order."""

    group: dist.ProcessGroup  # the mesh's group along the Replicate dim: these ranks
    ranks: tuple[int, ...]  # global ranks; index k is replica k


def copies_of(t: torch.Tensor) -> Copies | None:
    """The replica group of `t`'s slice on this rank; None unless `t` is a DTensor replicated
    along exactly one mesh dim of more than one rank (HSDP)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return None
    dims = [d for d, p in enumerate(t.placements) if isinstance(p, Replicate)]
    if len(dims) != 1 or t.device_mesh.size(dims[0]) == 1:
        return None
    group = t.device_mesh.get_group(dims[0])
    return Copies(group, tuple(dist.get_process_group_ranks(group)))


def _numel(region: Region) -> int:
    numel = 1
    for s in region:
        numel *= s.stop - s.start
    return numel


@dataclass(frozen=True)
class Target:
    """One tensor, or one block of it (`block` of `blocks`), to fill on every rank."""

    spec: TensorSpec  # name, dtype and shape of the whole source tensor (rank 0's)
    dest: torch.Tensor  # this rank's storage to fill: (a block of) its shard, or the tensor
    regions: tuple[Region, ...]  # regions[r]: the part of the full tensor global rank r gets
    block: int = 0
    blocks: int = 1
    # the ranks that get it from rank 0 (None: every rank): a rank that reads a tensor from the
    # files itself takes no part in its transfer, so rank 0 sends nothing to it
    to: frozenset[int] | None = None
    copies: Copies | None = None  # the ranks holding the same slice (HSDP replicas): `replicas.py`

    @property
    def last(self) -> bool:
        """The source tensor is no longer needed once this target is sent."""
        return self.block == self.blocks - 1

    def nbytes_on(self, rank: int) -> int:
        """Bytes of rank `rank`'s part, in the source dtype."""
        return _numel(self.regions[rank]) * self.spec.dtype.itemsize

    def sent_nbytes(self, rank: int) -> int:
        """Bytes rank 0 sends rank `rank` of it: its part, or 0 when it fills this tensor itself."""
        return self.nbytes_on(rank) if self.to is None or rank in self.to else 0

    @property
    def max_part_nbytes(self) -> int:
        return max(self.sent_nbytes(r) for r in range(len(self.regions)))

    def split(self, max_bytes: int, rank: int) -> list[Target]:
        """Blocks whose part on every rank is at most about `max_bytes`, so no transfer buffer
        ever needs a whole large tensor (an embedding can be GiBs). Block k holds the k-th
        dim-0 chunk of *every* rank's region: all ranks' parts shrink together, which keeps
        the equal-size scatter buffers free of padding."""
        if not self.spec.shape:
            return [self]
        rows = max(r[0].stop - r[0].start for r in self.regions)
        blocks = min(rows, -(-self.max_part_nbytes // max_bytes))
        if blocks <= 1:
            return [self]
        return [self._block(k, blocks, rank) for k in range(blocks)]

    def _block(self, k: int, blocks: int, rank: int) -> Target:
        regions, dest = [], self.dest
        for r, region in enumerate(self.regions):
            first, n = region[0].start, region[0].stop - region[0].start
            chunk = -(-n // blocks)
            lo, hi = min(k * chunk, n), min((k + 1) * chunk, n)
            regions.append((slice(first + lo, first + hi), *region[1:]))
            if r == rank:
                dest = self.dest.narrow(0, lo, hi - lo)
        return Target(self.spec, dest, tuple(regions), k, blocks, self.to, self.copies)


def _full(shape: tuple[int, ...]) -> Region:
    return tuple(slice(0, s) for s in shape)


def dtensor_regions(t: DTensor, world_size: int) -> tuple[Region, ...]:
    """Region of `t`'s full tensor held by each global rank (torch.chunk semantics of `Shard`)."""
    from torch.distributed.tensor import Replicate, Shard

    unsupported = [p for p in t.placements if not isinstance(p, (Shard, Replicate))]
    if unsupported or any(type(p) is not Shard and isinstance(p, Shard) for p in t.placements):
        raise NotImplementedError(f"placements {t.placements} are not supported (only Shard and Replicate)")
    mesh = t.device_mesh
    return _regions(tuple(t.shape), tuple(mesh.shape), _coordinates(mesh, world_size), tuple(t.placements))


def _coordinates(mesh: object, world_size: int) -> tuple[tuple[int, ...], ...]:
    """Each global rank's coordinate in `mesh` (cached on the mesh: a model has hundreds of
    tensors on one mesh, and `nonzero` per tensor and rank adds up to tenths of a second)."""
    cached = getattr(mesh, "_fsdp_offload_cfg_coordinates", None)
    if cached is not None and len(cached) == world_size:
        return cached
    coordinates = []
    for rank in range(world_size):
        coordinate = (mesh.mesh == rank).nonzero()
        if coordinate.numel() == 0:
            raise NotImplementedError(f"rank {rank} is not in the device mesh {mesh}: the mesh must span all ranks")
        coordinates.append(tuple(coordinate[0].tolist()))
    mesh._fsdp_offload_cfg_coordinates = tuple(coordinates)
    return tuple(coordinates)


@functools.lru_cache(maxsize=4096)
def _regions(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinates: tuple[tuple[int, ...], ...], placements: tuple
) -> tuple[Region, ...]:
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    regions = []
    for coordinate in coordinates:
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), placements)
        regions.append(tuple(slice(o, o + s) for o, s in zip(offset, local)))
    return tuple(regions)


def plan(model: nn.Module, spec: ModelSpec, rank: int, world_size: int) -> list[Target]:
    """One `Target` per tensor of `spec`, in `spec` order (sorted by name: the send order)."""
    from torch.distributed.tensor import DTensor

    named = dict(named_tensors(model))
    targets = []
    for s in spec.tensors:
        tensor = named[s.name]
        if isinstance(tensor, DTensor):
            regions = dtensor_regions(tensor, world_size)
            dest = tensor.to_local()
        else:
            regions = (_full(s.shape),) * world_size
            dest = tensor
        own = tuple(r.stop - r.start for r in regions[rank])
        if own != tuple(dest.shape):
            raise RuntimeError(f"{s.name}: local shard has shape {tuple(dest.shape)}, layout says {own}")
        targets.append(Target(s, dest, regions, copies=copies_of(tensor)))
    return targets
