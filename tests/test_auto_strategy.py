"""`load_strategy: auto`, the default: the lightest way the checkpoint and the ranks allow.

On 2 real gloo ranks through `patch()` with no `load_strategy` written, against a plain load:
- every rank can read the safetensors files: every rank reads its own slices (as "sharded");
- rank 1 cannot (the path exists only relative to rank 0's working directory, as on a node
  without the shared storage): rank 1 builds from rank 0's description and rank 0 streams it its
  slices from the files, reading its own for itself; nothing fails (2 nodes: `test_nodes.py`);
- a `.bin` checkpoint: rank 0 loads it whole and sends it (as "broadcast").
Every tensor after prepare is bit-equal to a plain load in all three; `explain` shows the default.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from fsdp_offload_cfg.testing.compare import digests as _digests
from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.logs import MessageLog
from fsdp_offload_cfg.testing.models import shard_by_layer

pytestmark = pytest.mark.distributed

CONFIG = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, "fsdp_cpu_ram_efficient_loading": True}}


def _worker(rank: int, world_size: int, cases: dict[str, tuple[str, str]]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM

    import fsdp_offload_cfg
    from fsdp_offload_cfg.loading import load_into_sharded

    session = fsdp_offload_cfg.patch(CONFIG)
    messages = MessageLog()
    out: dict[str, Any] = {"strategy": session.config.load_strategy}
    home = os.getcwd()
    for case, (rank0_dir, path) in cases.items():
        os.chdir(rank0_dir if rank == 0 else home)  # a relative path: only rank 0 finds the files
        # the model class, not an Auto class: an Auto class reads config.json before the load starts
        model = LlamaForCausalLM.from_pretrained(path)
        held = sum(p.numel() for p in model.parameters() if not p.is_meta)
        report = load_into_sharded(model, shard_by_layer, strategy=session.config.load_strategy)
        full = {n: (t.full_tensor() if isinstance(t, DTensor) else t) for n, t in report.model.state_dict().items()}
        out[case] = {"held_after_from_pretrained": held, "digests": _digests(full),
                     "read": report.read.bytes_read if report.read else 0,
                     "sent": report.sent.tensors if report.sent else 0,
                     "received": report.sent.bytes_received if report.sent else 0, "log": list(messages)}
        messages.clear()
    os.chdir(home)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from transformers import AutoModelForCausalLM

    from fsdp_offload_cfg.testing.models import save_llama, save_llama_bin

    root = tmp_path_factory.mktemp("auto")
    readable = save_llama(str(root / "llama"))
    rank0_only = root / "rank0"
    rank0_only.mkdir()
    shutil.copytree(readable, rank0_only / "only_here")
    cases = {"every_rank_reads": (str(root), readable), "rank1_cannot_read": (str(rank0_only), "only_here"),
             "bin": (str(root), save_llama_bin(str(root / "llama_bin")))}
    plain = {case: _digests(AutoModelForCausalLM.from_pretrained(readable).state_dict()) for case in cases}
    return plain, run_workers(_worker, 2, cases, timeout=240)


def test_the_default_is_auto(runs: tuple[dict[str, Any], list[dict[str, Any]]]):
    assert [r["strategy"] for r in runs[1]] == ["auto", "auto"]


@pytest.mark.parametrize("case", ["every_rank_reads", "rank1_cannot_read", "bin"])
def test_every_rank_ends_with_what_a_plain_load_gives(runs: tuple[dict[str, Any], list[dict[str, Any]]], case: str):
    plain, results = runs
    for rank, r in enumerate(results):
        assert r[case]["digests"] == plain[case], f"rank {rank}: {case} differs from a plain load"


def test_every_rank_reads_its_own_slices_when_it_can(runs: tuple[dict[str, Any], list[dict[str, Any]]]):
    results = runs[1]
    assert all(r["every_rank_reads"]["read"] > 0 and r["every_rank_reads"]["held_after_from_pretrained"] == 0
               for r in results)
    assert any("every rank that can read it" in line for line in results[0]["every_rank_reads"]["log"])


def test_a_rank_without_the_files_gets_them_streamed_from_rank_0(runs: tuple[dict[str, Any], list[dict[str, Any]]]):
    rank0, rank1 = (r["rank1_cannot_read"] for r in runs[1])
    assert rank0["held_after_from_pretrained"] == rank1["held_after_from_pretrained"] == 0
    # rank 0 reads its own slices (not rank 1's: those it streams), rank 1 reads nothing
    assert rank0["read"] > 0 and rank1["read"] == 0 and rank0["sent"] > 0 and rank1["received"] > 0
    assert rank0["received"] == 0
    assert any("rank 1 cannot read only_here itself" in line for line in rank1["log"]), rank1["log"]
    assert any("for rank 1 (" in line and "streams them" in line for line in rank0["log"]), rank0["log"]


def test_a_checkpoint_that_cannot_be_sliced_is_loaded_whole_by_rank_0(runs: tuple[dict[str, Any], list[dict[str, Any]]]):
    rank0, rank1 = (r["bin"] for r in runs[1])
    assert rank0["held_after_from_pretrained"] > 0 and rank1["held_after_from_pretrained"] == 0
    assert any("cannot be read slice by slice" in line for line in rank0["log"]), rank0["log"]


def test_explain_shows_the_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    import json

    from fsdp_offload_cfg import cli

    path = tmp_path / "f.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_cpu_ram_efficient_loading: true\n")
    assert cli.main(["explain", "--format", "json", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["defaults"]["load_strategy"] == "auto"
