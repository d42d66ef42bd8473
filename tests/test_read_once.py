"""Each checkpoint byte read once across the job under `sharded` and `auto`: every rank reads its
own slices and nothing else, counted by the loader and by the kernel (`/proc/self/io` `rchar`:
the bytes this process's `read`/`pread` calls returned), on 2 real gloo ranks; under hybrid
sharding (2 replicas x 2 shards, 4 ranks) with the replicas on 2 nodes, each replica reads part of
its slices and the replicas share them.

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


def _measured_load(strategy: str, path: str, shard_fn: Any) -> tuple[Any, int]:
    """`load_into_sharded` of the Llama at `path` under `strategy`, and the bytes the kernel
    counts this process reading meanwhile; the second of two loads (the first imports lazily)."""
    from transformers import LlamaForCausalLM, PreTrainedModel

    from fsdp_offload_cfg.loading import (
        auto_from_pretrained,
        load_into_sharded,
        rank0_from_pretrained,
        sharded_from_pretrained,
    )

    load = {"sharded": sharded_from_pretrained, "broadcast": rank0_from_pretrained}.get(strategy, auto_from_pretrained)
    for _ in range(2):
        model = load(PreTrainedModel.from_pretrained, LlamaForCausalLM, path)
        before = rchar()
        report = load_into_sharded(model, shard_fn, strategy=strategy)
        kernel = rchar() - before
    return report, kernel


def _worker(rank: int, world_size: int, strategy: str, path: str) -> dict[str, Any]:
    report, kernel = _measured_load(strategy, path, shard_by_layer)
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


# --------------------------------------------------------------------------------------------
# hybrid sharding (HSDP): 2 replicas x 2 shards on 4 ranks
# --------------------------------------------------------------------------------------------


def _hsdp(model: Any) -> Any:
    """FSDP2 on a 2-D mesh, as accelerate shards for `dp_replicate_size=2, dp_shard_size=2`:
    ranks 0 and 2 hold the same slices (replica group), as do ranks 1 and 3."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _hsdp_worker(rank: int, world_size: int, strategy: str, path: str) -> dict[str, Any]:
    import torch
    from transformers import LlamaForCausalLM

    from fsdp_offload_cfg import local_loading

    report, kernel = _measured_load(strategy, path, _hsdp)
    with local_loading():
        plain = LlamaForCausalLM.from_pretrained(path)
    expected = dict([*plain.named_parameters(), *plain.named_buffers()])
    got = dict([*report.model.named_parameters(), *report.model.named_buffers()])
    wrong = [n for n, t in got.items()
             if not torch.equal(t.full_tensor() if hasattr(t, "full_tensor") else t, expected[n])]
    needed, row = needed_and_row(report.model)
    return {"loader": report.read.bytes_read if report.read else 0, "kernel": kernel, "needed": needed, "row": row,
            "from_replicas": report.ranks[rank].bytes_from_replicas, "wrong": wrong,
            "streamed": report.sent.bytes_read if report.sent else 0,
            "placements": {str(p.placements) for p in report.model.parameters()}}


@pytest.mark.parametrize(("strategy", "name"), [("sharded", "one_file"), ("auto", "one_file"), ("auto", "many_files")])
def test_hsdp_replicas_on_two_nodes_split_the_reading(checkpoints: dict[str, str], strategy: str, name: str) -> None:
    """Replicas on 2 nodes (ranks 0-1 and 2-3, as torchrun numbers them): each replica group
    holds the same slices on both nodes. Before, each of its ranks read them all (the job read
    the checkpoint once per replica, 2x here); now each reads about half and they broadcast the
    rest, every tensor still equal to a plain load's."""
    ranks = run_workers(_hsdp_worker, 4, strategy, checkpoints[name], timeout=180, local_world_size=2)
    total = checkpoint_tensor_bytes(checkpoints[name])
    for rank, r in enumerate(ranks):
        assert r["wrong"] == [] and r["placements"] == {"(Replicate(), Shard(dim=0))"}, (rank, r)
        assert r["loader"] <= r["kernel"], (rank, r)
        if rank > 0:
            assert r["kernel"] <= r["loader"] + KERNEL_SLACK, (rank, r)
        # about half its slices read (whole tensors go to one replica or the other), the rest received
        assert 0.25 * r["needed"] < r["loader"] < 0.75 * r["needed"], (rank, r)
        assert r["needed"] <= r["loader"] + r["from_replicas"] <= r["needed"] + r["row"], (rank, r)
    assert sum(r["loader"] for r in ranks) <= 1.05 * total, ([r["loader"] for r in ranks], total)


