"""Launched by tests/test_loading_cuda.py under torchrun: meta loading into FSDP2 shards on a device.

Usage: device_load_probe.py CHECKPOINT --device cuda|cpu --strategy auto|sharded [--dtype NAME]
       [--offload-params] --out DIR

Two ranks share one GPU, so the process group is gloo (NCCL takes one rank per GPU): the loader's
agreements are object collectives and its reads need no tensor collective, so nothing here asks
gloo for a CUDA collective. `--device cpu` runs the same on CPU shards (the gloo tests' case).
Each rank compares its local shard of every parameter, and every buffer, with the same slice of a
plain single-process `from_pretrained` (FSDP2's `Shard(0)`: `torch.chunk` along dim 0), and
writes `rank{R}.json`.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import LlamaForCausalLM, PreTrainedModel

from fsdp_offload_cfg.loading import auto_from_pretrained, load_into_sharded, sharded_from_pretrained

parser = argparse.ArgumentParser()
parser.add_argument("checkpoint")
parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
parser.add_argument("--strategy", choices=["auto", "sharded"], required=True)
parser.add_argument("--dtype", default=None, help="from_pretrained(dtype=...): float32 for a bf16 checkpoint")
parser.add_argument("--offload-params", action="store_true", help="CPUOffloadPolicy: pinned host shards")
parser.add_argument("--out", required=True)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if args.device == "cuda":
    torch.cuda.set_device(0)  # every rank on the one GPU
    torch.cuda.init()  # initialised: the device mesh then keeps it, where it would set LOCAL_RANK's (cuda:1)
mesh = init_device_mesh(args.device, (world,))
original = PreTrainedModel.from_pretrained.__func__
kwargs = {"dtype": getattr(torch, args.dtype)} if args.dtype else {}
body = auto_from_pretrained if args.strategy == "auto" else sharded_from_pretrained
model = body(original, LlamaForCausalLM, args.checkpoint, **kwargs)
meta_after_load = all(t.is_meta for t in model.parameters())


def shard(m: torch.nn.Module) -> None:  # as accelerate's fsdp2_prepare_model: each layer, then the root
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=args.device == "cuda")} if args.offload_params else {}
    for layer in m.model.layers:
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(m, mesh=mesh, **policy)


report = load_into_sharded(model, shard, strategy=args.strategy, cpu_offload=args.offload_params)
plain = original(LlamaForCausalLM, args.checkpoint, **kwargs)
expected = dict(plain.named_parameters()) | dict(plain.named_buffers())
got = dict(model.named_parameters()) | dict(model.named_buffers())
wrong, devices, pinned = [], set(), set()
for name, full in sorted(expected.items()):
    mine = got[name]
    local = mine.to_local() if isinstance(mine, DTensor) else mine
    chunks = torch.chunk(full.detach(), world, dim=0) if isinstance(mine, DTensor) else (full.detach(),) * world
    want = chunks[rank] if rank < len(chunks) else full.detach()[:0]
    if isinstance(mine, DTensor):
        devices.add(str(local.device))
        pinned.add(local.device.type == "cpu" and local.is_pinned())
    if local.dtype != want.dtype or local.shape != want.shape or not torch.equal(local.detach().cpu(), want):
        wrong.append(name)
result = {"rank": rank, "meta_after_load": meta_after_load, "checked": len(expected), "wrong": wrong,
          "names_match": sorted(got) == sorted(expected), "param_devices": sorted(devices),
          "params_pinned": sorted(pinned)}
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.barrier()
dist.destroy_process_group()
