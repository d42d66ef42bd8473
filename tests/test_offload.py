"""Activation offload, single process on the CPU (proxy mode): what moves, what stays, composition.

Every test compares against a run without offload or checks an observable that a broken
behaviour would change (restored storage identity, exact strides, counters, grads to the bit).
"""

from __future__ import annotations

import inspect
import logging
import re
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from fsdp_offload_cfg.offload import enable_activation_offload, get_offload_handle, offload_stats, reset_offload_stats
from fsdp_offload_cfg.offload.filter import keep_reason
from fsdp_offload_cfg.offload.handlers import AsyncHandler, OffloadHandler
from fsdp_offload_cfg.offload.options import ActivationOffloadConfig
from fsdp_offload_cfg.testing.logs import MessageLog
from fsdp_offload_cfg.testing.offload_models import (
    Block,
    Net,
    Probe,
    batch,
    grads,
    llama_step,
    settle_offload_stats,
    tiny_llama,
)

ON = ActivationOffloadConfig(enabled=True)


OUTSIDE = "ran a training forward outside the offload"


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[MessageLog]:
    """Fresh counters; and no test here, however it runs the model (checkpointed, compiled, under
    no_grad, recomputing), meets the warning about a layer run outside the offload: every forward
    of these tests is the model's own. Tests that expect it take it out of this log
    (`_outside_said`)."""
    Probe.sink.clear()
    settle_offload_stats()
    with MessageLog("fsdp_offload_cfg.offload", logging.WARNING) as said:
        yield said
    assert not [line for line in said if OUTSIDE in line]


def _outside_said(log: MessageLog) -> list[str]:
    """The warnings about a layer run outside the offload, taken out of `_fresh`'s log."""
    said = [line for line in log if OUTSIDE in line]
    log[:] = [line for line in log if OUTSIDE not in line]
    return said