def test_hsdp_replicas_on_one_node_read_their_own_slices(checkpoints: dict[str, str]) -> None:
    """Copies on one node share its page cache: each rank reads its own slices (the storage
    serves each byte once all the same), and nothing passes between the replicas."""
    for rank, r in enumerate(run_workers(_hsdp_worker, 4, "auto", checkpoints["one_file"], timeout=180)):
        assert r["wrong"] == [] and r["from_replicas"] == 0, (rank, r)
        assert r["needed"] <= r["loader"] <= r["needed"] + r["row"], (rank, r)


def test_hsdp_under_broadcast_rank_0_reads_each_slice_once(tmp_path: Any) -> None:
    """`load_strategy: broadcast` (rank 0 reads, every rank receives its part): rank 0 read each
    slice once per rank holding it, the checkpoint once per replica (R x its size; now 1 + 1/S:
    the other ranks' distinct slices once, its own once more for itself). A 5 MB checkpoint, so
    that the kernel's count (rank 0's includes the store's socket reads) tells the two apart."""
    from fsdp_offload_cfg.testing.models import save_llama

    path = save_llama(str(tmp_path / "llama"), hidden_size=256, intermediate_size=512)
    ranks = run_workers(_hsdp_worker, 4, "broadcast", path, timeout=180, local_world_size=2)
    total = checkpoint_tensor_bytes(path)
    for rank, r in enumerate(ranks):
        assert r["wrong"] == [] and r["placements"] == {"(Replicate(), Shard(dim=0))"}, (rank, r)
        assert rank == 0 or r["kernel"] <= KERNEL_SLACK, (rank, r)  # they read nothing
    streamed, own = ranks[0]["streamed"], ranks[0]["loader"]  # for the others; for itself
    assert total <= streamed <= 1.05 * total and own <= ranks[0]["needed"] + ranks[0]["row"], ranks[0]
    assert ranks[0]["kernel"] <= 1.05 * (total + own) + 16 * KERNEL_SLACK, (ranks[0], total)


def _hsdp_fault_worker(rank: int, world_size: int, path: str, failing: int) -> tuple[str, float]:
    """Rank `failing` cannot allocate the buffer the replicas share slices through."""
    import time

    from fsdp_offload_cfg.loading import replicas

    real = replicas.plan_broadcasts

    def no_memory(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("injected: no memory for the replicas' staging buffer")

    _measured_load("auto", path, _hsdp)  # the imports, and the files in the page cache
    if rank == failing:
        replicas.plan_broadcasts = no_memory
    start = time.monotonic()
    try:
        _measured_load("auto", path, _hsdp)
        message = "no error"
    except Exception as exc:  # noqa: BLE001
        message = f"{type(exc).__name__}: {exc}"
    finally:
        replicas.plan_broadcasts = real
    return message, time.monotonic() - start


@pytest.mark.parametrize("failing", [0, 3])
def test_a_replica_that_cannot_stage_stops_every_rank_before_any_broadcast(checkpoints: dict[str, str],
                                                                          failing: int) -> None:
    """The staging buffer is allocated inside the read step's agreement: a rank short of memory
    stops all four at once, naming it, instead of leaving its replica waiting in a broadcast."""
    pg_timeout = 30.0
    results = run_workers(_hsdp_fault_worker, 4, checkpoints["one_file"], failing, timeout=180,
                          local_world_size=2, pg_timeout=pg_timeout)
    for rank, (message, seconds) in enumerate(results):
        assert f"reading this rank's shards from the checkpoint failed on rank {failing}:" in message, (rank, message)
        assert "injected: no memory" in message and seconds < pg_timeout / 2, (rank, message, seconds)
