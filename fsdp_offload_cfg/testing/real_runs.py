"""Real runs the memory estimate is checked against (`test_estimate.py` and
`benchmarks/estimate_accuracy.py` share them, so both measure the same way).

Each returns what a real run of the model measures: the bytes the C allocator holds after a
forward (independent of saved-tensor hooks and of the estimate), saved bytes through saved-tensor
hooks, the offload's own counters, rank 0's local storages after `fully_shard` and one AdamW step.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_offload_cfg.estimate.model import example_batch, example_image, model_class, read_model
from fsdp_offload_cfg.estimate.probe import offload_groups
from fsdp_offload_cfg.offload import enable_activation_offload
from fsdp_offload_cfg.offload.options import ActivationOffloadConfig
from fsdp_offload_cfg.offload.stats import SavedBytesMeter, offload_stats
from fsdp_offload_cfg.testing.offload_models import settle_offload_stats


def real_model(path: str, dtype: torch.dtype, batch_size: int, seq_len: int) -> tuple[nn.Module, dict[str, Any]]:
    """The model as `from_pretrained` loads it, in training mode, and the estimate's batch with
    real images (the estimate puts them on meta)."""
    source = read_model(path)
    model = model_class(source.config).from_pretrained(path, dtype=dtype)
    batch = example_batch(source, batch_size, seq_len, dtype, example_image(source.config, model))
    if "pixel_values" in batch:
        batch["pixel_values"] = torch.randn(batch["pixel_values"].shape, dtype=dtype)
    return model.train(), batch


def saved_bytes(model: nn.Module, batch: dict[str, Any]) -> int:
    """Bytes saved for backward at the end of one forward (each storage once, no parameters)."""
    with SavedBytesMeter(model) as meter:
        model(**batch)
    return meter.peak_bytes


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                        "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def _libc_mallinfo2() -> Any:
    """glibc's `mallinfo2` (glibc >= 2.33), or None where there is none (macOS, musl, old glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        function = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


MALLINFO2 = _libc_mallinfo2()


def _allocated_bytes() -> int:
    """Bytes the C allocator has handed out and not taken back (heap chunks in use plus mmapped
    blocks): torch's CPU tensors come from it, freed memory cached by glibc does not count."""
    info = MALLINFO2()
    return info.uordblks + info.hblkhd


def allocator_held_after_forward(model: nn.Module, batch: dict[str, Any]) -> int:
    """What one training forward leaves allocated once its outputs are dropped but the loss (and
    so the autograd graph) is kept: the activations autograd holds for backward, as the allocator
    sees them, independent of saved-tensor hooks and of the estimate's own accounting. A second
    forward is measured, so one-time allocations (caches, lazily built buffers) are not counted."""
    for _ in range(2):
        gc.collect()
        before = _allocated_bytes()
        output = model(**batch)
        loss = output.loss
        del output
        gc.collect()
        held = _allocated_bytes() - before
        del loss
    return held


class _AllocatorPeak(TorchDispatchMode):
    """The allocator's bytes after every op, above `base`: the highest is the step's peak (a
    temporary freed inside one op is missed; every output is seen)."""

    def __init__(self, base: int) -> None:
        super().__init__()
        self.base, self.peak = base, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, _allocated_bytes() - self.base)
        return out


def allocator_peak_in_backward(model: nn.Module, batch: dict[str, Any], adapters: bool = False) -> int:
    """The most the C allocator holds, above what it held before the forward, at any op of one
    training forward and backward: the activations' own peak with backward's temporaries, as
    the allocator sees it. Backward stops at the embeddings' output, so no weight gradient is
    made (the estimate counts those with the parameters, not the activations); with `adapters`
    (a LoRA over a frozen embedding, whose output needs no gradient) it runs to the trainable
    parameters, whose gradients are small. The second of two steps is measured, so one-time
    allocations are not counted."""
    embeddings: list[torch.Tensor] = []
    hook = model.get_input_embeddings().register_forward_hook(lambda _m, _a, out: embeddings.append(out))
    try:
        for _ in range(2):
            embeddings.clear()
            gc.collect()
            base = _allocated_bytes()
            with _AllocatorPeak(base) as watch:
                loss = model(**batch).loss
                torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad] if adapters else embeddings)
            del loss
    finally:
        hook.remove()
    return watch.peak