def _run_net(net: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    net(x).backward()
    return grads(net)


def _by_block(n: int) -> list[list[torch.Tensor]]:
    """Probe.sink is filled in backward order; return it in block order."""
    assert len(Probe.sink) == n
    return Probe.sink[::-1]


# ---------------------------------------------------------------- what is never offloaded
def test_parameters_views_of_parameters_and_buffers_are_not_copied() -> None:
    def extra(block: nn.Module, y: torch.Tensor) -> list[torch.Tensor]:
        w = block.lin.weight
        same_storage = torch.empty(0).set_(w.untyped_storage(), 0, w.shape, w.stride())  # no autograd view
        return [w, w.t(), same_storage, block.scale, y * 2]

    net = Net(n=3, extra=extra)
    for b in net.blocks:
        b.register_buffer("scale", torch.ones(512))
    handle = enable_activation_offload(net, ON, layer_classes=[Block])
    x = torch.randn(16, 32)
    _run_net(net, x)
    block0 = _by_block(3)[0]
    w0 = net.blocks[0].lin.weight
    for restored in block0[:3]:
        assert restored.untyped_storage().data_ptr() == w0.untyped_storage().data_ptr()
    assert block0[3].data_ptr() == net.blocks[0].scale.data_ptr()
    kept = offload_stats()["kept_tensors"]
    assert kept["parameter"] >= 3 * 4  # 3 blocks x (w, w.t(), alias, buffer), plus linear's own weight saves
    assert offload_stats()["offloaded_tensors"] > 0  # and the activations did move
    handle.remove()


def test_small_integer_and_bool_tensors_stay_in_place() -> None:
    keep: list[torch.Tensor] = []

    def extra(block: nn.Module, y: torch.Tensor) -> list[torch.Tensor]:
        ts = [torch.arange(4096), y > 0, y[:2, :2].contiguous(), y * 3]
        keep.extend(ts)
        return ts

    net = Net(n=3, extra=extra)
    enable_activation_offload(net, ON, layer_classes=[Block])
    _run_net(net, torch.randn(16, 32))
    restored = _by_block(3)[0]
    originals = keep[:4]
    for r, o in zip(restored[:3], originals[:3]):
        assert r.data_ptr() == o.data_ptr()  # int64, bool, 16-byte float: kept, not copied
    assert restored[3].data_ptr() != originals[3].data_ptr()  # the large float one moved
    assert torch.equal(restored[3], originals[3])
    kept = offload_stats()["kept_tensors"]
    assert kept["non_float"] >= 2 * 3 and kept["small"] >= 3


def test_filter_keeps_host_tensors_on_a_cuda_run_and_subclasses() -> None:
    """Rule check without a GPU: the compute device decides; CPU tensors are 'already on the host'."""
    t = torch.randn(1024)
    assert keep_reason(t, torch.device("cuda", 0), 1024, set()) == "other_device"
    assert keep_reason(t, torch.device("cpu"), 1024, set()) is None  # CPU proxy: offloaded
    assert keep_reason(t, torch.device("cpu"), 1024, {t.untyped_storage().data_ptr()}) == "parameter"
    assert keep_reason(nn.Parameter(t), torch.device("cpu"), 0, set()) == "parameter"

    class Sub(torch.Tensor):
        pass

    assert keep_reason(t.as_subclass(Sub), torch.device("cpu"), 0, set()) == "subclass"


def test_aliases_are_offloaded_once_and_restored_exactly() -> None:
    keep: list[torch.Tensor] = []

    def views(x: torch.Tensor) -> list[torch.Tensor]:  # transposed, slices, overlapping, flat, strided
        return [x, x.t(), x[1:3], x[:, 2:9], x[:, 4:20], x.view(-1)[5:], x.as_strided((4, 4), (1, 8), 3)]

    def only_base(block: nn.Module, y: torch.Tensor) -> list[torch.Tensor]:
        x = y * 1.0
        keep.append(x)
        return [x]

    def aliased(block: nn.Module, y: torch.Tensor) -> list[torch.Tensor]:
        x = y * 1.0
        keep.append(x)
        return views(x)

    stats = []
    for extra in (only_base, aliased):
        Probe.sink.clear()
        keep.clear()
        reset_offload_stats()
        net = Net(n=3, extra=extra)
        enable_activation_offload(net, ON, layer_classes=[Block])
        _run_net(net, torch.randn(16, 32))
        stats.append(offload_stats())
    assert stats[1]["offloaded_storages"] == stats[0]["offloaded_storages"]
    assert stats[1]["offloaded_bytes"] == stats[0]["offloaded_bytes"]
    assert stats[1]["offloaded_tensors"] == stats[0]["offloaded_tensors"] + 2 * (len(views(keep[0])) - 1)
    restored, originals = _by_block(3)[0], views(keep[0])
    storage = restored[0].untyped_storage().data_ptr()
    assert storage != keep[0].untyped_storage().data_ptr()
    for r, o in zip(restored, originals):
        assert (r.dtype, r.shape, r.stride(), r.storage_offset(), r.device) == (
            o.dtype, o.shape, o.stride(), o.storage_offset(), o.device)
        assert r.untyped_storage().data_ptr() == storage  # one restored storage for all views
        assert torch.equal(r, o)


def _saved_and_restored(make: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block 0 saves `make(y)` through Probe; returns (what it saved, what backward got back)."""
    keep: list[torch.Tensor] = []

    def extra(block: nn.Module, y: torch.Tensor) -> list[torch.Tensor]:
        keep.append(make(y))
        return keep[-1:]

    net = Net(n=3, extra=extra)
    enable_activation_offload(net, ON, layer_classes=[Block])
    _run_net(net, torch.randn(32, 32))
    return keep[0], _by_block(3)[0][0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtype_and_values_are_preserved(dtype: torch.dtype) -> None:
    saved, r = _saved_and_restored(lambda y: (y * 1.5).to(dtype))
    assert r.dtype == dtype and r.data_ptr() != saved.data_ptr() and torch.equal(r, saved)


def test_bf16_llama_grads_are_bit_identical() -> None:
    ids = batch()
    ref = tiny_llama(2, dtype=torch.bfloat16)
    loss_ref = llama_step(ref, ids)
    model = tiny_llama(2, dtype=torch.bfloat16)
    enable_activation_offload(model, ActivationOffloadConfig(enabled=True, offload_last_group=True))
    loss = llama_step(model, ids)
    assert offload_stats()["offloaded_bytes"] > 0
    assert torch.equal(loss, loss_ref)
    assert all(torch.equal(a, b) for a, b in zip(grads(model), grads(ref)))


@pytest.mark.parametrize("offload_last", [False, True])
def test_last_group_stays_unless_asked(offload_last: bool) -> None:
    keep: list[torch.Tensor] = []

    def extra(block: nn.Module, y: torch.Tensor) -> list[torch.Tensor]:
        keep.append(y * 1.0)
        return [keep[-1]]

    net = Net(n=3, extra=extra)
    enable_activation_offload(net, ActivationOffloadConfig(enabled=True, offload_last_group=offload_last),
                              layer_classes=[Block])
    _run_net(net, torch.randn(16, 32))
    moved = [r[0].data_ptr() != o.data_ptr() for r, o in zip(_by_block(3), keep)]
    assert moved == [True, True, offload_last]
    assert ("last_group" in offload_stats()["kept_tensors"]) is not offload_last


def test_requires_grad_and_grad_fn_semantics_match() -> None:
    seen: list[list[tuple]] = []

    class Mul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            out = a * b
            ctx.save_for_backward(a, b, out)
            return out

        @staticmethod
        def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            a, b, out = ctx.saved_tensors
            seen.append([(t.requires_grad, t.is_leaf, t.grad_fn is None, t.dtype, t.shape) for t in (a, b, out)])
            return g * b, g * a

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Identity() for _ in range(3))

        def forward(self, leaf: torch.Tensor, frozen: torch.Tensor) -> torch.Tensor:
            mid = leaf.exp()
            for b in self.blocks:
                mid = Mul.apply(b(mid), leaf) + Mul.apply(frozen, mid)
            return mid.sum()

    leaf, frozen = torch.randn(64, 8, requires_grad=True), torch.randn(64, 8)
    M()(leaf, frozen).backward()
    ref_seen, ref_grad = list(seen), leaf.grad.clone()
    seen.clear()
    leaf.grad = None
    m = M()
    enable_activation_offload(m, ON, groups=list(m.blocks))
    m(leaf, frozen).backward()
    assert offload_stats()["offloaded_tensors"] > 0
    assert seen == ref_seen and torch.equal(leaf.grad, ref_grad)


# ---------------------------------------------------------------- composition
def _hf_ckpt(m: nn.Module) -> nn.Module:
    """HF checkpointing: `activation_checkpointing_enable` from transformers 5.23 on, the older name before."""
    if hasattr(m, "activation_checkpointing_enable"):
        m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return m


def _hf_ckpt_every_2(m: nn.Module) -> nn.Module:
    """HF checkpointing of every other layer (`every_n_layers`, transformers 5.23 on): the offload
    moves the others' saved tensors, beside layers that recompute."""
    if "every_n_layers" not in inspect.signature(getattr(m, "activation_checkpointing_enable", lambda: None)).parameters:
        pytest.skip("this transformers checkpoints every layer or none")
    m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in m.model.layers] == [True, False, True]
    return m


def _wrap_ckpt(m: nn.Module) -> nn.Module:
    for i, layer in enumerate(m.model.layers):
        m.model.layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
    return m


@pytest.mark.parametrize("mode", ["auto", "sync", "async"])
def test_the_estimate_replays_the_handler_the_run_builds(mode: str) -> None:
    """The estimate decides whether backward reloads ahead (`prefetch_groups`) from the config's
    `resolved_mode`; the run builds its handler from the same rule, checked here on the CPU."""
    config = ActivationOffloadConfig(enabled=True, mode=mode)
    handle = enable_activation_offload(tiny_llama(2), config)
    try:
        assert isinstance(handle.handler, AsyncHandler) is (config.resolved_mode("cpu") == "async")
    finally:
        handle.remove()
    # where no run is possible here: auto is async on CUDA only; async needs streams (or the CPU proxy)
    table = {(m, d): ActivationOffloadConfig(mode=m).resolved_mode(d)
             for m in ("auto", "sync", "async") for d in ("cuda", "cpu", "xpu")}
    assert table == {("auto", "cuda"): "async", ("auto", "cpu"): "sync", ("auto", "xpu"): "sync",
                     ("sync", "cuda"): "sync", ("sync", "cpu"): "sync", ("sync", "xpu"): "sync",
                     ("async", "cuda"): "async", ("async", "cpu"): "async", ("async", "xpu"): "sync"}


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("ac", [None, _wrap_ckpt, _hf_ckpt, _hf_ckpt_every_2],
                         ids=["no_ac", "checkpoint_wrapper", "hf_gc", "hf_gc_every_2"])
def test_llama_bit_identical_with_and_without_checkpointing(mode: str, ac) -> None:
    ids = batch()
    prep = ac or (lambda m: m)
    ref = prep(tiny_llama(3))
    loss_ref = llama_step(ref, ids)
    model = prep(tiny_llama(3))
    handle = enable_activation_offload(model, ActivationOffloadConfig(enabled=True, mode=mode))
    assert isinstance(handle.handler, AsyncHandler) is (mode == "async")
    loss = llama_step(model, ids)
    s = offload_stats()
    assert s["offloaded_bytes"] > 0 and s["reloaded_bytes"] == s["offloaded_bytes"]
    assert torch.equal(loss, loss_ref)
    assert all(torch.equal(a, b) for a, b in zip(grads(model), grads(ref), strict=True))
    assert s["resident_bytes"] == 0


@pytest.mark.parametrize("moves", [True, False])
def test_the_end_of_run_line_says_what_moved_or_that_nothing_did(moves: bool) -> None:
    """An offload that is on and moves nothing (under ms-swift's default gradient checkpointing the
    layers saved nothing it could move) now says so at the end of the run, with the usual causes;
    before, the line was left out and the run looked offloaded. Here every saved tensor is below
    `min_tensor_bytes`."""
    import logging

    from fsdp_offload_cfg._sizes import UNITS
    from fsdp_offload_cfg.offload.stats import describe_moved

    model = tiny_llama(3)
    enable_activation_offload(model, ActivationOffloadConfig(enabled=True, min_tensor_bytes=1024 if moves else 2**40))
    llama_step(model, batch())
    level, line = describe_moved(offload_stats())
    if moves:
        assert level == logging.INFO and line.startswith("activation offload moved "), line
        # in a unit that shows it: a tiny model's few KiB once read "0.00 GiB"
        moved = re.match(r"activation offload moved ([0-9.]+) (B|KiB|MiB|GiB) to the host", line)
        assert moved is not None and float(moved.group(1)) >= 1, line
        assert float(moved.group(1)) * UNITS[moved.group(2).lower()] == pytest.approx(
            offload_stats()["offloaded_bytes"], rel=0.01), line
    else:
        assert offload_stats()["offloaded_bytes"] == 0 and offload_stats()["groups_entered"] > 0
        assert level == logging.WARNING and "moved nothing" in line and "small" in line, line
        assert "gradient checkpointing" in line


@pytest.mark.parametrize("kept", ["every_layer", "all_but_one"])
def test_the_end_of_run_line_warns_only_about_layers_it_was_to_move(kept: str) -> None:
    """An activation_memory_budget plan that offloads no layer (it only checkpoints, as under
    `axolotl train` with a small budget) runs the handler with every layer kept: moving nothing is
    the plan, and the old "moved nothing ... turn gradient checkpointing off" warning misled. A
    layer the plan was to move that moved nothing (tensors too small here) still warns."""
    import logging

    from fsdp_offload_cfg.offload.stats import describe_moved

    model = tiny_llama(3)
    handle = enable_activation_offload(model, ActivationOffloadConfig(enabled=True, min_tensor_bytes=2**40))
    handle.handler.kept_groups = frozenset(range(3) if kept == "every_layer" else range(1, 3))  # as budget.py sets it
    llama_step(model, batch())
    assert offload_stats()["offloaded_bytes"] == 0 and offload_stats()["groups_entered"] == 3
    line = describe_moved(offload_stats())
    if kept == "every_layer":
        assert line is None
    else:
        assert line is not None and line[0] == logging.WARNING and "moved nothing" in line[1]


def test_the_end_of_run_line_counts_one_tensor_in_the_singular() -> None:
    """Under checkpointing a layer saves one tensor for the offload to move (its input): a
    two-layer model's line read "(1 tensors)"."""
    from fsdp_offload_cfg.offload.stats import describe_moved

    stats = {**offload_stats(), "offloaded_bytes": 2**20, "reloaded_bytes": 2**20, "offloaded_tensors": 1}
    assert "to the host (1 tensor) and 1.0 MiB back" in describe_moved(stats)[1]


def test_the_end_of_run_line_is_silent_when_the_offload_never_ran() -> None:
    from fsdp_offload_cfg.offload.stats import describe_moved

    assert describe_moved(offload_stats()) is None


class _Outer(nn.Module):
    """Checkpoint applied *around* the group: recomputation re-enters the group module's hooks."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.parametrize("layout", ["checkpoint_wrapper", "group_inside_checkpoint"])
def test_recompute_pushes_nothing_and_only_checkpoint_inputs_move(layout: str) -> None:
    x = torch.randn(16, 32)
    if layout == "checkpoint_wrapper":
        net = Net(n=4)
        for i, b in enumerate(net.blocks):
            net.blocks[i] = checkpoint_wrapper(b)
        handle = enable_activation_offload(net, ON, layer_classes=[Block])
        assert all(isinstance(g, CheckpointWrapper) for g in handle.groups)
    else:
        net = Net(n=4)
        for i, b in enumerate(net.blocks):
            net.blocks[i] = _Outer(b)
        enable_activation_offload(net, ON, groups=[o.inner for o in net.blocks])
    loss = net(x)
    after_forward = offload_stats()
    # only the checkpoint input of each offloaded group moved: one (16, 32) fp32 tensor each
    assert after_forward["offloaded_storages"] == 3 and after_forward["offloaded_bytes"] == 3 * 16 * 32 * 4
    assert after_forward["groups_entered"] == 4
    loss.backward()
    after_backward = offload_stats()
    for key in ("packed_tensors", "groups_entered", "offloaded_tensors", "offloaded_storages", "offloaded_bytes"):
        assert after_backward[key] == after_forward[key], key
    assert after_backward["reloaded_bytes"] == after_forward["offloaded_bytes"]
    ref = Net(n=4)
    ref(x).backward()
    assert all(torch.equal(a, b) for a, b in zip(grads(net), grads(ref), strict=True))


def test_recompute_inside_an_active_forward_moves_no_group_state() -> None:
    """A backward run *during* our forward (gradient penalty style) recomputes a checkpointed group
    while the pass is live: the recomputation must not count as a group entry nor move the frame."""

    class PenaltyNet(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            penalty = None
            for i, b in enumerate(self.blocks):
                x = b(x)
                if i == 1:
                    probe = x.detach().requires_grad_()
                    (g,) = torch.autograd.grad(self.blocks[3](probe).sum(), probe)  # recomputes group 3
                    penalty = g.pow(2).sum()
            return self.head(x).pow(2).sum() + penalty

    def build() -> Net:
        net = PenaltyNet(n=4)
        for i, b in enumerate(net.blocks):
            net.blocks[i] = _Outer(b)
        return net

    x = torch.randn(16, 32)
    ref = build()
    net = build()
    enable_activation_offload(net, ON, groups=[o.inner for o in net.blocks])
    loss = net(x)
    assert offload_stats()["groups_entered"] == 5  # 4 groups + the penalty's forward of group 3
    loss.backward()
    ref(x).backward()
    assert offload_stats()["groups_entered"] == 5
    assert all(torch.equal(a, b) for a, b in zip(grads(net), grads(ref), strict=True))


def test_no_grad_and_inference_leave_no_state() -> None:
    net = Net(n=3)
    handle = enable_activation_offload(net, ON, layer_classes=[Block])
    x = torch.randn(16, 32)
    net.eval()
    with torch.no_grad():
        net(x)
    with torch.inference_mode():
        net(x)
    s = offload_stats()
    assert s["packed_tensors"] == 0 and s["groups_entered"] == 0 and s["resident_bytes"] == 0
    assert handle.handler._pass is None
    net.train()
    ref = Net(n=3)
    assert all(torch.equal(a, b) for a, b in zip(_run_net(net, x), _run_net(ref, x), strict=True))


def _forward_of_the_class(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A forward put on a model the way TRL's distillation trainers put theirs: it runs the
    class's forward, not the instance's (where the offload's is)."""
    return type(self).forward(self, *args, **kwargs)


@pytest.mark.parametrize("how", ["forward_replaced", "submodule_called"])
def test_a_layer_run_outside_the_offload_is_said_once_and_names_what_replaced_the_forward(
        how: str, _fresh: MessageLog) -> None:
    """The offload wraps the model's forward; a forward put on the model afterwards, or a trainer
    calling the decoder directly, runs every layer outside it, and nothing moves. Before, nothing
    said so (found under TRL's distillation, whose redirection swapped the forward): the run looked
    offloaded. Now one warning per model says which layer, and what replaced the forward where
    something did. The gradients are the plain run's: nothing else changes."""
    ids = batch()
    ref = tiny_llama(3)
    model = tiny_llama(3)
    enable_activation_offload(model, ON)
    if how == "forward_replaced":
        model.forward = types.MethodType(_forward_of_the_class, model)
    for _ in range(2):
        if how == "forward_replaced":
            llama_step(model, ids)
            llama_step(ref, ids)
        else:
            model.model(input_ids=ids).last_hidden_state.sum().backward()
            ref.model(input_ids=ids).last_hidden_state.sum().backward()
    said = _outside_said(_fresh)  # the package's log, with its rank: a Python warning named none
    assert len(said) == 1, said
    assert said[0].startswith("activation offload: LlamaDecoderLayer of LlamaForCausalLM ran"), said[0]
    if how == "forward_replaced":
        assert f"replaced after the offload was enabled, by {__name__}._forward_of_the_class" in said[0], said[0]
    else:
        assert "model.model(...)" in said[0] and "replaced" not in said[0], said[0]
    assert offload_stats()["offloaded_bytes"] == 0
    assert all(torch.equal(a, b) for a, b in zip(grads(model), grads(ref), strict=True))


def test_the_layer_outside_the_offload_is_named_as_its_user_knows_it_under_fsdp2_and_checkpointing(
        tmp_path: Any, _fresh: MessageLog) -> None:
    """Under FSDP2 (one gloo rank here) with checkpoint-wrapped layers, as accelerate prepares
    them, and a forward put on the model afterwards, the classes are FSDP2's `FSDP<class>` subclasses and the wrapper: the warning names the
    model's own classes (it read "FSDPCheckpointWrapper of FSDPLlamaForCausalLM")."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = tiny_llama(2)
        mesh = init_device_mesh("cpu", (1,))
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = fully_shard(checkpoint_wrapper(layer), mesh=mesh)
        fully_shard(model, mesh=mesh)
        enable_activation_offload(model, ON)
        model.forward = types.MethodType(_forward_of_the_class, model)
        llama_step(model, batch())
    finally:
        dist.destroy_process_group()
    said = _outside_said(_fresh)
    assert len(said) == 1 and said[0].startswith("activation offload: LlamaDecoderLayer of LlamaForCausalLM ran"), said


def test_exception_mid_forward_leaves_no_state() -> None:
    net = Net(n=4)
    handle = enable_activation_offload(net, ON, layer_classes=[Block])
    x = torch.randn(16, 32)
    net.blocks[2].fail = True
    with pytest.raises(RuntimeError, match="boom"):
        net(x)
    s = offload_stats()
    pool = handle.handler.pool
    assert handle.handler._pass is None
    assert s["offloaded_storages"] > 0  # it did offload before failing ...
    assert s["resident_bytes"] == 0 and pool.idle_bytes() == pool.total_bytes  # ... and gave it all back
    before = offload_stats()["packed_tensors"]
    (torch.randn(64, 64, requires_grad=True) * 2).exp().sum().backward()  # our hooks are not left installed
    assert offload_stats()["packed_tensors"] == before
    net.blocks[2].fail = False
    ref = Net(n=4)
    assert all(torch.equal(a, b) for a, b in zip(_run_net(net, x), _run_net(ref, x), strict=True))
    assert offload_stats()["resident_bytes"] == 0


@pytest.mark.parametrize("order", ["fwd_bwd_x3", "fwd_fwd_bwd_bwd"])
def test_gradient_accumulation(order: str) -> None:
    mbs = [batch(seed=s) for s in range(3)]
    ref = tiny_llama(3)
    for ids in mbs:
        llama_step(ref, ids)
    model = tiny_llama(3)
    handle = enable_activation_offload(model, ActivationOffloadConfig(enabled=True, mode="async"))
    if order == "fwd_bwd_x3":
        for ids in mbs:
            llama_step(model, ids)
    else:  # two graphs alive at once, backwards in reverse order, then a third micro-batch
        l0 = model(input_ids=mbs[0], labels=mbs[0]).loss
        l1 = model(input_ids=mbs[1], labels=mbs[1]).loss
        l1.backward()
        l0.backward()
        llama_step(model, mbs[2])
    assert all(torch.equal(a, b) for a, b in zip(grads(model), grads(ref), strict=True))
    pool = handle.handler.pool
    assert offload_stats()["resident_bytes"] == 0 and pool.idle_bytes() == pool.total_bytes


# ---------------------------------------------------------------- public surface
def test_group_detection() -> None:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    m = tiny_llama(2)
    h = enable_activation_offload(m)  # config=None: defaults, enabled
    assert [type(g) for g in h.groups] == [LlamaDecoderLayer] * 2 and h.mode == "sync"
    h.remove()
    m = _wrap_ckpt(tiny_llama(2))
    h = enable_activation_offload(m)
    assert all(isinstance(g, CheckpointWrapper) for g in h.groups) and len(h.groups) == 2
    h.remove()
    net = Net(n=3)
    assert len(enable_activation_offload(net, ON, layer_classes=["Block"]).groups) == 3
    with pytest.raises(RuntimeError, match="already enabled"):
        enable_activation_offload(net, ON)
    with pytest.raises(ValueError, match="no groups"):
        enable_activation_offload(Net(n=2), ON)
    with pytest.raises(ValueError, match="mode"):
        bad = ActivationOffloadConfig(enabled=True, mode="fast")  # type: ignore[arg-type]
        enable_activation_offload(Net(n=2), bad, layer_classes=[Block])
    off = enable_activation_offload(Net(n=2), ActivationOffloadConfig(enabled=False))
    assert not off.active and off.groups == []


def test_remove_undoes_everything() -> None:
    net = Net(n=3)
    handle = enable_activation_offload(net, ActivationOffloadConfig(enabled=True, mode="async"), layer_classes=[Block])
    assert isinstance(handle.handler, OffloadHandler) and "forward" in net.__dict__
    _run_net(net, torch.randn(16, 32))
    handle.remove()
    assert "forward" not in net.__dict__ and get_offload_handle(net) is None
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in net.blocks)
    reset_offload_stats()
    _run_net(net, torch.randn(16, 32))
    assert offload_stats()["packed_tensors"] == 0
    handle.remove()  # idempotent
    enable_activation_offload(net, ON, layer_classes=[Block]).remove()  # can be enabled again


# ---------------------------------------------------------------- property: any view restores exactly
@st.composite
def _strided_views(draw: st.DrawFn) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    views = []
    for _ in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(1, 3))
        size = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
        stride = tuple(draw(st.integers(0, 20)) for _ in range(ndim))
        extent = sum((n - 1) * s for n, s in zip(size, stride))
        offset = draw(st.integers(0, 16 * 32 - 1 - extent))
        views.append((size, stride, offset))
    return views


@settings(max_examples=25, deadline=None)
@given(_strided_views(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_any_strided_views_of_one_storage_restore_exactly(views: list, dtype: torch.dtype) -> None:
    Probe.sink.clear()
    keep: list[torch.Tensor] = []

    def extra(block: nn.Module, y: torch.Tensor) -> list[torch.Tensor]:
        base = (y * 1.0).to(dtype)
        keep.append(base)
        return [base.as_strided(*v) for v in views]

    net = Net(n=2, extra=extra)
    handle = enable_activation_offload(net, ActivationOffloadConfig(enabled=True, min_tensor_bytes=0),
                                       layer_classes=[Block])
    reset_offload_stats()
    _run_net(net, torch.randn(16, 32))
    assert offload_stats()["offloaded_storages"] >= 1
    restored = _by_block(2)[0]
    for r, v in zip(restored, views, strict=True):
        o = keep[0].as_strided(*v)
        assert (r.shape, r.stride(), r.storage_offset(), r.dtype) == (o.shape, o.stride(), o.storage_offset(), o.dtype)
        assert torch.equal(r, o) and r.data_ptr() != o.data_ptr()
    handle.remove()


def test_dynamo_registration_lives_exactly_as_long_as_a_handle() -> None:
    import torch._dynamo

    from fsdp_offload_cfg.offload import api

    registered = torch._dynamo.config.reorderable_logging_functions
    holders = api._notice_holders  # handles other tests left on their models still hold it
    first, second = Net(n=2), Net(n=2)
    handles = [enable_activation_offload(m, ON, layer_classes=[Block]) for m in (first, second)]
    handles[0].remove()
    assert api._whole_model_compile_notice in registered  # the second model's forward may still call it
    handles[1].remove()
    handles[1].remove()  # idempotent: the count does not go below zero
    assert api._notice_holders == holders
    assert (api._whole_model_compile_notice in registered) is (holders > 0)


# ---------------------------------------------------------------- view bits (negative, conjugate)
def _complex_block_net(view: str) -> nn.Module:
    """Each block saves a view that carries a bit: `z.conj().imag` (a float view with the negative
    bit) or `z.conj()` itself (a complex view with the conjugate bit), then uses it in a product."""

    class BitBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            z = torch.complex(self.lin(x), torch.tanh(x))
            if view == "neg":
                y = z.conj().imag  # float, negative bit set
                assert y.is_neg()
                return torch.tanh(y * self.lin(x)) + x
            w = z.conj()  # complex, conjugate bit set
            assert w.is_conj()
            return torch.tanh(torch.view_as_real(w.resolve_conj() * w).sum(-1)) + x

    class BitNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(BitBlock() for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x.pow(2).sum()

    return BitNet()


@pytest.mark.parametrize("view", ["neg", "conj"])
def test_negative_and_conjugate_views_restore_with_their_bits(view: str) -> None:
    x = torch.randn(16, 32)
    ref = _complex_block_net(view)
    expected = _run_net(ref, x)
    net = _complex_block_net(view)
    enable_activation_offload(net, ON, layer_classes=[type(net.blocks[0])])
    reset_offload_stats()
    got = _run_net(net, x)
    assert offload_stats()["offloaded_tensors"] > 0  # the view with its bit really went to the host
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def test_a_conjugate_complex_view_saved_through_probe_comes_back_conjugate() -> None:
    """Complex activations (RoPE through `view_as_complex`) are offloaded like float ones; the
    conjugate bit is part of the view and comes back with it."""
    saved, restored = _saved_and_restored(lambda y: torch.complex(y * 1.0, y * 2.0).conj())
    assert saved.is_conj() and restored.data_ptr() != saved.data_ptr()  # offloaded and restored, not kept
    assert restored.is_conj() and restored.dtype == saved.dtype and torch.equal(restored, saved)


def test_a_negative_view_saved_through_probe_comes_back_negative() -> None:
    # values -2y, stored as +2y with the negative bit
    saved, restored = _saved_and_restored(lambda y: torch.complex(y * 1.0, y * 2.0).conj().imag)
    assert saved.is_neg() and restored.data_ptr() != saved.data_ptr()  # offloaded and restored, not kept
    assert restored.is_neg() and torch.equal(restored, saved)


# ---------------------------------------------------------------- torch.compile (inductor on the CPU)
@pytest.mark.slow
@pytest.mark.parametrize("scope", ["per_layer", "per_checkpointed_layer", "whole_model"])
def test_compiled_llama_grads_are_bit_identical(scope: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offload composes with `torch.compile`: gradients equal those of the same compiled model
    without offload, to the bit. Per layer, compiled layers save through our hooks and their
    activations move; so do the inputs of compiled checkpointed layers (each wrapper compiled, as
    accelerate's regional compilation does; a hook of ours inside the wrapper split its graph and
    moved the gradients by 7e-8). Whole model, a graph saves everything when it ends (no layer
    boundary to offload at) and hooks would split it: offload steps aside, says so once, changes
    nothing. In every scope, no graph break of ours (the same breaks as the model without
    offload): our hooks run outside the layers' graphs (a compiled layer's) or trace as nothing
    (a model compiled whole; `groups.GroupHooks`). The model's own may break: transformers 5.25's
    kernels wrapper (`use_kernelized_func`, kernels 0.19) mutates a global in each attention's
    forward, which dynamo refuses inside a checkpoint ("HOP: Unsafe side effect"), stock alike."""
    from torch._dynamo.utils import counters

    from fsdp_offload_cfg.offload import api
    from fsdp_offload_cfg.offload.stats import COUNTS

    monkeypatch.setattr(api, "_noticed_whole_model_compile", False)

    def compiled(offload: bool) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, int]]:
        torch._dynamo.reset()
        counters.clear()
        model = tiny_llama(2)
        if scope == "per_checkpointed_layer":
            for i, layer in enumerate(model.model.layers):
                model.model.layers[i] = checkpoint_wrapper(layer)
        if offload:
            enable_activation_offload(model, ON)
        if scope != "whole_model":
            for layer in model.model.layers:
                layer.compile()
        else:
            model.compile()
        loss = llama_step(model, batch())
        return loss, grads(model), dict(counters["graph_break"])

    loss_ref, grads_ref, breaks_ref = compiled(offload=False)
    reset_offload_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, got, breaks = compiled(offload=True)
    notices = [w for w in caught if "activation offload is inactive for a model compiled whole" in str(w.message)]
    assert breaks == breaks_ref
    if scope != "whole_model":
        assert offload_stats()["offloaded_bytes"] > 0 and COUNTS["groups_entered"] > 0 and not notices
    else:
        assert offload_stats()["offloaded_bytes"] == 0 and len(notices) == 1
    assert torch.equal(loss, loss_ref)
    assert all(torch.equal(g, r) for g, r in zip(got, grads_ref, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("style", ["in_place", "wrapped"])
def test_layers_compiled_with_fullgraph_offload_exactly(style: str) -> None:
    """`fullgraph=True` per layer, as torchtitan compiles its blocks and accelerate's regional
    compilation can (`dynamo_use_fullgraph`). Our group hooks used to be traced as frames of their
    own beside each compiled layer, where dynamo met autograd's graph task and the saved-tensor
    hooks stack: under fullgraph, `torch._dynamo.exc.Unsupported` at the first step. They now run
    eagerly around each compiled forward: activations move, gradients equal those of the same
    compiled model without offload. "wrapped" (`torch.compile(layer)` in the model's layer list,
    accelerate's `compile_regions`) needs torch >= 2.13 and a layer class without a `__call__` of
    its own: otherwise dynamo inlines the wrapped layer's hooks into its graph (torch 2.11; and
    transformers' `GradientCheckpointingLayer`, which had its own `__call__` up to 5.16 at least),
    where no hook of ours can run under fullgraph."""
    from torch._dynamo.utils import counters

    if style == "wrapped":
        if torch.__version__ < "2.13":
            pytest.skip("torch < 2.13 traces a torch.compile-wrapped layer's hooks into its graph")
        layer_class = type(tiny_llama(2).model.layers[0])
        if layer_class.__call__ is not nn.Module.__call__:
            pytest.skip(f"{layer_class.__name__} has its own __call__: a torch.compile wrapper inlines its hooks")

    def compiled(offload: bool) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, int]]:
        torch._dynamo.reset()
        counters.clear()
        model = tiny_llama(2)
        layers = list(model.model.layers)
        handle = enable_activation_offload(model, ON) if offload else None
        for i, layer in enumerate(layers):
            if style == "in_place":
                layer.compile(fullgraph=True)
            else:
                model.model.layers[i] = torch.compile(layer, fullgraph=True)
        loss = llama_step(model, batch())
        if handle is not None:  # the hooks re-registered for the compiled layers go with the handle
            handle.remove()
            assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in layers)
        return loss, grads(model)

    loss_ref, grads_ref = compiled(offload=False)
    reset_offload_stats()
    loss, got = compiled(offload=True)
    assert dict(counters["graph_break"]) == {}
    assert offload_stats()["offloaded_bytes"] > 0
    assert torch.equal(loss, loss_ref)
    assert all(torch.equal(g, r) for g, r in zip(got, grads_ref, strict=True))


