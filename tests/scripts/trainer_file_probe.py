"""Launched by tests under torchrun: the transformers Trainer built from a Trainer's file, as
`fsdp-offload-cfg estimate` reads that file (tests/test_launch.py).

Usage: trainer_file_probe.py ARGS_JSON CHECKPOINT_DIR — the file's keys are TrainingArguments';
the model loads in bfloat16. Writes PROBE_DIR/rank{r}.json: what the rank holds of the
parameters after a step (local shard bytes and dtypes).
"""

from __future__ import annotations

import json
import os
import sys

import fsdp_offload_cfg

fsdp_offload_cfg.patch()  # no config yet: the Trainer's fsdp_config becomes the config

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: E402

args_file, checkpoint = sys.argv[1], sys.argv[2]
with open(args_file, encoding="utf-8") as f:
    args = TrainingArguments(**json.load(f))
model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
g = torch.Generator().manual_seed(0)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 97, (8, 16), generator=g)]
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train()
params = list((trainer.model_wrapped or trainer.model).parameters())
local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
report = {
    "rank": args.process_index,
    "mixed_precision": trainer.accelerator.mixed_precision,
    "param_bytes": sum(t.numel() * t.element_size() for t in local),
    "param_dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in local}),
}
with open(os.path.join(os.environ["PROBE_DIR"], f"rank{report['rank']}.json"), "w") as f:
    json.dump(report, f)
torch.distributed.barrier()  # no rank tears gloo down while a peer is still talking
torch.distributed.destroy_process_group()
