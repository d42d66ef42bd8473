"""`load_strategy: auto` at node scale: 4 real gloo ranks as 2 nodes x 2, with `LOCAL_RANK`,
`LOCAL_WORLD_SIZE` and `GROUP_RANK` as torchrun sets them (`run_workers(local_world_size=2)`).

Three checkpoints, each named by the same path on every rank:
- on storage both nodes share: every rank reads its own slices; nothing crosses the network;
- on a path only node 0 has (a relative path, found from node 0's working directory only, as on
  a node without the shared filesystem): node 0's ranks read their own slices, rank 0 also reads
  node 1's slices and streams them to node 1's ranks only; node 1 reads nothing;
- the same path holding another copy on node 1 (the same tensors at other offsets): not rank 0's
  checkpoint, so node 1 reads none of it and gets rank 0's slices streamed, as above.
In all three, every rank ends bit-equal to a plain load, each checkpoint byte is read once across the
job (the loader's count, checked against the kernel's `rchar` on the ranks that host no store),
and rank 0's log says which node got what.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from fsdp_offload_cfg.testing.compare import digests
from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.logs import MessageLog
from fsdp_offload_cfg.testing.models import shard_by_layer
from fsdp_offload_cfg.testing.reads import KERNEL_SLACK, needed_and_row, rchar

pytestmark = pytest.mark.distributed

CONFIG = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, "fsdp_cpu_ram_efficient_loading": True}}
NODE = {0: "node 0", 1: "node 0", 2: "node 1", 3: "node 1"}


def _worker(rank: int, world_size: int, cases: dict[str, tuple[str, str, str]]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM

    import fsdp_offload_cfg
    from fsdp_offload_cfg.loading import load_into_sharded

    session = fsdp_offload_cfg.patch(CONFIG)
    messages = MessageLog()
    home = os.getcwd()
    node = int(os.environ["GROUP_RANK"])
    out: dict[str, Any] = {}
    for case, (node0_dir, node1_dir, path) in cases.items():
        os.chdir(node0_dir if node == 0 else node1_dir)  # where a relative path resolves, per node
        for _ in range(2):  # the second load is the measured one (the first imports lazily)
            messages.clear()
            model = LlamaForCausalLM.from_pretrained(path)
            before, began = rchar(), time.perf_counter()
            report = load_into_sharded(model, shard_by_layer, strategy=session.config.load_strategy)
            kernel, wall = rchar() - before, time.perf_counter() - began
        needed, row = needed_and_row(report.model)
        computed = sum(b.numel() * b.element_size() for n, b in report.model.named_buffers() if n.endswith("inv_freq"))
        full = {n: (t.full_tensor() if isinstance(t, DTensor) else t) for n, t in report.model.state_dict().items()}
        out[case] = {"digests": digests(full), "kernel": kernel, "needed": needed, "row": row, "computed": computed,
                     "read": (report.read.bytes_read if report.read else 0) + report.sent.bytes_read,
                     "received": report.sent.bytes_received, "sent_to": dict(report.sent.bytes_to),
                     "shares": [(s.node, s.bytes_read, s.bytes_received) for s in report.ranks],
                     "steps": dict(report.seconds), "wall": wall, "log": list(messages)}
    os.chdir(home)
    return out


def _resave_with_another_layout(path: Path) -> None:
    """The same tensors, their bytes at other offsets (a longer header): another copy of the
    checkpoint than rank 0's, which a rank must not read as if it were rank 0's."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata() or {})
    save_file(load_file(str(path)), str(path), metadata={**metadata, "copied_by": "x" * 100})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], int, list[dict[str, Any]]]:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fsdp_offload_cfg.testing.models import save_llama

    root = tmp_path_factory.mktemp("nodes")
    shared = save_llama(str(root / "shared"))
    node0, node1_empty, node1_other = root / "node0", root / "node1_empty", root / "node1_other"
    for folder in (node0, node1_empty, node1_other):
        folder.mkdir()
    shutil.copytree(shared, node0 / "ckpt")
    shutil.copytree(shared, node1_other / "ckpt")
    _resave_with_another_layout(node1_other / "ckpt" / "model.safetensors")
    cases = {"shared": (str(root), str(root), shared), "node0_only": (str(node0), str(node1_empty), "ckpt"),
             "node1_other_copy": (str(node0), str(node1_other), "ckpt")}
    plain = digests(AutoModelForCausalLM.from_pretrained(shared).state_dict())
    size = sum(t.numel() * t.element_size() for t in load_file(os.path.join(shared, "model.safetensors")).values())
    return plain, size, run_workers(_worker, 4, cases, local_world_size=2, timeout=300)


