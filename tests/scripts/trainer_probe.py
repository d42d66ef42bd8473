"""Launched by tests under torchrun: the transformers Trainer with plugin keys in `fsdp_config`.

Usage: trainer_probe.py CHECKPOINT_DIR OUTPUT_DIR — prints `PROBE {json}` per rank.
"""

from __future__ import annotations

import json
import math
import os
import sys

import fsdp_offload_cfg

fsdp_offload_cfg.patch()  # no config yet: the Trainer's fsdp_config becomes the config

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: E402

from fsdp_offload_cfg.budget import planned_choices  # noqa: E402

checkpoint, output_dir = sys.argv[1], sys.argv[2]
BUDGET_RATES = {"activation_budget_compute_tflops": 0.05, "activation_budget_copy_gb_per_s": 5}  # a plan the test can repeat
args = TrainingArguments(
    output_dir=output_dir,
    per_device_train_batch_size=2,
    max_steps=2,
    learning_rate=1e-3,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    use_cpu=False,
    fsdp=True,
    fsdp_config={
        "version": 2,
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "cpu_ram_efficient_loading": True,
        "activation_cpu_offload": {"mode": "sync", "min_tensor_bytes": 0},
        # PROBE_BUDGET: the same run planned to an activation memory budget (docs/offload.md)
        **({"activation_memory_budget": os.environ["PROBE_BUDGET"], **BUDGET_RATES} if os.environ.get("PROBE_BUDGET")
           else {}),
    },
)
model = AutoModelForCausalLM.from_pretrained(checkpoint)
meta_numel = sum(p.numel() for p in model.parameters() if p.is_meta)
g = torch.Generator().manual_seed(0)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 97, (8, 16), generator=g)]
trainer = Trainer(model=model, args=args, train_dataset=data)
result = trainer.train()
wrapped = trainer.model_wrapped if trainer.model_wrapped is not None else trainer.model
params = list(wrapped.parameters())
cfg = fsdp_offload_cfg.active_config()
report = {
    "rank": args.process_index,
    "source": cfg.source if cfg else None,
    "distributed_type": trainer.accelerator.distributed_type.value,
    "dtensor_params": sum(isinstance(p, DTensor) for p in params),
    "num_params": len(params),
    "full_numel": sum(p.numel() for p in params),
    "meta_numel_after_from_pretrained": meta_numel,
    "train_loss_finite": math.isfinite(result.training_loss),
    "offload_enabled": bool(cfg and cfg.activation_cpu_offload.enabled),
    "offload_stats": fsdp_offload_cfg.offload_stats(),
    "training_loss": result.training_loss,
    "choices": planned_choices(wrapped),
}
out_dir = os.environ.get("PROBE_DIR")
if out_dir:  # one file per rank: launchers interleave the ranks' stdout
    with open(os.path.join(out_dir, f"rank{report['rank']}.json"), "w") as f:
        json.dump(report, f)
print("PROBE " + json.dumps(report), flush=True)
torch.distributed.barrier()  # no rank tears gloo down while a peer is still talking
torch.distributed.destroy_process_group()
