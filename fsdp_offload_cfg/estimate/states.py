"""Parameters, gradients and optimizer state per rank under FSDP2, and the unsharded transients.

FSDP2 (`fully_shard`) shards every parameter on dim 0: each rank holds ceil(rows / world) rows
(the last ranks may hold fewer; rank 0 always holds the full chunk, so rank 0 is the rank
reported). Gradients and AdamW's two moments take the same shape and dtype as the sharded
parameter. Buffers are not sharded: every rank holds all of them.

Dtypes follow accelerate: with `mixed_precision` bf16/fp16, `fsdp2_prepare_model` upcasts the
parameters to fp32 before sharding (fp32 master weights; accelerate 1.13 does not, and its
masters stay in the load dtype: `compat.master_weights`) and FSDP2 gathers them in the low
precision for compute; without it, parameters stay in the dtype they were loaded in, and one
the load keeps in float32 (a MoE router gate in a bf16 model) stays float32, in its own group
(`dtype_groups`), gathered in float32. The model passed in carries those float32 parameters.

Units (what is gathered at once) follow accelerate's `fsdp2_prepare_model`: one per layer class,
the input embedding when untied, a tail of [final norm, lm_head] (plus the embedding when tied)
kept unsharded from forward to backward (`reshard_after_forward=False`), and the root, which holds
what is left and also stays unsharded. accelerate 1.10-1.13 leave the embedding in the root with
the head, gathered the whole step (`compat.unit_layout`). Under the config's `reshard_after_forward: false` (FSDP1's
SHARD_GRAD_OP and HYBRID_SHARD_ZERO2) accelerate gives every unit that: each layer forward
gathered stays gathered until its backward, so backward starts with the whole model gathered
(`units_stay_gathered`, `ShardedStates.gathered_in_backward`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_offload_cfg.compat.unit_layout import embedding_is_a_unit
from fsdp_offload_cfg.config.keys import FSDP2_RESHARD_FOR
from fsdp_offload_cfg.config.model import FSDPOffloadConfig
from fsdp_offload_cfg.offload.groups import find_units


@dataclass(frozen=True)
class ShardedStates:
    params: int  # rank 0's sharded parameters
    grads: int
    optimizer: int
    buffers: int  # replicated on every rank
    unit_max: int  # largest layer/embedding unit, unsharded in the compute dtype
    always_gathered: int  # tail + root leftovers, unsharded in the compute dtype for the whole step
    param_count: int
    units_gathered: int = 0  # every layer/embedding unit, unsharded in the compute dtype
    reference: int = 0  # a frozen copy's shards (DPO's reference model), in the load dtype: no gradient, no state
    units_stay: bool = False  # reshard_after_forward false: a unit stays gathered from its forward to its backward
    # reward models, whole on every rank in their load dtype: TRL's GRPO and RLOO prepare them in evaluation mode,
    # which accelerate leaves unsharded (and on the device whatever `offload_params` says)
    reward: int = 0
    teacher: int = 0  # a distillation teacher (`trl distillation`), whole on every rank likewise
    # ms-swift shards its reward models and teacher as it shards the reference model (its `prepare_fsdp`):
    # then `reward` and `teacher` are rank 0's shards, which live where the model's do
    companions_sharded: bool = False

    @property
    def held_whole(self) -> int:
        """The frozen models every rank holds whole on the device beside its shards."""
        return 0 if self.companions_sharded else self.reward + self.teacher

    @property
    def frozen_shards(self) -> int:
        """The frozen models' shards beside the model's (a reference model; ms-swift's reward
        models and teacher): no gradient, no optimizer state; they live where the model's do."""
        return self.reference + (self.reward + self.teacher if self.companions_sharded else 0)

    def gathered_in_backward(self, left: float = 1.0) -> int:
        """The parameters gathered at a moment of backward where `left` is the share of the units
        it has not yet passed: the tail and root's, and one unit's unsharded gradients; then,
        resharded after forward, the unit computing and the one prefetched (FSDP2 gathers one
        ahead); kept gathered, every unit backward has not yet passed (its post-backward reshards it)."""
        if self.units_stay:
            return self.always_gathered + math.ceil(self.units_gathered * left) + self.unit_max
        return self.always_gathered + 3 * self.unit_max