def estimated_saves_only(path: str, report: dict[str, Any], offload: ActivationOffloadConfig) -> dict[str, Any]:
    """The estimate's replay of the saves alone, per setting, for the report's model, batch and
    device: what the offload's counters see (saved tensors, not backward's working set, which
    the report's device figures add). Not a real run: the report's own probe, its backward
    figures and its forwards' temporaries set to nothing."""
    from fsdp_offload_cfg.estimate.activations import settings
    from fsdp_offload_cfg.estimate.model import build_on_meta
    from fsdp_offload_cfg.estimate.probe import measure_activations

    inputs = report["inputs"]
    source = read_model(path)
    compute, load = (getattr(torch, inputs[key]) for key in ("compute_dtype", "load_dtype"))
    model = build_on_meta(source, compute, load)
    image = example_image(source.config, model)
    batch = example_batch(source, inputs["batch_size"], inputs["seq_len"], compute, image)
    profile = measure_activations(model, batch, report["model"]["layer_classes"], target=inputs["device"])
    profile.backward_extra = [0] * (len(profile.groups) + 1)  # measured as nothing: the head adds none either
    profile.forward_peak = []  # no forward moment: the counters see saves, not a layer's temporaries
    profile.backward_entry = []  # nor the gradients beside a recompute
    return settings(profile, offload, offload.resolved_mode(inputs["device"]) == "async")


def cache_bytes(model: nn.Module, batch: dict[str, Any]) -> int:
    """Bytes of the KV cache one forward returns (each storage once; 0 without a cache)."""
    from fsdp_offload_cfg.compat.model_output import output_cache
    from fsdp_offload_cfg.estimate.probe import _cache_tensors

    with torch.no_grad():
        cache = output_cache(model(**batch))
    return _storage_bytes(_cache_tensors(cache))


def checkpoint_every_group(model: nn.Module, layers: list[str]) -> None:
    """torch's non-reentrant `checkpoint_wrapper` on every layer, as accelerate's `fsdp2_apply_ac`."""
    for group in offload_groups(model, layers):
        parent, _, child = next(n for n, m in model.named_modules() if m is group).rpartition(".")
        setattr(model.get_submodule(parent), child, checkpoint_wrapper(group))


def offload_counters(model: nn.Module, batch: dict[str, Any], layers: list[str],
                     offload: ActivationOffloadConfig | None = None) -> dict[str, Any]:
    """`offload_stats()` after one forward and backward with the async handler (CPU proxy;
    `offload`'s other knobs, if given); the
    pinned pool's bytes are this run's own (the gauge counts every live pool in the process, and an
    earlier test may leave one alive: the figure then depended on which tests ran before); the
    resident peak starts from a settled process (`settle_offload_stats`)."""
    before = offload_stats()["pinned_pool_bytes"]
    offload = dataclasses.replace(offload or ActivationOffloadConfig(), enabled=True, mode="async")
    handle = enable_activation_offload(model, offload, layer_classes=layers)
    try:
        settle_offload_stats()
        model(**batch).loss.backward()
        stats = offload_stats()
        return {**stats, "pinned_pool_bytes": stats["pinned_pool_bytes"] - before}
    finally:
        handle.remove()


