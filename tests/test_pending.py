"""`loading/pending.py` on one process: a checkpoint-backed meta tensor reads itself where its
values are used, in place, and nowhere else (the distributed shapes: test_script_shapes.py,
test_before_prepare.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from fsdp_offload_cfg.loading import pending
from fsdp_offload_cfg.loading.checkpoint import CheckpointRecord
from fsdp_offload_cfg.safetensors_index import read_header

WEIGHT = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
BIAS = torch.tensor([0.5, -1.0, 2.0])


@pytest.fixture
def layer(tmp_path) -> nn.Linear:
    """An `nn.Linear(4, 3)` on meta, both tensors pending on a one-file checkpoint."""
    path = str(tmp_path / "model.safetensors")
    save_file({"weight": WEIGHT, "bias": BIAS}, path)
    header = read_header(path)
    module = nn.Linear(4, 3, device="meta")
    record = CheckpointRecord((path,))
    record.add(module.weight, header["weight"])
    record.add(module.bias, header["bias"])
    pending.mark(module, record, "load test")
    return module


def _record(module: nn.Module) -> CheckpointRecord:
    return module.weight.__dict__[pending.KEY].record


def test_what_reads_no_value_reads_nothing(layer: nn.Linear) -> None:
    weight = layer.weight
    optimizer = torch.optim.AdamW(layer.parameters())  # built before prepare, as accelerate wants it
    assert weight.shape == (3, 4) and weight.dtype == torch.float32 and weight.is_meta and torch.is_floating_point(weight)
    weight.requires_grad_(False)
    assert torch.empty_like(weight).is_meta and weight.new_zeros(2).is_meta
    layer.to(torch.float64)  # a cast stays pending, as the same object
    layer.weight.data = layer.weight.data.to(torch.bfloat16)  # LlamaFactory's upcast, through `.data`
    assert layer.weight is weight and pending.is_pending(weight) and weight.dtype == torch.bfloat16
    assert _record(layer).read_early == 0 and optimizer.param_groups[0]["params"][0] is weight


def test_a_value_read_fills_that_tensor_alone_in_place(layer: nn.Linear) -> None:
    bias = layer.bias
    assert torch.equal(bias * 2, BIAS * 2)
    assert layer.bias is bias and type(bias) is nn.Parameter and not bias.is_meta
    assert pending.is_pending(layer.weight) and layer.weight.is_meta  # the other tensor is not read
    assert _record(layer).read_early == BIAS.numel() * 4 and _record(layer).lookup(bias) is None


def test_derived_tensors_read_their_source_then_apply_the_op(layer: nn.Linear) -> None:
    cast = layer.weight.data.to(torch.float64)  # derived twice, nothing read
    alias = layer.weight.detach()
    assert layer.weight.is_meta and pending.is_pending(cast)
    assert torch.equal(cast, WEIGHT.double())
    alias.mul_(0)  # an alias of the read tensor: the parameter sees the write
    assert torch.equal(layer.weight, torch.zeros(3, 4))


def test_a_cast_applies_when_the_tensor_is_read(layer: nn.Linear) -> None:
    layer.to(torch.bfloat16)
    assert torch.equal(layer(torch.ones(1, 4, dtype=torch.bfloat16)),
                       nn.functional.linear(torch.ones(1, 4), WEIGHT, BIAS).to(torch.bfloat16))  # fmt: skip


def test_a_deep_copy_reads_nothing_and_has_a_record_of_its_own(layer: nn.Linear) -> None:
    twin = copy.deepcopy(layer)
    assert pending.is_pending(twin.weight) and twin.weight is not layer.weight and twin.weight.is_meta
    twin_record = _record(twin)
    assert twin_record is not _record(layer) and twin_record.lookup(twin.weight) is not None
    assert torch.equal(twin.weight + 0, WEIGHT) and layer.weight.is_meta  # the copy reads its own


def test_plain_meta_and_release_and_a_forgotten_tensor_compute_on_meta(layer: nn.Linear) -> None:
    record = _record(layer)
    with pending.plain_meta():
        assert (layer.weight + 1).is_meta and pending.is_pending(layer.weight)
    record.forget(layer.bias)  # resized: the checkpoint no longer backs it
    assert (layer.bias + 1).is_meta and not pending.is_pending(layer.bias)
    pending.release(layer)
    assert type(layer.weight) is nn.Parameter and (layer.weight * 2).is_meta
    assert record.read_early == 0


def test_a_value_is_rounded_through_every_dtype_it_held(tmp_path) -> None:
    """A float32 checkpoint loaded in bfloat16 and upcast to float32 master weights holds
    bfloat16 values in a plain load; so does a read of the pending tensor."""
    path = str(tmp_path / "model.safetensors")
    save_file({"weight": WEIGHT, "bias": BIAS}, path)
    header = read_header(path)
    module = nn.Linear(4, 3, device="meta", dtype=torch.bfloat16)  # `from_pretrained(dtype=torch.bfloat16)`
    record = CheckpointRecord((path,))
    record.add(module.weight, header["weight"].held_as(torch.bfloat16))
    record.add(module.bias, header["bias"])
    pending.mark(module, record, "load test")
    module.to(torch.float32)  # accelerate's upcast before sharding, LlamaFactory's before prepare
    assert record.lookup(module.weight).via == (torch.bfloat16, torch.float32)
    assert torch.equal(module.weight + 0, WEIGHT.to(torch.bfloat16).float())
    assert not torch.equal(WEIGHT.to(torch.bfloat16).float(), WEIGHT)  # the rounding is there to see
    assert torch.equal(module.bias + 0, BIAS)


def test_a_buffer_the_cast_replaced_stays_backed_for_prepare(tmp_path) -> None:
    """`Module.to(dtype)` replaces each float buffer by its cast: at prepare the replacement is
    read from the checkpoint, through the dtype it was cast to."""
    path = str(tmp_path / "model.safetensors")
    save_file({"scale": WEIGHT}, path)
    module = nn.Module()
    module.register_buffer("scale", torch.empty(3, 4, device="meta"))
    record = CheckpointRecord((path,))
    record.add(module.scale, read_header(path)["scale"])
    pending.mark(module, record, "load test")
    module.to(torch.float16)
    replaced = module.scale
    pending.release(module)
    assert type(replaced) is torch.Tensor and replaced.dtype == torch.float16
    assert record.lookup(replaced).via == (torch.float16,)


def test_a_forward_with_a_tensor_no_file_backs_names_prepare(layer: nn.Linear, tmp_path) -> None:
    """A tensor taken out of the record on meta (resized on a rank that does not hold the
    weights) cannot be read: the guarded forward says so instead of computing with it."""
    import torch.distributed as dist

    from fsdp_offload_cfg import model_state
    from fsdp_offload_cfg.loading.guard import guard_until_prepared

    record = _record(layer)
    model_state.put(layer, "checkpoint", record)
    guard_until_prepared(layer, "load test")
    record.forget(layer.bias)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match=r"still on the meta device on rank 0 \(1 tensor, e.g. bias\)"):
            layer(torch.ones(1, 4))
    finally:
        dist.destroy_process_group()


def test_a_move_off_meta_reads_the_values(layer: nn.Linear) -> None:
    """`.to("cpu")` / `.cpu()` need the values (a cast that stays on meta does not)."""
    assert torch.equal(layer.weight.to("cpu"), WEIGHT) and torch.equal(layer.bias.cpu(), BIAS)
    assert not layer.weight.is_meta and not pending.is_pending(layer.bias)