class CallBlock(Block):
    """A layer class with a `__call__` of its own, as transformers' `GradientCheckpointingLayer`
    up to 5.16: a `torch.compile` wrapper around it traces its hooks into its graph."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs)


def _call_block_net(style: str, offload: bool) -> Net:
    torch._dynamo.reset()
    net = Net(n=3)
    net.blocks = nn.ModuleList(CallBlock() for _ in range(3))
    if offload:
        enable_activation_offload(net, ON, layer_classes=[CallBlock])
    for i, block in enumerate(list(net.blocks)):
        if style == "in_place":
            block.compile(fullgraph=True, backend="aot_eager")
        else:
            net.blocks[i] = torch.compile(block, fullgraph=True, backend="aot_eager")
    return net


def test_hooks_traced_into_a_wrapped_layer_say_how_to_compile_instead() -> None:
    """`torch.compile(layer, fullgraph=True)` around a layer whose hooks dynamo inlines (its class
    has its own `__call__`, or torch < 2.13) cannot run the offload's hooks. dynamo's own error
    names our hook and hints to remove its `torch.compiler.disable`, which the user cannot act on:
    ours names the layer and the three ways out, and the way it recommends trains exactly."""
    from torch._dynamo.exc import Unsupported

    from fsdp_offload_cfg.offload.groups import OffloadCompileError

    x = torch.randn(16, 32)
    _call_block_net("wrapped", offload=False)(x).backward()  # the same compile without offload runs
    net = _call_block_net("wrapped", offload=True)
    with pytest.raises(OffloadCompileError, match=r"compiled graph of blocks\.0 \(and 2 more\)") as caught:
        net(x)
    message = str(caught.value)
    assert "layer.compile(fullgraph=True)" in message and "dynamo_use_fullgraph: false" in message
    assert "torch to 2.13" in message
    assert isinstance(caught.value.__cause__, Unsupported)  # dynamo's own error stays in the chain
    assert get_offload_handle(net).handler._pass is None

    def run(offload: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        net = _call_block_net("in_place", offload)
        loss = net(x)
        loss.backward()
        return loss, [p.grad for p in net.parameters()]

    loss_ref, grads_ref = run(offload=False)
    reset_offload_stats()
    loss, got = run(offload=True)
    assert offload_stats()["offloaded_bytes"] > 0
    assert torch.equal(loss, loss_ref) and all(torch.equal(g, r) for g, r in zip(got, grads_ref, strict=True))


def test_other_errors_in_a_compiled_layer_pass_through_unchanged() -> None:
    """Only dynamo's refusal of our hooks is explained; any other error reaches the user as raised."""
    net = _call_block_net("in_place", offload=True)
    net.blocks[1].fail = True
    with pytest.raises(RuntimeError, match="boom mid-forward") as caught:
        net(torch.randn(16, 32))
    assert type(caught.value).__name__ != "OffloadCompileError"


