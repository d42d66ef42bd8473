"""A framework's external plugin for tests (ms-swift's `--external_plugins`): after the
Trainer's `train`, each rank writes PROBE_DIR/rank{r}.json with what the framework's defaults made
of the run (mixed precision, accumulation, micro-batch, checkpointing, the adapters) and what the
rank holds of the parameters (local shard bytes and dtypes), for `estimate -- COMMAND` to be
checked against (tests/clients/test_swift.py, and tests/scripts/trl_script_probe.py): also the
largest batch the model's forward took (DPO's holds each sample's chosen and rejected), and the
local bytes of a reference model (DPO's), and the bytes of each reward model a rank holds
(GRPO's, whole: parameters and buffers) and of a distillation teacher (whole under TRL, sharded
under ms-swift), with the parameters of a sharded reference model or teacher held whole, and the Trainer's log."""

from __future__ import annotations

import json
import os

import torch
from transformers import Trainer

train = Trainer.train


def _held_whole(model: torch.nn.Module | None) -> list[str]:
    """What of a model sharded by `fully_shard` is held whole after training (a unit left gathered
    after its forward); nothing for a model kept whole on purpose (TRL's teacher) or none."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if not isinstance(model, FSDPModule):
        return []
    return [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]


def _train_and_report(self: Trainer, *args, **kwargs):
    from torch.distributed.tensor import DTensor

    batches = []

    def record(module, args, kwargs):  # a forward pre-hook: the batch of each forward
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor):  # TRL's forward redirection calls it with a module first
            batches.append(ids.shape[0])

    hook = self.model.register_forward_pre_hook(record, with_kwargs=True)
    # the output layer's own forwards with gradients (not generation's): none where TRL's fused heads
    # project through its weight directly
    head_calls = []
    head = self.model.get_output_embeddings()
    head_hook = head.register_forward_hook(lambda *_: head_calls.append(1) if torch.is_grad_enabled() else None) \
        if head is not None else None
    result = train(self, *args, **kwargs)
    hook.remove()
    if head_hook is not None:
        head_hook.remove()
    params = list((self.model_wrapped or self.model).parameters())
    reference = getattr(self, "ref_model", None)
    reference_local = [p.to_local() if isinstance(p, DTensor) else p for p in reference.parameters()] \
        if reference is not None else []
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    rewards = [m for m in getattr(self, "reward_funcs", []) if isinstance(m, torch.nn.Module)]
    teacher = getattr(self, "teacher_model", None)
    reward_tensors = [t.to_local() if isinstance(t, DTensor) else t for m in rewards
                      for t in [*m.parameters(), *m.buffers()]]
    teacher_tensors = [t.to_local() if isinstance(t, DTensor) else t  # ms-swift shards it, TRL keeps it whole
                       for t in [*teacher.parameters(), *teacher.buffers()]] if teacher is not None else []
    config = next(iter(getattr(self.model, "peft_config", {}).values()), None)
    report = {
        "rank": self.args.process_index,
        "mixed_precision": self.accelerator.mixed_precision,
        "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
        "batch_size": self.args.per_device_train_batch_size,
        "checkpointing": any(getattr(m, "gradient_checkpointing", False) is True for m in self.model.modules()),
        "param_bytes": sum(t.numel() * t.element_size() for t in local),
        "param_dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in local}),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "targets": sorted(getattr(config, "target_modules", None) or []),
        "dropout": getattr(config, "lora_dropout", None),
        "dora": bool(getattr(config, "use_dora", False)),
        "modules_to_save": sorted(getattr(config, "modules_to_save", None) or []),
        "vocab": self.model.get_input_embeddings().num_embeddings,
        "forward_batch": max(batches, default=None),
        "output_layer_training_forwards": len(head_calls),
        "reference_param_bytes": sum(t.numel() * t.element_size() for t in reference_local),
        "reward_bytes": sum(t.numel() * t.element_size() for t in reward_tensors),
        "teacher_bytes": sum(t.numel() * t.element_size() for t in teacher_tensors),
        "reference_gathered": _held_whole(reference),
        "log_history": self.state.log_history,  # the Trainer's logged losses and metrics (DPO's rewards)
        "teacher_gathered": _held_whole(teacher),
    }
    with open(os.path.join(os.environ["PROBE_DIR"], f"rank{report['rank']}.json"), "w") as f:
        json.dump(report, f)
    return result


Trainer.train = _train_and_report
