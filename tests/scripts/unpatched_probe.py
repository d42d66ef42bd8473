"""A training script with no line of fsdp_offload_cfg in it (what a framework CLI runs): load,
prepare, one step; writes `$PROBE_DIR/rank<N>.json` with what the zero-code tests assert on (one
file per rank: launchers interleave the ranks' stdout)."""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

accelerator = Accelerator()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
ids = torch.arange(8).reshape(1, 8)
loss = model(input_ids=ids, labels=ids, use_cache=False).loss
accelerator.backward(loss)
optimizer.step()

plugin = sys.modules.get("fsdp_offload_cfg")  # imported by the zero-code entry, not by this script
config = plugin.active_config() if plugin is not None else None
stats = plugin.offload_stats() if plugin is not None else {}
result = {
    "rank": accelerator.process_index,
    "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
    "mesh": {name: size for name, size in zip(mesh.mesh_dim_names or (), mesh.shape)}
    if (mesh := getattr(next(model.parameters()), "device_mesh", None)) is not None else None,
    "patched": config is not None,
    "offloaded_bytes": stats.get("offloaded_bytes", 0),
    "loss": loss.item(),
}
with open(os.path.join(os.environ["PROBE_DIR"], f"rank{result['rank']}.json"), "w") as f:
    json.dump(result, f)
accelerator.wait_for_everyone()
accelerator.end_training()