@pytest.mark.parametrize("case", ["shared", "node0_only", "node1_other_copy"])
def test_every_rank_ends_bit_equal_to_a_plain_load(runs: tuple[dict[str, Any], int, list[dict[str, Any]]], case: str):
    plain, _, ranks = runs
    for rank, r in enumerate(ranks):
        assert r[case]["digests"] == plain, f"rank {rank} ({NODE[rank]}): {case} differs from a plain load"


@pytest.mark.parametrize("case", ["shared", "node0_only", "node1_other_copy"])
def test_each_byte_is_read_once_across_the_job(runs: tuple[dict[str, Any], int, list[dict[str, Any]]], case: str):
    _, size, ranks = runs
    for rank, r in enumerate(ranks):
        assert r[case]["read"] <= r[case]["kernel"], (rank, r[case])  # the loader's reads are real reads
        if rank > 0:  # no store here: the kernel's count is the loader's
            assert r[case]["kernel"] <= r[case]["read"] + KERNEL_SLACK, (rank, r[case])
    assert size <= sum(r[case]["read"] for r in ranks) <= 1.05 * size, ([r[case]["read"] for r in ranks], size)


def test_on_shared_storage_every_rank_reads_its_own_slices_and_nothing_is_sent(
    runs: tuple[dict[str, Any], int, list[dict[str, Any]]],
):
    for rank, r in enumerate(runs[2]):
        shared = r["shared"]
        assert shared["needed"] <= shared["read"] <= shared["needed"] + shared["row"], (rank, shared)
        assert shared["received"] == 0 and shared["sent_to"] == {}, (rank, shared)


@pytest.mark.parametrize("case", ["node0_only", "node1_other_copy"])
def test_only_the_node_without_the_files_gets_them_streamed(runs: tuple[dict[str, Any], int, list[dict[str, Any]]],
                                                             case: str):
    """Node 1 gets exactly its own slices; node 0 nothing from the files. Node 1 has no copy of
    the checkpoint, or a copy whose tensors lie at other offsets than in rank 0's (not rank 0's
    checkpoint: it is not read). The RoPE `inv_freq` (computed at init, in no file) comes from
    rank 0 to every rank: node 1's ranks, built from rank 0's description or not, do not all
    report it as their own, so rank 0's value is every rank's."""
    r0, r1, r2, r3 = (r[case] for r in runs[2])
    # inv_freq: sent from rank 0 where node 1 built from the description, each rank's own otherwise
    extra = {r: x["computed"] if case == "node0_only" else 0 for r, x in enumerate((r0, r1, r2, r3))}
    for rank, r in ((2, r2), (3, r3)):  # node 1: reads nothing, receives exactly its own slices
        assert r["read"] == 0 and r["kernel"] <= KERNEL_SLACK, (rank, r)
        assert r["received"] == r["needed"] + extra[rank], (rank, r)
    assert r1["received"] == extra[1] and r1["needed"] <= r1["read"] <= r1["needed"] + r1["row"], r1
    # rank 0 sends node 1 what it needs, and reads its own slices plus node 1's
    assert r0["received"] == 0, r0
    sent = {1: extra[1], 2: r2["needed"] + extra[2], 3: r3["needed"] + extra[3]}
    assert r0["sent_to"] == {r: n for r, n in sent.items() if n}, r0
    assert r0["read"] <= r0["needed"] + r2["needed"] + r3["needed"] + 3 * r0["row"], r0