def units_stay_gathered(config: FSDPOffloadConfig) -> bool:
    """Whether the config keeps each unit gathered from its forward to its backward: FSDP2's
    `reshard_after_forward: false`; under FSDP1, the sharding strategies accelerate maps to it."""
    if config.version == 1:  # the config names the strategy (a number given becomes its name)
        return not FSDP2_RESHARD_FOR.get(str(config.sharding_strategy or "FULL_SHARD"), True)
    return config.reshard_after_forward is False


def shard_numel(shape: torch.Size, world: int) -> int:
    """Elements of rank 0's dim-0 shard (FSDP2 `Shard(0)`; a scalar counts as one row)."""
    rows = shape[0] if len(shape) else 1
    rest = math.prod(shape[1:]) if len(shape) > 1 else 1
    return math.ceil(rows / world) * rest


def _unit_params(model: nn.Module, layer_classes: list[str]) -> tuple[list[list[nn.Parameter]], list[nn.Parameter]]:
    """Parameters per gathered-and-freed unit, and those gathered for the whole step."""
    seen: set[int] = set()

    def take(module: nn.Module | None) -> list[nn.Parameter]:
        if module is None:
            return []
        out = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in out)
        return out

    units = [take(m) for m in find_units(model, layer_classes or None)]
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    tied = embed is not None and head is not None and getattr(embed, "weight", None) is getattr(head, "weight", 0)
    own_unit = not tied and embedding_is_a_unit()  # accelerate 1.10-1.13: the root holds it, beside the head
    if own_unit:
        units.append(take(embed))
    always = take(head) + ([] if own_unit else take(embed))
    always += [p for p in model.parameters() if id(p) not in seen]  # final norm and root leftovers
    return units, always


def sharded_states(model: nn.Module, layer_classes: list[str], world: int, storage_dtype: torch.dtype,
                   compute_dtype: torch.dtype, optimizer: str, trained: set[int] | None = None,
                   frozen_dtype: torch.dtype | None = None, units_stay: bool = False,
                   reference_dtype: torch.dtype | None = None) -> ShardedStates:
    """Per-rank bytes of everything FSDP2 and the optimizer keep for `model` on `world` ranks.

    `trained`: id() of the parameters that get a gradient (the probe's loss graph); a parameter
    the loss never reaches gets no gradient and no optimizer state. None: all of them.
    `frozen_dtype`: what a parameter that does not require grad is stored in (a LoRA's base;
    default `storage_dtype`). `units_stay`: `units_stay_gathered` of the config. `reference_dtype`:
    a frozen copy of the model is sharded beside it in that dtype (TRL's DPO reference model, which
    TRL's `prepare_fsdp` shards as loaded, with no upcast)."""
    params = list(model.parameters())  # tied parameters once
    frozen_dtype = frozen_dtype or storage_dtype
    mixed = storage_dtype != compute_dtype  # FSDP2 gathers every parameter in the compute dtype

    def stored(p: nn.Parameter) -> int:
        size = (storage_dtype if p.requires_grad else frozen_dtype).itemsize
        return max(size, p.element_size()) if p.is_floating_point() else p.element_size()

    def gathered(unit: list[nn.Parameter]) -> int:  # all-gathered with dim 0 padded to a multiple of the ranks
        return sum(shard_numel(p.shape, world) * world * (compute_dtype.itemsize if mixed else stored(p)) for p in unit)

    sharded = sum(shard_numel(p.shape, world) * stored(p) for p in params)
    trainable = sum(shard_numel(p.shape, world) * stored(p) for p in params
                    if p.requires_grad and (trained is None or id(p) in trained))
    moments = {"adamw": 2, "adamw_fused": 2, "sgd": 0}[optimizer]
    units, always = _unit_params(model, layer_classes)
    return ShardedStates(
        params=sharded,
        grads=trainable,
        optimizer=moments * trainable,
        buffers=sum(b.numel() * b.element_size() for b in model.buffers()),
        unit_max=max((gathered(unit) for unit in units), default=0),
        always_gathered=gathered(always),
        param_count=sum(p.numel() for p in params),
        units_gathered=sum(gathered(unit) for unit in units),
        units_stay=units_stay,
        reference=sum(shard_numel(p.shape, world) * (max(reference_dtype.itemsize, p.element_size())
                                                     if p.is_floating_point() else p.element_size())
                      for p in params) if reference_dtype is not None else 0,
    )
