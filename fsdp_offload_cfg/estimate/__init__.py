"""`estimate_memory`: per-rank device and host memory of an FSDP2 run, before it is launched.

The steps, each in its own module:
1. `model`: the user's model on `meta` with its real class, one rank's batch;
2. `probe`: one forward on `meta` under saved-tensor hooks: what autograd keeps, per group;
3. `activations`: that record replayed under checkpointing and the activation CPU offload;
4. `states`: sharded parameters, gradients, optimizer state and the unsharded transients;
5. `loading`: the host peak of each loading strategy;
6. `plan` (with an activation budget): each layer's keep / offload / checkpoint choice that fits it;
7. `report`: the JSON document (stable keys, `docs/estimate.md`) and its table.

The config goes through the same `load_config` as `patch()` and `validate`, so a config the run
would refuse is refused here with the same words. The inputs are checked (flags, the model's
`config.json`) before torch is imported: a mistyped path is said in a second, not after five.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_offload_cfg._sizes import AutoBudget
from fsdp_offload_cfg.config import FSDPOffloadConfig
from fsdp_offload_cfg.estimate.adapters import Lora, check_lora
from fsdp_offload_cfg.estimate.inputs import (
    DEVICES,
    LOSS_HEADS,
    OPTIMIZERS,
    Dtypes,
    EstimateError,
    auto_device_bytes,
    check_dtype_name,
    requested_budget,
    resolve_dtypes,
)
from fsdp_offload_cfg.estimate.source import model_config_file

__all__ = ["DEVICES", "LOSS_HEADS", "OPTIMIZERS", "Dtypes", "EstimateError", "Lora", "estimate_memory", "resolve_dtypes"]


def estimate_memory(config: FSDPOffloadConfig, model: str, *, seq_len: int, batch_size: int,
                    num_processes: int | None = None, optimizer: str = "adamw", device: str | None = None,
                    dtype: str | None = None, activation_budget: int | AutoBudget | None = None,
                    device_memory: int | None = None, compute_flops: float | None = None,
                    copy_bytes: float | None = None, gradient_accumulation_steps: int = 1,
                    parallelism: Mapping[str, Any] | None = None, lora: Lora | None = None,
                    machines: int = 1, reference: bool = False, reward_model: str | Sequence[str] | None = None,
                    teacher_model: str | None = None, teacher_dtype: str | None = None,
                    companions_sharded: bool = False, loss_head: str = "cross_entropy",
                    completion_tokens: int | None = None, colocated_share: float | None = None) -> dict[str, Any]:
    """The estimate as the JSON document `fsdp-offload-cfg estimate --format json` prints; with
    `activation_budget` (bytes, or `auto`: what a device of `device_memory` bytes leaves, see
    `estimate/room.py`), also the per-layer plan that keeps activations within it
    (`estimate.plan`), timed at `compute_flops` FLOP/s and `copy_bytes` bytes/s (default: the
    device's assumed rates). With `gradient_accumulation_steps` > 1 every gradient is on the
    device during backward (kept from the micro-batches before). `parallelism`: an accelerate
    `parallelism_config` section (default: the config's); under hybrid sharding each rank holds a
    slice of 1 / `dp_shard_size`, not 1 / ranks, and that is what the figures per rank count.
    `lora`: LoRA adapters trained over the frozen model (`estimate/adapters.py`). `machines`: the
    machines the ranks run on (accelerate's `num_machines`), over which FSDP1's HYBRID_SHARD copies
    and whose host memory `per_machine` adds up.
    `reference`: a frozen copy of the model sharded beside it (TRL's reference model).
    `reward_model`: the path of a reward model (or several) held whole on every rank (TRL's GRPO
    and RLOO); `teacher_model`: a distillation teacher's, held so too (TRL's `DistillationTrainer`),
    loaded in `teacher_dtype` (default: `dtype`, as TRL's script loads both; `auto`: its
    checkpoint's). `companions_sharded`: those sharded beside the model instead, frozen, as
    ms-swift's `prepare_fsdp` shards its reward models and teacher. `loss_head`: what the loss
    goes through (`estimate/heads.py`): the model's own `cross_entropy` over the full logits,
    `trl_fused_lm_head` (TRL's `sft`, `dpo`, `kto`, `grpo`, `rloo`: log-probabilities tile by
    tile) or `trl_chunked_distillation` (its distillation against `teacher_model`);
    `completion_tokens`: the positions it scores at each sequence's end (a generated
    completion's), None: every one. `colocated_share`: the fraction of each device an engine
    colocated with the run holds (vLLM's `vllm_gpu_memory_utilization` under TRL's GRPO), which
    `auto`'s room counts as taken."""
    ranks = num_processes or config.num_processes
    _check_inputs(ranks, seq_len, batch_size, optimizer, device, dtype, activation_budget)
    if colocated_share is not None and not 0 <= colocated_share < 1:
        raise EstimateError(f"vllm_gpu_memory_utilization: expected a fraction from 0 to 1, got {colocated_share:g}")
    if gradient_accumulation_steps < 1:
        raise EstimateError(f"--gradient-accumulation-steps must be >= 1, got {gradient_accumulation_steps}")
    if lora is not None:
        check_lora(lora)
    section = (config.parallelism_config if parallelism is None else parallelism) or {}
    replicas = _replicas(ranks, section) if section or config.version != 1 else _fsdp1_replicas(config, ranks, machines)
    device = device or ("cpu" if config.use_cpu else "cuda")
    requested = requested_budget(config, activation_budget)
    if isinstance(requested, AutoBudget):  # a size missing, said before the model is read
        device_memory = auto_device_bytes(config, requested, device_memory, device)
    model_config_file(model)  # a model that is not there, said before torch's import
    reward_models = (reward_model,) if isinstance(reward_model, str) else tuple(reward_model or ())
    for other in (*reward_models, teacher_model):
        if other is not None:
            model_config_file(other)
    _check_head(loss_head, completion_tokens, teacher_model)
    teacher_dtype = dtype if teacher_dtype is None else None if teacher_dtype == "auto" else teacher_dtype
    if teacher_dtype is not None:
        check_dtype_name(teacher_dtype)
    from fsdp_offload_cfg.estimate.report import build_report

    return build_report(config, model, ranks=ranks // replicas, replicas=replicas, seq_len=seq_len,
                        batch_size=batch_size, optimizer=optimizer, device=device, dtype=dtype,
                        activation_budget=requested,
                        the_run_plans_it=activation_budget is None and requested is not None,
                        device_memory=device_memory, rates=(compute_flops, copy_bytes),
                        accumulating=gradient_accumulation_steps > 1, lora=lora, reference=reference,
                        reward_models=reward_models,
                        teacher=(teacher_model, teacher_dtype) if teacher_model is not None else None,
                        companions_sharded=companions_sharded, loss_head=loss_head,
                        completion_tokens=completion_tokens, colocated_share=colocated_share, machines=machines)


def _check_head(loss_head: str, completion_tokens: int | None, teacher_model: str | None) -> None:
    if loss_head not in LOSS_HEADS:
        raise EstimateError(f"loss_head: expected one of {', '.join(LOSS_HEADS)}, got {loss_head!r}")
    if loss_head == "trl_chunked_distillation" and teacher_model is None:
        raise EstimateError("loss_head trl_chunked_distillation: the divergence needs its teacher (teacher_model)")
    if completion_tokens is not None and completion_tokens < 1:
        raise EstimateError(f"completion_tokens must be >= 1 (got {completion_tokens})")


def _replicas(ranks: int, parallelism: Mapping[str, Any]) -> int:
    """How many copies of each slice the ranks hold (HSDP's `dp_replicate_size`), checked as
    accelerate checks the sizes against the ranks. Tensor, context and sequence parallelism cut
    the model in other ways, which the estimate does not model: refused rather than misstated."""
    sizes = {str(k).removeprefix("parallelism_config_"): v for k, v in parallelism.items()}
    other = [f"{name}={sizes[name]}" for name in ("tp_size", "cp_size", "sp_size") if (sizes.get(name) or 1) > 1]
    if other:
        raise EstimateError(f"parallelism_config {', '.join(other)}: the estimate models FSDP2 sharding and "
                            "hybrid sharding (dp_replicate_size, dp_shard_size) only")
    replicas, shards = sizes.get("dp_replicate_size") or 1, sizes.get("dp_shard_size") or 1
    if parallelism and replicas * shards != ranks:
        raise EstimateError(f"parallelism_config: dp_replicate_size {replicas} x dp_shard_size {shards} is not the "
                            f"{ranks} ranks (accelerate refuses it too); pass --num-processes or fix the sizes")
    return replicas


def _fsdp1_replicas(config: FSDPOffloadConfig, ranks: int, machines: int) -> int:
    """The copies FSDP1's sharding strategy keeps: HYBRID_SHARD and HYBRID_SHARD_ZERO2 shard within
    a machine and copy across the machines (torch's FSDP1 splits its groups by the processes of a
    node); FULL_SHARD and SHARD_GRAD_OP shard over all ranks. NO_SHARD (DDP's layout: the whole
    model on every rank, no gathering) is refused, naming the estimate that stands for it."""
    strategy = str(config.sharding_strategy or "FULL_SHARD")
    if strategy == "NO_SHARD":
        raise EstimateError("sharding_strategy NO_SHARD keeps the whole model on every rank, as DDP: the estimate "
                            "models sharded ranks; --num-processes 1 counts one rank holding all of it")
    if strategy not in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        return 1
    if machines < 1 or ranks % machines:
        raise EstimateError(f"sharding_strategy {strategy}: {ranks} ranks do not split evenly over {machines} "
                            "machines (num_machines); fix num_machines or --num-processes")
    return machines


def _check_inputs(ranks: int | None, seq_len: int, batch_size: int, optimizer: str, device: str | None,
                  dtype: str | None, activation_budget: int | AutoBudget | None) -> None:
    if not ranks or ranks < 1:
        raise EstimateError("the number of ranks is unknown: the config has no num_processes; pass --num-processes")
    if seq_len < 1 or batch_size < 1:
        raise EstimateError(f"--seq-len and --batch-size must be >= 1 (got {seq_len} and {batch_size})")
    if optimizer not in OPTIMIZERS:
        raise EstimateError(f"--optimizer: expected one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if isinstance(activation_budget, int) and activation_budget <= 0:
        raise EstimateError(f"--activation-budget must be positive, got {activation_budget}")
    if device is not None and device not in DEVICES:
        raise EstimateError(f"--device: expected one of {', '.join(DEVICES)}, got {device!r}")
    if dtype is not None:
        check_dtype_name(dtype)

