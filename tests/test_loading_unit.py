"""Single-process checks of the loader's pieces (no process group: these run in milliseconds)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from fsdp_offload_cfg.loading import is_rank0_source, load_into_sharded, rank0_from_pretrained, sharded_from_pretrained
from fsdp_offload_cfg.loading.broadcast import TransferStats, buckets
from fsdp_offload_cfg.loading.checkpoint import read_header
from fsdp_offload_cfg.loading.file_reads import contiguous_range, read_region, read_whole
from fsdp_offload_cfg.loading.layout import Target
from fsdp_offload_cfg.loading.prepare import RankLoad, summary_lines
from fsdp_offload_cfg.loading.sharded import ReadStats, read_own_shards
from fsdp_offload_cfg.loading.spec import TensorSpec, describe, meta_tensor_names, mismatch, rebuild_on_meta


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("ids", torch.arange(4))
        self.register_buffer("flags", torch.ones(2, dtype=torch.bool), persistent=False)


def test_strategies_without_process_group() -> None:
    model = Tied()
    report = load_into_sharded(model, lambda m: None, strategy="sharded")
    assert report.model is model and (report.sent, report.read) == (None, None)  # no process group: no transfer
    with pytest.raises(ValueError, match="unknown load strategy"):
        load_into_sharded(Tied(), lambda m: m, strategy="scatter")  # type: ignore[arg-type]
    calls = []
    sharded_from_pretrained(lambda cls, *a, **k: calls.append((cls, a, k)), Tied, "p", dtype=torch.bfloat16)
    assert calls == [(Tied, ("p",), {"dtype": torch.bfloat16})]


def test_without_process_group_everything_is_the_original() -> None:
    calls = []

    def original(cls, *args, **kwargs):
        calls.append((cls, args, kwargs))
        return Tied()

    model = rank0_from_pretrained(original, Tied, "some/path", dtype=torch.float32)
    assert calls == [(Tied, ("some/path",), {"dtype": torch.float32})]
    assert not is_rank0_source(model) and meta_tensor_names(model) == []
    assert load_into_sharded(model, lambda m: None).model is model


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
    whole = Target(spec, local, regions)
    assert whole.split(24, rank=1) == [whole]  # fits: itself (not a dataclass compare: on Python 3.13+ that
    # compares field by field, and a tensor field's `==` has no truth value)


def test_contiguous_range_of_regions() -> None:
    shape = (5, 3, 4)
    rows = (slice(2, 4), slice(0, 3), slice(0, 4))  # FSDP2 Shard(0): one byte range
    assert contiguous_range(rows, shape, 2) == (2 * 12 * 2, 2 * 12 * 2)
    inner = (slice(1, 2), slice(1, 3), slice(0, 4))  # one row, then a range of the next dim
    assert contiguous_range(inner, shape, 4) == ((12 + 4) * 4, 8 * 4)
    assert contiguous_range((slice(0, 5), slice(0, 3), slice(1, 3)), shape, 4) is None
    assert contiguous_range((), (), 8) == (0, 8)


def test_reader_reads_own_slices_casts_and_bounds_reads(tmp_path) -> None:
    from safetensors.torch import save_file

    tensors = {
        "w": torch.randn(9, 6).to(torch.bfloat16),  # bf16 on disk, fp32 in the model
        "ids": torch.arange(7, dtype=torch.int64),
        "cols": torch.randn(4, 6),  # read through get_slice: a column range is not contiguous
    }
    save_file(tensors, str(tmp_path / "m.safetensors"))
    where = read_header(str(tmp_path / "m.safetensors"))
    regions = {  # this is rank 1 of 2
        "w": ((slice(0, 5), slice(0, 6)), (slice(5, 9), slice(0, 6))),
        "ids": ((slice(0, 7),), (slice(0, 7),)),
        "cols": ((slice(0, 4), slice(0, 3)), (slice(0, 4), slice(3, 6))),
    }
    dests = {"w": torch.empty(4, 6), "ids": torch.empty(7, dtype=torch.int64), "cols": torch.empty(4, 3)}
    targets = [
        Target(TensorSpec((n,), dests[n].dtype, tuple(tensors[n].shape), True), dests[n], regions[n]) for n in tensors
    ]
    stats = read_own_shards(targets, where, rank=1, bucket_bytes=16)
    assert torch.equal(dests["w"], tensors["w"][5:9].float())
    assert torch.equal(dests["ids"], tensors["ids"]) and torch.equal(dests["cols"], tensors["cols"][:, 3:])
    assert stats.largest_read <= 24 and stats.bytes_read == 4 * 6 * 2 + 7 * 8 + 4 * 3 * 4


def test_read_header_names_a_truncated_file(tmp_path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(64)}, str(path))
    os.truncate(path, path.stat().st_size - 8)
    with pytest.raises(OSError, match=r"m\.safetensors: truncated"):
        read_header(str(path))


@pytest.mark.parametrize("switch, wanted", [(None, True), ("True", True), ("1", True), ("False", False), ("0", False)])
def test_rank0_loading_follows_accelerates_switch_not_the_loaders_own_gate(monkeypatch, switch, wanted):
    """`disable_/enable_fsdp_ram_efficient_loading()` set the variable; the loader's own gate-off
    (for transformers, during a sharded meta load) holds it at "false" without being the user's
    switch; `local_loading()` always steps aside."""
    from fsdp_offload_cfg.loading.local import local_loading, rank0_loading_wanted, transformers_fsdp_gate_off

    if switch is None:
        monkeypatch.delenv("FSDP_CPU_RAM_EFFICIENT_LOADING", raising=False)
    else:
        monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", switch)
    assert rank0_loading_wanted() is wanted
    with transformers_fsdp_gate_off():
        assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "false"
        assert rank0_loading_wanted() is wanted
        with local_loading():
            assert rank0_loading_wanted() is False
        assert rank0_loading_wanted() is wanted
    assert os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING") == switch


# ---- MoE experts stacked on load (transformers 5's `MergeModulelist`, `Concatenate`) --------------


def _experts_in_two_files(root: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[str]]:
    """3 experts' gate and up weights, expert 0's up in the first file and the rest of up in a
    second: a stacked tensor whose parts cross files and interleave between them."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    gate = {f"experts.{e}.gate.weight": torch.randn(2, 3, generator=gen) for e in range(3)}
    up = {f"experts.{e}.up.weight": torch.randn(2, 3, generator=gen) for e in range(3)}
    files = [os.path.join(root, "a.safetensors"), os.path.join(root, "b.safetensors")]
    save_file({**gate, "experts.0.up.weight": up["experts.0.up.weight"]}, files[0])
    save_file({k: v for k, v in up.items() if k != "experts.0.up.weight"}, files[1])
    return gate, up, files


