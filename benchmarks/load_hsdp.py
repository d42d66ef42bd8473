"""Loading under hybrid sharding (HSDP): what the replicas' split of the reading costs and saves
(`fsdp_offload_cfg/loading/replicas.py`).

The ~320M Llama (1.20 GiB fp32, one safetensors file), `auto` loading on 4 gloo CPU ranks of
this machine, the page cache warm (one load before the measured ones, in the same launch). Rows:

  FSDP2, 1 x 4                plain sharding over the 4 ranks: each reads a quarter
  HSDP 2 x 2, one node        2 replicas x 2 shards on one node: each rank reads its own slices
                              (the replicas share the page cache: no split)
  HSDP 2 x 2, a replica per   the ranks numbered as 2 nodes x 2 (torchrun's GROUP_RANK), a
  node, split                 replica on each: the replicas split the reading and broadcast
  ... each reads its own      the same with the split turned off (what the loader did before:
                              the checkpoint read once per replica, i.e. per node)

The 2 "nodes" are processes of one machine: their broadcast runs over loopback gloo, not a
network, and their reads hit one page cache. The bytes are what a real job reads; the seconds
are not what it takes. On the project's 2-core machine they also depend on the order of the
rows: the second 2-D-mesh launch of a run read 2-4x slower than the same row elsewhere in the
order (`--rows` reorders; not investigated further).

Per row: the bytes read from the files by all ranks together (the loader's count, and the
kernel's `rchar` around the load), the most any rank read, what the replicas passed each other,
and the seconds of `load_into_sharded` on the slowest rank (median of `--repeat` loads).

    python benchmarks/load_hsdp.py [--repeat 3] [--model-dir /tmp/bench_models]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

# (row, mesh, nodes the 4 ranks are numbered as, the split left on)
ROWS = [("FSDP2, 1 x 4", (4,), 1, True), ("HSDP 2 x 2, one node", (2, 2), 1, True),
        ("HSDP 2 x 2, a replica per node, split", (2, 2), 2, True),
        ("HSDP 2 x 2, a replica per node, each reads its own", (2, 2), 2, False)]  # fmt: skip


def _shard(mesh_shape: tuple[int, ...]) -> Any:
    def shard(model: Any) -> Any:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape):])
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    return shard


def _worker(rank: int, world_size: int, path: str, mesh_shape: tuple[int, ...], split: bool,
            repeat: int) -> list[dict[str, Any]]:
    import torch.distributed as dist
    from transformers import LlamaForCausalLM, PreTrainedModel

    from fsdp_offload_cfg.loading import auto_from_pretrained, load_into_sharded, replicas
    from fsdp_offload_cfg.testing.reads import rchar

    if not split:
        replicas.assign_readers = lambda *_args: []  # each rank reads its whole slices
    out = []
    for _ in range(repeat + 1):  # the first load warms the page cache and the imports
        model = auto_from_pretrained(PreTrainedModel.from_pretrained, LlamaForCausalLM, path)
        dist.barrier()
        before, start = rchar(), time.perf_counter()
        report = load_into_sharded(model, _shard(mesh_shape), strategy="auto")
        seconds, kernel = time.perf_counter() - start, rchar() - before
        out.append({"seconds": seconds, "kernel": kernel, "read": report.ranks[rank].bytes_read,
                    "from_replicas": report.ranks[rank].bytes_from_replicas})
        del model, report
    return out[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model-dir", default="/tmp/bench_models")
    parser.add_argument("--rows", type=int, nargs="*", default=list(range(len(ROWS))), help="which rows, in order")
    args = parser.parse_args()

    from fsdp_offload_cfg.testing.dist import run_workers
    from fsdp_offload_cfg.testing.models import save_llama_300m
    from fsdp_offload_cfg.testing.reads import checkpoint_tensor_bytes

    path = os.path.join(args.model_dir, "llama-300m-fp32")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        save_llama_300m(path)
    total = checkpoint_tensor_bytes(path)
    gib = 2**30
    print(f"~320M Llama, {total / gib:.2f} GiB fp32, `auto`, 4 gloo ranks, median of {args.repeat} loads\n")
    print("| sharding | read by all ranks, GiB (x checkpoint) | kernel's count, GiB | most read by one rank, GiB "
          "| passed between replicas, GiB | load s (slowest rank) |")
    print("|---|---|---|---|---|---|")
    for name, mesh_shape, nodes, split in (ROWS[i] for i in args.rows):
        ranks = run_workers(_worker, 4, path, mesh_shape, split, args.repeat, timeout=1800,
                            local_world_size=4 // nodes)
        loads = list(zip(*ranks))  # per load, every rank's figures
        read = statistics.median(sum(r["read"] for r in load) for load in loads)
        kernel = statistics.median(sum(r["kernel"] for r in load) for load in loads)
        most = statistics.median(max(r["read"] for r in load) for load in loads)
        passed = statistics.median(sum(r["from_replicas"] for r in load) for load in loads)
        seconds = statistics.median(max(r["seconds"] for r in load) for load in loads)
        print(f"| {name} | {read / gib:.2f} ({read / total:.2f}x) | {kernel / gib:.2f} | {most / gib:.2f} "
              f"| {passed / gib:.2f} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