def test_compiling_a_layer_keeps_its_hooks_in_their_order() -> None:
    """A layer compiled after the offload was enabled gets hooks of the other form (see GroupHooks)
    in place: a hook registered on the layer after ours still runs after ours, so it sees the
    group entered. Re-registered, ours moved behind it."""
    net = Net(n=3)
    enable_activation_offload(net, ON, layer_classes=[Block])
    seen: list[int] = []
    for block in net.blocks:
        block.register_forward_pre_hook(lambda _m, _a: seen.append(offload_stats()["groups_entered"]))
        block.compile(backend="aot_eager")
    reset_offload_stats()
    net(torch.randn(16, 32)).backward()
    assert offload_stats()["offloaded_bytes"] > 0
    assert seen == [1, 2, 3]  # ours entered the group before each user hook ran


def _leaves_compiled_in_place(offload: bool, fullgraph: bool) -> tuple[str, list[torch.Tensor]]:
    """embed_tokens and lm_head compiled in place, as accelerate's regional compilation for FSDP2
    (`compile_regions_fsdp2`) compiles the modules outside the repeated layers: the outcome of a
    step ("ok" or the error's first line) and the gradients."""
    torch._dynamo.reset()
    model = tiny_llama(2)
    if offload:
        enable_activation_offload(model, ON)
    for module in (model.model.embed_tokens, model.lm_head):
        module.compile(fullgraph=fullgraph, backend="aot_eager")
    try:
        llama_step(model, batch())
    except Exception as error:  # noqa: BLE001 - the outcome is what is compared
        return f"{type(error).__name__}: {str(error).splitlines()[0]}", []
    return "ok", grads(model)


def test_torch_modules_compiled_in_place_do_not_compile_our_saved_tensor_hooks() -> None:
    """dynamo skips the frames of a torch.nn module compiled in place (nn.Linear, nn.Embedding)
    and used to compile the first Python frame it met under them: our pack hook, which autograd
    calls from C++. A graph break at every such module; under fullgraph=True,
    `Unsupported: torch.* op returned non-Tensor` at the first step, where the same model without
    offload trains (torch 2.11) or stops with torch's own error (2.13: fullgraph found no compiled
    frames). The hooks now run as they are: the outcome is the one without offload."""
    from torch._dynamo.utils import counters

    assert _leaves_compiled_in_place(True, fullgraph=True)[0] == _leaves_compiled_in_place(False, fullgraph=True)[0]
    outcome_ref, grads_ref = _leaves_compiled_in_place(False, fullgraph=False)
    counters.clear()
    outcome, got = _leaves_compiled_in_place(True, fullgraph=False)
    assert outcome == outcome_ref == "ok"
    assert dict(counters["graph_break"]) == {}
    assert all(torch.equal(g, r) for g, r in zip(got, grads_ref, strict=True))