class _Experts(nn.Module):
    def __init__(self, shape: tuple[int, ...] = (3, 4, 3)) -> None:
        super().__init__()
        self.experts = nn.Module()
        self.experts.gate_up = nn.Parameter(torch.empty(shape))


def _gate_up(*extra_ops: object) -> object:
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    return WeightConverter(source_patterns=["experts.*.gate.weight", "experts.*.up.weight"],
                           target_patterns="experts.gate_up",
                           operations=[MergeModulelist(dim=0), Concatenate(dim=1), *extra_ops])


def test_experts_stacked_on_load_read_as_their_parts_across_files(tmp_path) -> None:
    """What transformers 5 builds, `cat([stack(gates), stack(ups)], dim=1)`, read from the files
    part by part: whole, and one expert's rows (a rank's dim-0 shard), with the bytes it needs."""
    pytest.importorskip("transformers.core_model_loading")
    from fsdp_offload_cfg.compat.checkpoint_reading import map_keys_5x
    from fsdp_offload_cfg.safetensors_index import byte_pieces

    gate, up, files = _experts_in_two_files(str(tmp_path))
    where = map_keys_5x(_Experts(), {**gate, **up}, [_gate_up()], files)["experts.gate_up"]
    built = torch.cat([torch.stack(list(gate.values())), torch.stack(list(up.values()))], dim=1)
    assert torch.equal(read_whole(where), built)
    assert torch.equal(read_region(where, (slice(1, 2), slice(0, 4), slice(0, 3))), built[1:2])
    expert_1 = byte_pieces(where, 4 * 3 * 4, 4 * 3 * 4)  # expert 1: its gate (file a), then its up (file b)
    assert [(os.path.basename(path), n) for path, _, n in expert_1] == [("a.safetensors", 24), ("b.safetensors", 24)]
    straddling = byte_pieces(where, 20, 8)  # the last 4 bytes of a part and the first 4 of the next
    assert [n for _, _, n in straddling] == [4, 4]