def test_every_rank_reports_who_read_and_received_what_by_node(runs: tuple[dict[str, Any], int, list[dict[str, Any]]]):
    ranks = runs[2]
    shares = ranks[0]["node0_only"]["shares"]
    assert all(r["node0_only"]["shares"] == shares for r in ranks)
    assert [s[0] for s in shares] == [NODE[r] for r in range(4)]
    assert [(s[1], s[2]) for s in shares] == [(r["node0_only"]["read"], r["node0_only"]["received"]) for r in ranks]


def test_rank_0_logs_which_node_got_what(runs: tuple[dict[str, Any], int, list[dict[str, Any]]]):
    from fsdp_offload_cfg._sizes import show_size

    size = sum(r["node0_only"]["read"] for r in runs[2])
    log = runs[2][0]["node0_only"]["log"]
    assert any(line.startswith("loading: rank 0 reads") and "for ranks 2-3 (node 1)" in line for line in log), log
    by_node = next(line for line in log if line.startswith("loading by node:"))
    computed = runs[2][1]["node0_only"]["computed"]  # rank 1's inv_freq (see above)
    assert f"node 0 (ranks 0-1): read {show_size(size)} from the files, received {computed} B from rank 0" in by_node
    assert "node 1 (ranks 2-3): read 0 B from the files, received" in by_node, by_node
    shared = runs[2][0]["shared"]["log"]
    assert not any(line.startswith("loading: rank 0 reads") for line in shared), shared


def test_the_report_times_every_step_of_the_load(runs: tuple[dict[str, Any], int, list[dict[str, Any]]]):
    """`LoadReport.seconds`: each step once, in order, adding up to the load's own wall time."""
    steps = ["describe", "agree sources", "shard on meta", "allocate", "read own slices", "transfer from rank 0",
             "check"]  # fmt: skip
    for rank, r in enumerate(runs[2]):
        for case in ("shared", "node0_only"):
            timed = r[case]["steps"]
            assert list(timed) == steps and all(s >= 0 for s in timed.values()), (rank, case, timed)
            assert sum(timed.values()) <= r[case]["wall"], (rank, case, timed, r[case]["wall"])


def _failing_worker(rank: int, world_size: int, node0_dir: str) -> tuple[str, float]:
    """Rank 0 fails to pack its second bucket for node 1 (a read error, say): what every rank
    raised, and how long it took."""
    import time

    from transformers import LlamaForCausalLM

    import fsdp_offload_cfg
    from fsdp_offload_cfg.loading import broadcast, load_into_sharded

    fsdp_offload_cfg.patch(CONFIG)
    os.chdir(node0_dir if os.environ["GROUP_RANK"] == "0" else os.path.dirname(node0_dir))
    model = LlamaForCausalLM.from_pretrained("ckpt")
    real, calls = broadcast._pack, []

    def fault(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise OSError("injected: the checkpoint file went away")
        return real(*args, **kwargs)

    if rank == 0:
        broadcast._pack = fault
    start = time.monotonic()
    try:
        load_into_sharded(model, shard_by_layer, strategy="auto", bucket_bytes=4096)
        message = "no error"
    except Exception as exc:  # noqa: BLE001
        message = f"{type(exc).__name__}: {exc}"
    return message, time.monotonic() - start


def test_a_rank_0_failure_mid_stream_stops_every_rank_at_once(tmp_path_factory: pytest.TempPathFactory):
    """Node 1 waits for its next bucket, node 0 (which receives nothing) waits for the end of the
    transfer: neither may be left waiting for the process-group timeout."""
    from fsdp_offload_cfg.testing.models import save_llama

    node0 = tmp_path_factory.mktemp("failing") / "node0"
    node0.mkdir()
    save_llama(str(node0 / "ckpt"))
    pg_timeout = 30.0
    results = run_workers(_failing_worker, 4, str(node0), local_world_size=2, pg_timeout=pg_timeout, timeout=200)
    for rank, (message, seconds) in enumerate(results):
        assert "injected: the checkpoint file went away" in message and "bucket 2/" in message, (rank, message)
        assert "failed on rank 0" in message, (rank, message)
        assert seconds < pg_timeout / 2, (rank, seconds)
