"""Launched by tests under torchrun: TRL's own `sft` script (`trl sft`'s, run as its module) with
the arguments given, as `fsdp-offload-cfg estimate` reads its `--config` file (tests/test_trl_cli.py).

Usage: trl_sft_probe.py ARGS... — `trl sft`'s arguments. Writes PROBE_DIR/rank{r}.json after the
training: what TRL's defaults made of the run (mixed precision, checkpointing, the adapters) and
what the rank holds of the parameters (local shard bytes and dtypes).
"""

from __future__ import annotations

import json
import os
import runpy
import sys

import fsdp_offload_cfg

fsdp_offload_cfg.patch()  # no config yet: the Trainer's fsdp_config becomes the config

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from trl import SFTTrainer  # noqa: E402

train = SFTTrainer.train


def _train_and_report(self: SFTTrainer, *args, **kwargs):
    result = train(self, *args, **kwargs)
    params = list((self.model_wrapped or self.model).parameters())
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    config = next(iter(getattr(self.model, "peft_config", {}).values()), None)
    report = {
        "rank": self.args.process_index,
        "mixed_precision": self.accelerator.mixed_precision,
        "checkpointing": any(getattr(m, "gradient_checkpointing", False) is True for m in self.model.modules()),
        "param_bytes": sum(t.numel() * t.element_size() for t in local),
        "param_dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in local}),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "targets": sorted(getattr(config, "target_modules", None) or []),
        "dropout": getattr(config, "lora_dropout", None),
    }
    with open(os.path.join(os.environ["PROBE_DIR"], f"rank{report['rank']}.json"), "w") as f:
        json.dump(report, f)
    return result


SFTTrainer.train = _train_and_report
sys.argv = ["sft.py", *sys.argv[1:]]
runpy.run_module("trl.scripts.sft", run_name="__main__")
if torch.distributed.is_initialized():  # TRL's script ends its trainer (transformers >= 5.18), which destroys it
    torch.distributed.barrier()  # no rank tears gloo down while a peer is still talking
    torch.distributed.destroy_process_group()