def test_conversions_other_than_stacking_are_not_read_slice_by_slice(tmp_path) -> None:
    """A transpose after stacking (or a count of experts or a shape that does not stack to the
    model's tensor) still falls back to rank 0, with the conversion named."""
    pytest.importorskip("transformers.core_model_loading")
    from transformers.core_model_loading import Transpose

    from fsdp_offload_cfg.compat.checkpoint_reading import map_keys_5x
    from fsdp_offload_cfg.safetensors_index import NotSliceable

    gate, up, files = _experts_in_two_files(str(tmp_path))
    with pytest.raises(NotSliceable, match=r"experts.0.gate.weight.*MergeModulelist\(dim=0\), Concatenate\(dim=1\), "
                                           r"Transpose\(1, 2\) -> 'experts.gate_up'"):
        map_keys_5x(_Experts(), {**gate, **up}, [_gate_up(Transpose(1, 2))], files)
    with pytest.raises(NotSliceable, match=r"do not stack to 'experts.gate_up'.s shape \[3, 4, 3\]"):
        map_keys_5x(_Experts(), {**gate, **{k: v for k, v in up.items() if ".2." not in k}}, [_gate_up()], files)
    with pytest.raises(NotSliceable, match=r"do not stack to 'experts.gate_up'.s shape \[3, 3, 4\]"):
        map_keys_5x(_Experts((3, 3, 4)), {**gate, **up}, [_gate_up()], files)


# ---- experts stored transposed (transformers 5's `Transpose(1, 2)`: Qwen3-VL-MoE) ---------------


def _stored_transposed(root: str, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, list[str]]:
    """5 experts stored `[E, hidden=3, 2 * intermediate=4]`, as Qwen3-VL-MoE's hub files are."""
    from safetensors.torch import save_file

    stored = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(1)).to(dtype)
    files = [os.path.join(root, "m.safetensors")]
    save_file({"pad": torch.zeros(7), "experts.gate_up": stored}, files[0])
    return stored, files


def _transpose(dim0: int, dim1: int, check_dims: bool = True) -> object:
    from transformers.core_model_loading import Transpose, WeightConverter

    return WeightConverter(source_patterns="experts.gate_up", target_patterns="experts.gate_up",
                           operations=[Transpose(dim0, dim1, check_dims=check_dims)])


def test_experts_stored_transposed_are_read_by_rows_and_turned(tmp_path) -> None:
    """A rank reads its own experts' bytes (one range: rows keep their bytes together) and turns
    each: whole, by rows, a region that is not whole rows, in blocks of a row with a cast on the
    way, and as rank 0 streams it (`FileSlice`), each equal to what transformers builds."""
    pytest.importorskip("transformers.core_model_loading")
    from fsdp_offload_cfg.compat.checkpoint_reading import map_keys_5x
    from fsdp_offload_cfg.loading.sharded import FileSlice

    stored, files = _stored_transposed(str(tmp_path), torch.bfloat16)
    where = map_keys_5x(_Experts((5, 4, 3)), {"experts.gate_up": None}, [_transpose(1, 2)], files)["experts.gate_up"]
    built = stored.transpose(1, 2).contiguous()  # transformers' Transpose(1, 2)
    assert where.transposed == (1, 2) and where.shape == (5, 4, 3) and where.stored_shape == (5, 3, 4)
    assert torch.equal(read_whole(where), built) and read_whole(where).is_contiguous()  # as a tensor used early
    assert torch.equal(read_region(where, (slice(1, 3), slice(0, 4), slice(0, 3))), built[1:3])
    assert torch.equal(read_region(where, (slice(1, 3), slice(1, 3), slice(0, 2))), built[1:3, 1:3, :2])
    regions = ((slice(0, 3), slice(0, 4), slice(0, 3)), (slice(3, 5), slice(0, 4), slice(0, 3)))
    for dtype in (torch.bfloat16, torch.float32):  # straight into the shard were it not transposed; cast
        dest = torch.empty(2, 4, 3, dtype=dtype)
        target = Target(TensorSpec(("experts.gate_up",), dtype, (5, 4, 3), True), dest, regions)
        stats = read_own_shards([target], {"experts.gate_up": where}, rank=1, bucket_bytes=24)  # a row a block
        assert torch.equal(dest, built[3:].to(dtype)) and stats.reads == 2 and stats.bytes_read == 2 * 12 * 2
    sent = torch.empty(2 * 12 * 4, dtype=torch.uint8)
    assert FileSlice(where, torch.float32).read_into(regions[1], sent) == 2 * 12 * 2
    assert torch.equal(sent.view(torch.float32).view(2, 4, 3), built[3:].float())


