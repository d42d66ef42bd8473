"""Each checkpoint byte read once across the job under `sharded` and `auto`: every rank reads its
own slices and nothing else, counted by the loader and by the kernel (`/proc/self/io` `rchar`:
the bytes this process's `read`/`pread` calls returned), on 2 real gloo ranks.

The kernel's count is taken around a second `load_into_sharded` of the same checkpoint, so that
the first one's lazy imports (Python reading its own `.py` files) are not counted. It is compared
on rank 1: rank 0 hosts the process group's store, and the kernel counts the store's socket reads
too (seen: about 15 KB more than the loader's count on rank 0 under `auto` on the axolotl leg);
what else rank 1 reads meanwhile is a few hundred bytes.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.models import shard_by_layer
from fsdp_offload_cfg.testing.reads import KERNEL_SLACK, checkpoint_tensor_bytes, needed_and_row, rchar

pytestmark = pytest.mark.distributed


def _worker(rank: int, world_size: int, strategy: str, path: str) -> dict[str, Any]:
    from transformers import LlamaForCausalLM, PreTrainedModel

    from fsdp_offload_cfg.loading import auto_from_pretrained, load_into_sharded, sharded_from_pretrained

    load = sharded_from_pretrained if strategy == "sharded" else auto_from_pretrained

    for _ in range(2):  # the second load is the measured one
        model = load(PreTrainedModel.from_pretrained, LlamaForCausalLM, path)
        before = rchar()
        report = load_into_sharded(model, shard_by_layer, strategy=strategy)
        kernel = rchar() - before
    needed, row = needed_and_row(report.model)
    return {"loader": report.read.bytes_read if report.read else 0, "kernel": kernel, "needed": needed, "row": row,
            "sent": 0 if report.sent is None else report.sent.tensors}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from fsdp_offload_cfg.testing.models import save_llama, save_llama_multi_file

    root = tmp_path_factory.mktemp("read_once")
    return {"one_file": save_llama(str(root / "one_file")), "many_files": save_llama_multi_file(str(root / "many"))}


@pytest.mark.parametrize("strategy", ["sharded", "auto"])
@pytest.mark.parametrize("name", ["one_file", "many_files"])
def test_each_checkpoint_byte_is_read_once_across_the_ranks(checkpoints: dict[str, str], strategy: str, name: str):
    ranks = run_workers(_worker, 2, strategy, checkpoints[name], timeout=180)
    total = checkpoint_tensor_bytes(checkpoints[name])
    assert len([f for f in os.listdir(checkpoints[name]) if f.endswith(".safetensors")]) > (name == "many_files")
    for rank, r in enumerate(ranks):
        assert r["sent"] == 0, f"rank {rank}: rank 0 scattered {r['sent']} tensors that every rank can read"
        # the loader's reads are real reads; on a rank that hosts no store, they are all it read
        assert r["loader"] <= r["kernel"], (rank, r)
        if rank > 0:
            assert r["kernel"] <= r["loader"] + KERNEL_SLACK, (rank, r)
        # its own slices and, at most, the rest of one row
        assert r["needed"] <= r["loader"] <= r["needed"] + r["row"], (rank, r)
    assert sum(r["loader"] for r in ranks) <= 1.05 * total, ([r["loader"] for r in ranks], total)
