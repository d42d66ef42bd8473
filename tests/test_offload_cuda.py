"""Activation offload on CUDA: stream ordering, pinned pool, device memory. Skipped without a GPU.

The ordering tests stall one stream with `torch.cuda._sleep` so that a missing wait would read or
overwrite memory too early and corrupt a gradient: they check values, never timings.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from fsdp_offload_cfg.offload import enable_activation_offload, offload_stats
from fsdp_offload_cfg.offload.options import ActivationOffloadConfig
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

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ASYNC = ActivationOffloadConfig(enabled=True, mode="async")
STALL = 1 << 27  # GPU cycles: tens of milliseconds, far longer than any copy here


@pytest.fixture(autouse=True)
def _fresh() -> None:
    Probe.sink.clear()
    settle_offload_stats()


def _cuda_batch(seed: int = 1, seq: int = 64) -> torch.Tensor:
    return batch(seed=seed, seq=seq).cuda()


def _assert_matches_reference(got: list[torch.Tensor], ref: list[torch.Tensor], ref2: list[torch.Tensor]) -> None:
    """Bit-identical when the platform's kernels are (ref == ref2); otherwise equal up to that noise."""
    if all(torch.equal(a, b) for a, b in zip(ref, ref2, strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    else:
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("mode", ["auto", "sync", "async"])
def test_llama_bit_identical_on_cuda(mode: str) -> None:
    ids = _cuda_batch()
    ref, ref2 = tiny_llama(4).cuda(), tiny_llama(4).cuda()
    loss_ref, loss_ref2 = llama_step(ref, ids), llama_step(ref2, ids)
    model = tiny_llama(4).cuda()
    handle = enable_activation_offload(model, ActivationOffloadConfig(enabled=True, mode=mode))
    assert handle.mode == ("async" if mode == "auto" else mode)
    loss = llama_step(model, ids)
    torch.cuda.synchronize()
    s = offload_stats()
    assert s["offloaded_bytes"] > 0 and s["reloaded_bytes"] == s["offloaded_bytes"] and s["resident_bytes"] == 0
    _assert_matches_reference([loss], [loss_ref], [loss_ref2])
    _assert_matches_reference(grads(model), grads(ref), grads(ref2))
    pool = handle.handler.pool
    assert pool.pinned and all(b.tensor.is_pinned() for blocks in pool._free.values() for b in blocks)


def _net_saving(make: callable, n: int = 3) -> tuple[Net, list[torch.Tensor]]:  # type: ignore[valid-type]
    """A Net whose blocks save `make(y)`; the list receives a reference clone of each saved value."""
    refs: list[torch.Tensor] = []

    def extra(block: nn.Module, y: torch.Tensor) -> list[torch.Tensor]:
        t = make(y)
        refs.append(t.detach().clone())
        return [t]

    return Net(n=n, d=256, extra=extra).cuda(), refs


def test_offload_copy_waits_for_the_producing_stream() -> None:
    """(`torch.mul(..., out=)` on a tensor that requires grad raised under autograd, so
    this test never reached the stream wait. The product is saved by Probe, which needs no grad:
    it is computed outside autograd, late on the compute stream.)"""

    def slow_product(y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = torch.empty_like(y)
            torch.cuda._sleep(STALL)  # the producer is late: a copy that did not wait reads garbage
            return torch.mul(y, 2.0, out=out)

    net, refs = _net_saving(slow_product)
    enable_activation_offload(net, ASYNC, layer_classes=[Block])
    net(torch.randn(64, 256, device="cuda")).backward()
    torch.cuda.synchronize()
    for restored, ref in zip(Probe.sink[::-1][:2], refs[:2]):  # the two offloaded groups
        assert torch.equal(restored[0], ref)


def test_source_stays_alive_until_its_copy_ends() -> None:
    net, refs = _net_saving(lambda y: y * 2.0)
    handle = enable_activation_offload(net, ASYNC, layer_classes=[Block])
    x = torch.randn(64, 256, device="cuda")
    with torch.cuda.stream(handle.handler.d2h):
        torch.cuda._sleep(STALL)  # every offload copy now waits behind this stall
    loss = net(x)
    # sources are dropped by now; without record_stream their memory would be handed out here
    junk = [torch.full((64, 256), 7.0, device="cuda") for _ in range(16)]
    loss.backward()
    torch.cuda.synchronize()
    del junk
    for restored, ref in zip(Probe.sink[::-1][:2], refs[:2]):
        assert torch.equal(restored[0], ref)


def test_compute_waits_for_the_reload() -> None:
    x = torch.randn(64, 256, device="cuda")
    ref_net, _ = _net_saving(lambda y: y * 2.0, n=4)
    ref_net(x).backward()
    net, _ = _net_saving(lambda y: y * 2.0, n=4)
    handle = enable_activation_offload(net, ASYNC, layer_classes=[Block])
    loss = net(x)
    torch.cuda.synchronize()
    with torch.cuda.stream(handle.handler.h2d):
        torch.cuda._sleep(STALL)  # reloads are late: compute that did not wait reads garbage
    loss.backward()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(grads(net), grads(ref_net), strict=True))


def test_a_layer_loaded_ahead_waits_for_compute_to_reach_the_layer_before_it() -> None:
    """in backward the CPU runs layers ahead of the GPU; reloads asked for by the CPU
    queued ~10 layers deep, and under FSDP2 a copy of FSDP's own on the compute stream waited
    138 ms for that queue to empty. Block 2's backward loads block 1 ahead: that reload must not
    start before compute has reached block 2's backward, here held back by a long stall. (Issue
    47 made the gate a matter of correctness too: the reload's buffer comes from compute's pool.
    Ungated, an earlier handler failed this test: its reload was done at the look.)"""
    x = torch.randn(64, 256, device="cuda")
    ref_net, _ = _net_saving(lambda y: y * 2.0, n=4)
    ref_net(x).backward()
    net, _ = _net_saving(lambda y: y * 2.0, n=4)
    handle = enable_activation_offload(net, ASYNC, layer_classes=[Block])
    reload_stream_idle: list[bool] = []

    def stall_compute(module: nn.Module, grad_output: object) -> None:
        torch.cuda._sleep(1 << 31)  # about a second of GPU time, before block 2's backward

    def look(module: nn.Module, grad_output: object) -> None:  # the CPU, at block 1, ahead of the GPU
        time.sleep(0.1)  # an ungated reload of block 1's 64 KB is long done by now
        reload_stream_idle.append(handle.handler.h2d.query())

    net.blocks[2].register_full_backward_pre_hook(stall_compute)
    net.blocks[1].register_full_backward_pre_hook(look)
    net(x).backward()
    torch.cuda.synchronize()
    assert reload_stream_idle == [False]  # block 1's reload still waits for compute
    assert handle.handler.h2d.query()
    assert all(torch.equal(a, b) for a, b in zip(grads(net), grads(ref_net), strict=True))


def _segment_streams() -> set[int]:
    return {segment["stream"] for segment in torch.cuda.memory_snapshot()}


def test_the_offload_allocates_device_memory_on_the_compute_stream_only() -> None:
    """reload buffers were allocated on the H2D stream. The caching allocator keeps a
    stream's blocks in that stream's own pool, which compute cannot reuse: the reserved bytes
    grew beside the allocated ones (23.7 GiB reserved for a 7.3 GiB peak on an H200)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert _segment_streams() <= {torch.cuda.current_stream().cuda_stream}  # nothing of other tests' left
    model = tiny_llama(4, hidden=256).cuda()
    enable_activation_offload(model, ASYNC)
    for seed in range(3):
        llama_step(model, _cuda_batch(seed=seed))
    torch.cuda.synchronize()
    assert offload_stats()["reloaded_bytes"] > 0
    assert _segment_streams() == {torch.cuda.current_stream().cuda_stream}


def test_reserved_stays_with_allocated_while_the_copies_lag() -> None:
    """under `record_stream` a source freed while its copy had not run stayed reserved,
    unusable by compute, until the copy stream passed it; when copies lag compute (they are the
    bound without checkpointing), the allocator reserved a block per activation. Held by the
    offload until compute has waited for its copy, a source stays *allocated*, and compute reuses
    its block in order. The D2H stream is stalled here so that every copy lags."""
    d, rows = 2048, 1024
    net = Net(n=8, d=d).cuda()
    handle = enable_activation_offload(net, ASYNC, layer_classes=[Block])
    x = torch.randn(rows, d, device="cuda", requires_grad=True)
    net(x).backward()  # warm-up: the pinned pool, cuBLAS's workspace
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    with torch.cuda.stream(handle.handler.d2h):
        torch.cuda._sleep(STALL)
    net(x).backward()
    torch.cuda.synchronize()
    activation = rows * d * 4  # 8 MiB; a block saves three of them
    grew_allocated = torch.cuda.max_memory_allocated() - allocated
    grew_reserved = torch.cuda.max_memory_reserved() - reserved
    assert grew_allocated > 4 * activation  # the step did hold activations
    assert grew_reserved <= 1.15 * grew_allocated, (grew_reserved, grew_allocated)


def test_host_tensors_stay_put_on_a_cuda_run() -> None:
    keep: list[torch.Tensor] = []

    def extra(block: nn.Module, y: torch.Tensor) -> list[torch.Tensor]:
        keep.append(torch.randn(4096))  # already on the host
        return [keep[-1], y * 2.0]

    net = Net(n=3, d=256, extra=extra).cuda()
    enable_activation_offload(net, ASYNC, layer_classes=[Block])
    net(torch.randn(64, 256, device="cuda")).backward()
    torch.cuda.synchronize()
    restored = Probe.sink[::-1][0]
    assert restored[0].data_ptr() == keep[0].data_ptr()
    assert restored[1].is_cuda and offload_stats()["kept_tensors"]["other_device"] == 3


def test_pinned_pool_cap_is_honoured_and_the_rest_stays_on_the_device() -> None:
    ids = _cuda_batch()
    ref, ref2 = tiny_llama(4).cuda(), tiny_llama(4).cuda()
    for reference in (ref, ref2):
        llama_step(reference, ids)
    model = tiny_llama(4).cuda()
    cap = 64 * 1024
    handle = enable_activation_offload(model, ActivationOffloadConfig(enabled=True, mode="async", max_pinned_bytes=cap))
    llama_step(model, ids)
    torch.cuda.synchronize()
    stats = offload_stats()
    assert handle.handler.pool.total_bytes <= cap and stats["offloaded_bytes"] > 0
    assert stats["kept_tensors"]["pool_full"] > 0 and stats["pool_full_bytes"] > 0
    _assert_matches_reference(grads(model), grads(ref), grads(ref2))


def test_device_memory_and_pinned_pool_flat_over_steps() -> None:
    model = tiny_llama(3).cuda()
    handle = enable_activation_offload(model, ASYNC)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    allocated, pool = [], []
    for step in range(50):
        llama_step(model, _cuda_batch(seed=step))
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
        pool.append(handle.handler.pool.total_bytes)
        assert offload_stats()["resident_bytes"] == 0
    assert len(set(pool[1:])) == 1
    assert max(allocated[10:]) <= max(allocated[2:10]) + 2**20


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_peak_device_memory_drops(mode: str) -> None:
    ids = _cuda_batch(seq=512)

    def peak(offload: bool) -> int:
        model = tiny_llama(8, hidden=256).cuda()
        if offload:
            enable_activation_offload(model, ActivationOffloadConfig(enabled=True, mode=mode))
        llama_step(model, ids)  # warm-up: pool, workspaces
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        llama_step(model, ids)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    assert peak(True) < 0.75 * peak(False)