def pinned_pool_under_fsdp2(rank: int, world: int, path: str, layers: list[str], batch_size: int,
                            seq_len: int) -> int:
    """On each gloo rank: the model sharded by `fully_shard` per layer and root, with the groups a
    prepare gives it (`fsdp2_groups`: a float32 MoE router gate in a bf16 layer gets its own), one
    forward and backward with the offload on; this rank's pinned pool, as `offload_counters` counts it."""
    import torch.distributed.fsdp as fsdp

    from fsdp_offload_cfg.shard_groups import fsdp2_groups

    model, batch = real_model(path, torch.bfloat16, batch_size, seq_len)
    with fsdp2_groups(model):  # swaps `fsdp.fully_shard` while it lasts
        for group in offload_groups(model, layers):
            fsdp.fully_shard(group)
        fsdp.fully_shard(model)
    return offload_counters(model, batch, layers)["pinned_pool_bytes"]


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Each local storage once: several local tensors may view one allocation."""
    storages = [getattr(t, "_local_tensor", t).untyped_storage() for t in tensors]
    return sum({s.data_ptr(): s.nbytes() for s in storages}.values())


def states_after_one_step(rank: int, world: int, path: str, layers: list[str]) -> dict[str, int]:
    """On each gloo rank: `fully_shard` per layer and root with bf16 mixed precision over fp32
    weights, one AdamW step; this rank's parameter, gradient and optimizer-state bytes."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model, batch = real_model(path, torch.float32, 2, 16)
    batch = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in batch.items()}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for group in offload_groups(model, layers):
        fully_shard(group, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters())
    model(**batch).loss.backward()
    optimizer.step()
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
    return {"params": _storage_bytes(params), "grads": _storage_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": _storage_bytes(state)}


def states_after_accelerate_step(rank: int, world: int, path: str, layers: list[str],
                                 replicas: int = 1, lora_rank: int = 0,
                                 modules_to_save: list[str] | None = None) -> dict[str, Any]:
    """On each gloo rank, what a user's run holds: the model loaded in bf16, prepared by the
    installed accelerate (FSDP2, `mixed_precision: bf16`, the loader off; with `replicas` > 1,
    hybrid sharding through its `ParallelismConfig`), one AdamW step; this rank's parameter,
    gradient and optimizer-state bytes and the dtypes accelerate keeps the parameters in (the
    estimate's master-weight dtype is checked against these, not assumed). With `lora_rank`,
    PEFT's LoRA of that rank on every linear layer but the head (and `modules_to_save` trained
    whole), the optimizer over what trains."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch({"distributed_type": "FSDP", "mixed_precision": "bf16", "fsdp_config": {
        "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": layers, "fsdp_cpu_ram_efficient_loading": False}})
    parallel = {}
    if replicas > 1:
        from accelerate.parallelism_config import ParallelismConfig

        parallel["parallelism_config"] = ParallelismConfig(dp_replicate_size=replicas, dp_shard_size=world // replicas)
    accelerator = Accelerator(**parallel)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_rank, target_modules="all-linear",
                                                 modules_to_save=modules_to_save))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(1, 90, (2, 16), generator=torch.Generator().manual_seed(rank))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
    return {"params": _storage_bytes(params), "grads": _storage_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": _storage_bytes(state), "param_dtypes": sorted({str(p.dtype) for p in params})}


def _is_layer(module: torch.nn.Module, layers: list[str]) -> bool:
    """Whether `module` is of a layer class (FSDP2 makes each sharded module's class a subclass of its own)."""
    return any(cls.__name__ in layers for cls in type(module).__mro__)


def gathered_in_the_step(rank: int, world: int, path: str, layers: list[str], reshard: bool) -> dict[str, dict]:
    """On each gloo rank, a model prepared by the installed accelerate (FSDP2, bf16 mixed precision,
    `reshard_after_forward` as given): the bytes of each parameter group FSDP2 holds gathered
    (`after_forward`) once the forward is done, and (`in_backward`) of the groups other than the
    layers' as backward reaches the last layer (its output's gradient, the final norm's input),
    by the modules it shards together (`model.norm,lm_head`; `<root>`); read from FSDP2's own
    state: the group's unsharded parameters' storages (dim 0 padded to a multiple of the ranks, as
    FSDP2 all-gathers it), every storage once."""
    from accelerate import Accelerator
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch({"distributed_type": "FSDP", "mixed_precision": "bf16", "fsdp_config": {
        "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_reshard_after_forward": reshard,
        "fsdp_transformer_layer_cls_to_wrap": layers, "fsdp_cpu_ram_efficient_loading": False}})
    accelerator = Accelerator()
    model = accelerator.prepare(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
    groups: dict[int, tuple[list[str], Any, bool]] = {}  # one group may shard several modules (accelerate's tail)
    for name, module in model.named_modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        if group is not None:
            names, _, _ = groups.setdefault(id(group), ([], group, _is_layer(module, layers)))
            names.append(name or "<root>")

    def gathered(layer_units: bool) -> dict[str, int]:
        return {",".join(names): _storage_bytes(p._unsharded_param for p in group.fsdp_params)
                for names, group, is_layer in groups.values() if group.is_unsharded and (layer_units or not is_layer)}

    seen: dict[str, dict[str, int]] = {}

    def at_the_last_layers_gradient(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        args[0].register_hook(lambda grad: seen.setdefault("in_backward", gathered(layer_units=False)) and None)

    model.get_decoder().norm.register_forward_pre_hook(at_the_last_layers_gradient)
    ids = torch.randint(1, 90, (2, 16), generator=torch.Generator().manual_seed(rank))
    loss = model(input_ids=ids, labels=ids).loss
    seen["after_forward"] = gathered(layer_units=True)
    accelerator.backward(loss)
    return seen
