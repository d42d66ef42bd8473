"""Single-process checks of the loader's pieces (no process group: these run in milliseconds)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_offload_cfg.loading import is_rank0_source, load_into_sharded, rank0_from_pretrained
from fsdp_offload_cfg.loading.broadcast import buckets
from fsdp_offload_cfg.loading.layout import Target
from fsdp_offload_cfg.loading.spec import TensorSpec, describe, meta_tensor_names, mismatch, rebuild_on_meta


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("ids", torch.arange(4))
        self.register_buffer("flags", torch.ones(2, dtype=torch.bool), persistent=False)


def test_sharded_strategy_is_not_implemented_yet() -> None:
    with pytest.raises(NotImplementedError, match="load_strategy='sharded'"):
        load_into_sharded(Tied(), lambda m: m, strategy="sharded")
    with pytest.raises(ValueError, match="unknown load strategy"):
        load_into_sharded(Tied(), lambda m: m, strategy="scatter")  # type: ignore[arg-type]


def test_without_process_group_everything_is_the_original() -> None:
    calls = []

    def original(cls, *args, **kwargs):
        calls.append((cls, args, kwargs))
        return Tied()

    model = rank0_from_pretrained(original, Tied, "some/path", dtype=torch.float32)
    assert calls == [(Tied, ("some/path",), {"dtype": torch.float32})]
    assert not is_rank0_source(model) and meta_tensor_names(model) == []
    assert load_into_sharded(model, lambda m: None) is model


def test_describe_lists_every_tensor_with_all_its_names() -> None:
    spec = describe(Tied())
    assert [t.names for t in spec.tensors] == [("embed.weight", "head.weight"), ("flags",), ("ids",)]
    assert [t.dtype for t in spec.tensors] == [torch.float32, torch.bool, torch.int64]


def test_mismatch_names_missing_unexpected_and_non_float_casts() -> None:
    source = describe(Tied())
    model = Tied()
    model.extra = nn.Parameter(torch.zeros(2))
    del model._buffers["flags"]
    message = mismatch(source, describe(model), what="x")
    assert "missing from the source (rank 0): extra" in message
    assert "unexpected in the source (not in the model): flags" in message

    model = Tied()
    model.embed.weight.data = model.embed.weight.data.double()  # float -> float: cast on load
    model.ids = model.ids.int()  # int64 -> int32: never silently cast
    message = mismatch(source, describe(model), what="x", check_dtype=True)
    assert "ids torch.int64 -> torch.int32" in message and "embed" not in message

    untied = Tied()
    untied.head.weight = nn.Parameter(untied.embed.weight.detach().clone())
    assert "tied differently" in mismatch(source, describe(untied), what="x")
    assert mismatch(source, describe(untied), what="x", check_ties=False) is None


def test_rebuild_on_meta_keeps_ties_dtypes_and_frees_storage() -> None:
    model = Tied()
    model.embed.weight.requires_grad_(False)
    spec = describe(model)
    rebuild_on_meta(model, spec)
    assert model.head.weight is model.embed.weight and model.embed.weight.is_meta
    assert not model.embed.weight.requires_grad
    assert sorted(meta_tensor_names(model)) == ["embed.weight", "flags", "ids"]
    assert describe(model) == spec


def _target(name: str, nbytes: int) -> Target:
    spec = TensorSpec((name,), torch.uint8, (nbytes,), False)
    return Target(spec, torch.empty(nbytes, dtype=torch.uint8), ((slice(0, nbytes),),))


def test_buckets_are_bounded_and_keep_order() -> None:
    targets = [_target(n, s) for n, s in [("a", 40), ("b", 50), ("c", 200), ("d", 10), ("e", 95)]]
    grouped = [[(t.spec.name, t.block, t.last) for t in b] for b in buckets(targets, 100)]
    assert grouped == [
        [("a", 0, True), ("b", 0, True)],
        [("c", 0, False)],  # larger than a bucket: split into blocks
        [("c", 1, True)],
        [("d", 0, True)],
        [("e", 0, True)],
    ]


def test_blocks_cut_every_ranks_region_alike() -> None:
    spec = TensorSpec(("w",), torch.float32, (5, 2), True)
    regions = ((slice(0, 3), slice(0, 2)), (slice(3, 5), slice(0, 2)))  # Shard(0) of 5 rows on 2 ranks
    local = torch.arange(4.0).reshape(2, 2)  # rank 1's shard: rows 3 and 4
    blocks = Target(spec, local, regions).split(16, rank=1)  # parts of at most ~16 bytes (2 rows)
    assert [b.regions[0][0] for b in blocks] == [slice(0, 2), slice(2, 3)]
    assert [b.regions[1][0] for b in blocks] == [slice(3, 4), slice(4, 5)]
    assert [b.dest.tolist() for b in blocks] == [[[0.0, 1.0]], [[2.0, 3.0]]]
    assert [b.max_part_nbytes for b in blocks] == [16, 8]
    rank0 = Target(spec, torch.zeros(3, 2), regions).split(16, rank=0)
    assert [tuple(b.dest.shape) for b in rank0] == [(2, 2), (1, 2)]
    assert Target(spec, local, regions).split(24, rank=1) == [Target(spec, local, regions)]