def test_a_transpose_already_applied_or_of_dim_0_is_told_apart(tmp_path) -> None:
    """A file already in the model's layout (saved by transformers 5, which `check_dims` leaves
    alone) is read as it is; a transpose that moves dim 0 still falls back, named."""
    pytest.importorskip("transformers.core_model_loading")
    from fsdp_offload_cfg.compat.checkpoint_reading import map_keys_5x
    from fsdp_offload_cfg.safetensors_index import NotSliceable

    stored, files = _stored_transposed(str(tmp_path))
    as_is = map_keys_5x(_Experts((5, 3, 4)), {"experts.gate_up": None}, [_transpose(1, 2)], files)["experts.gate_up"]
    assert as_is.transposed is None and torch.equal(read_whole(as_is), stored)
    with pytest.raises(NotSliceable, match=r"Transpose\(0, 1\) -> 'experts.gate_up'.*moves dim 0"):
        map_keys_5x(_Experts((3, 5, 4)), {"experts.gate_up": None}, [_transpose(0, 1, False)], files)
    with pytest.raises(NotSliceable, match=r"transposed \(1, 2\) it is not 'experts.gate_up'.s shape \[5, 4, 4\]"):
        map_keys_5x(_Experts((5, 4, 4)), {"experts.gate_up": None}, [_transpose(1, 2)], files)


def test_rank0s_load_lines_count_one_file_and_one_bucket_in_the_singular() -> None:
    """A small model is one safetensors file, and its broadcast one bucket: the lines said "from 1
    files" and "in 1 buckets"."""
    loads = (RankLoad("host", 2**20, 0), RankLoad("host", 0, 2**20))
    one = summary_lines(TransferStats(tensors=1, bytes_to={1: 2**20}, buckets=1),
                        ReadStats(tensors=1, reads=1, bytes_read=2**20, files=["model.safetensors"]), loads)
    assert one == ["sharded loading: rank 0 read 1 tensor (1.0 MiB, 1 read) from 1 file in 0.00s",
                   "rank-0 loading: sent 1 tensor (1.0 MiB to rank 1) in 1 bucket in 0.00s"], one
    two = summary_lines(TransferStats(tensors=2, bytes_to={1: 2**20}, buckets=2),
                        ReadStats(tensors=2, reads=2, bytes_read=2**20, files=["a", "b"]), loads)
    assert "2 tensors (1.0 MiB, 2 reads) from 2 files" in two[0] and "in 2 buckets" in two[1], two


def test_ranks_are_named_with_the_noun_their_count_takes() -> None:
    """A 2-rank broadcast read "sent ... to ranks 1"; a lone waiting rank "for rank 1-3"."""
    from fsdp_offload_cfg.ranks import named_ranks

    assert (named_ranks([1]), named_ranks([3, 1, 2]), named_ranks([0, 1, 4])) == ("rank 1", "ranks 1-3", "ranks 0-1, 4")
    loads = (RankLoad("host", 0, 0), RankLoad("host", 0, 2**20), RankLoad("host", 0, 2**20))
    three = summary_lines(TransferStats(tensors=2, bytes_to={1: 2**20, 2: 2**20}, buckets=2), None, loads)
    assert three == ["rank-0 loading: sent 2 tensors (2.0 MiB to ranks 1-2) in 2 buckets in 0.00s"], three
