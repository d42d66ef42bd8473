"""Launched by tests (accelerate launch / torchrun): patch, load, prepare, train, report JSON.

Usage: launch_probe.py CHECKPOINT_DIR [--config PATH] [--steps N]
Prints one line per rank: `PROBE {json}` with what the test asserts on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys

import fsdp_offload_cfg

parser = argparse.ArgumentParser()
parser.add_argument("checkpoint")
parser.add_argument("--config", default=None)
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--load-before-accelerator", action="store_true",
                    help="call from_pretrained before any process group exists")
args = parser.parse_args()

session = fsdp_offload_cfg.patch(args.config)

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

if args.load_before_accelerator:
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint)
    accelerator = Accelerator()
else:
    accelerator = Accelerator()
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint)
meta_after_load = sum(p.numel() for p in model.parameters() if p.is_meta)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)


def _digest(t: torch.Tensor) -> str:
    full = t.full_tensor() if isinstance(t, DTensor) else t
    return f"{full.dtype}:{tuple(full.shape)}:" + hashlib.sha1(
        full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    ).hexdigest()


# Every parameter and buffer, gathered, as bytes: compared with a plain single-process load.
state_digests = {name: _digest(t) for name, t in model.state_dict().items()}
state_digests.update({name: _digest(b) for name, b in model.named_buffers()})
tied = model.get_input_embeddings().weight is getattr(model.get_output_embeddings(), "weight", None)

params = list(model.parameters())
opt_params = [p for g in optimizer.param_groups for p in g["params"]]
losses = []
for step in range(args.steps):
    g = torch.Generator().manual_seed(step * 10 + accelerator.process_index)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
    # use_cache=False: transformers 4.57 builds a KV cache in training forwards, and a checkpointed
    # layer recomputed under accelerate's activation checkpointing would append to it twice.
    loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())

report = {
    "rank": accelerator.process_index,
    "source": session.source,
    "patches": session.patch_names,
    "distributed_type": accelerator.distributed_type.value,
    "backend": torch.distributed.get_backend(),
    "dtensor_params": sum(isinstance(p, DTensor) for p in params),
    "num_params": len(params),
    "local_numel": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params),
    "full_numel": sum(p.numel() for p in params),
    "meta_numel_after_from_pretrained": meta_after_load,
    "optimizer_holds_model_params": len(opt_params) == len(params)
    and all(a is b for a, b in zip(opt_params, params)),
    "losses": losses,
    "losses_finite": all(math.isfinite(x) for x in losses),
    "state_digests": state_digests,
    "tied_after_prepare": tied,
    "tied_after_steps": model.get_input_embeddings().weight is getattr(model.get_output_embeddings(), "weight", None),
    "offload_enabled": session.config.activation_cpu_offload.enabled,
    "cpu_offload_policy": repr(getattr(accelerator.state.fsdp_plugin, "cpu_offload", None)),
    # what accelerate itself runs with (the file plus the launch command line)
    "mixed_precision": accelerator.mixed_precision,
    "plugin_cpu_ram_efficient_loading": accelerator.state.fsdp_plugin.cpu_ram_efficient_loading,
    "plugin_activation_checkpointing": accelerator.state.fsdp_plugin.activation_checkpointing,
    "config_mixed_precision": session.config.mixed_precision,
    "config_cpu_ram_efficient_loading": session.config.cpu_ram_efficient_loading,
    "config_activation_checkpointing": session.config.activation_checkpointing,
}
if session.config.activation_cpu_offload.enabled:
    report["offload_stats"] = fsdp_offload_cfg.offload_stats()
out_dir = os.environ.get("PROBE_DIR")
if out_dir:  # one file per rank: launchers interleave the ranks' stdout
    with open(os.path.join(out_dir, f"rank{report['rank']}.json"), "w") as f:
        json.dump(report, f)
print("PROBE " + json.dumps(report), flush=True)
accelerator.wait_for_everyone()  # no rank tears gloo down while a peer is still talking
accelerator.end_training()
sys.exit(0)
