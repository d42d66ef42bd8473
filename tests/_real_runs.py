"""Real runs the memory estimate is checked against (`test_estimate.py` and
`benchmarks/estimate_accuracy.py` share them, so both measure the same way).

Each returns what a real run of the model measures: saved bytes through saved-tensor hooks,
the offload's own counters, rank 0's local storages after `fully_shard` and one AdamW step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from fsdp_offload_cfg.estimate.model import example_batch, model_class, read_model
from fsdp_offload_cfg.estimate.probe import offload_groups
from fsdp_offload_cfg.offload import enable_activation_offload
from fsdp_offload_cfg.offload.options import ActivationOffloadConfig
from fsdp_offload_cfg.offload.stats import SavedBytesMeter, offload_stats, reset_offload_stats


def real_model(path: str, dtype: torch.dtype, batch_size: int, seq_len: int) -> tuple[nn.Module, dict[str, Any]]:
    """The model as `from_pretrained` loads it, in training mode, and the estimate's batch with
    real images (the estimate puts them on meta)."""
    source = read_model(path)
    model = model_class(source.config).from_pretrained(path, dtype=dtype)
    batch = example_batch(source, batch_size, seq_len, dtype)
    if "pixel_values" in batch:
        batch["pixel_values"] = torch.randn(batch["pixel_values"].shape, dtype=dtype)
    return model.train(), batch


def saved_bytes(model: nn.Module, batch: dict[str, Any]) -> int:
    """Bytes saved for backward at the end of one forward (each storage once, no parameters)."""
    with SavedBytesMeter(model) as meter:
        model(**batch)
    return meter.peak_bytes


def checkpoint_every_group(model: nn.Module, layers: list[str]) -> None:
    """torch's non-reentrant `checkpoint_wrapper` on every layer, as accelerate's `fsdp2_apply_ac`."""
    for group in offload_groups(model, layers):
        parent, _, child = next(n for n, m in model.named_modules() if m is group).rpartition(".")
        setattr(model.get_submodule(parent), child, checkpoint_wrapper(group))


def offload_counters(model: nn.Module, batch: dict[str, Any], layers: list[str]) -> dict[str, Any]:
    """`offload_stats()` after one forward and backward with the async handler (CPU proxy)."""
    handle = enable_activation_offload(model, ActivationOffloadConfig(enabled=True, mode="async"), layer_classes=layers)
    try:
        reset_offload_stats()
        model(**batch).loss.backward()
        return offload_stats()
    finally:
        handle.remove()


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
