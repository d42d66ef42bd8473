"""MoE checkpoints in the layout the hub stores them in: one tensor per expert
(`mlp.experts.3.gate_proj.weight`). transformers 5 stacks them on load into one tensor per layer
(`mlp.experts.gate_up_proj`, a `WeightConverter`); the loader took that for a conversion it cannot
read slice by slice, and under `sharded` and `auto` fell back to rank 0 loading the whole model,
for every such MoE (Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5, ...). Now a stacked tensor is read
as its experts' tensors one after another (`safetensors_index.composed`), so each rank reads only
its own experts.

On 2 real gloo ranks, for Qwen3-MoE (gate and up concatenated per expert) and Mixtral (also
renamed: `block_sparse_moe.experts.*.w1` -> `mlp.experts.gate_up_proj`), each saved in several
files with a layer's experts split across them, under `broadcast`, `sharded` and `auto`: no weight
is read in `from_pretrained` (rank 0 included), every tensor after the load equals a plain load,
and the bytes read add up to the checkpoint once, counted by the loader and, on rank 1, by the
kernel. On transformers 4.x the experts are modules of their own, read like any other tensor: the
same test holds.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import pytest
import torch

from fsdp_offload_cfg.testing.compare import digest
from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.models import shard_by_layer
from fsdp_offload_cfg.testing.reads import KERNEL_SLACK, checkpoint_tensor_bytes, needed_and_row, rchar

pytestmark = pytest.mark.distributed

FAMILIES = ["Qwen3MoeForCausalLM", "MixtralForCausalLM"]
EXPERTS_STACKED_ON_LOAD = importlib.util.find_spec("transformers.core_model_loading") is not None
STRATEGIES = ["broadcast", "sharded", "auto"]
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _config(family: str) -> Any:
    import transformers

    if family == "Qwen3MoeForCausalLM":
        return transformers.Qwen3MoeConfig(**SMALL, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=16, decoder_sparse_step=1)
    return transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)


def _state(model: torch.nn.Module) -> dict[str, str]:
    """Digest of every parameter and buffer, gathered whole (every rank takes part)."""
    from torch.distributed.tensor import DTensor

    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {n: digest((t.full_tensor() if isinstance(t, DTensor) else t).reshape(-1)) for n, t in named.items()}


def _worker(rank: int, world_size: int, paths: dict[str, str]) -> dict[str, Any]:
    import transformers
    from transformers import PreTrainedModel

    from fsdp_offload_cfg.loading import (auto_from_pretrained, load_into_sharded, rank0_from_pretrained,
                                          sharded_from_pretrained)

    loads = {"broadcast": rank0_from_pretrained, "sharded": sharded_from_pretrained, "auto": auto_from_pretrained}
    out: dict[str, Any] = {}
    for family, path in paths.items():
        for strategy, load in loads.items():
            model = load(PreTrainedModel.from_pretrained, getattr(transformers, family), path)
            weights = [p for p in model.parameters()]
            on_meta = sum(p.numel() for p in weights if p.is_meta) / sum(p.numel() for p in weights)
            before = rchar()
            report = load_into_sharded(model, shard_by_layer, strategy=strategy)
            kernel = rchar() - before
            needed, row = needed_and_row(report.model)
            sent = report.sent
            out[family, strategy] = {
                "on_meta": on_meta, "state": _state(report.model), "kernel": kernel, "needed": needed, "row": row,
                "read": report.read.bytes_read if report.read else 0,
                "streamed": sent.bytes_read if sent is not None and rank == 0 else 0,
            }
    if EXPERTS_STACKED_ON_LOAD:  # a stacked tensor used before prepare (a print, an evaluation) reads itself whole
        family = FAMILIES[0]
        model = sharded_from_pretrained(PreTrainedModel.from_pretrained, getattr(transformers, family), paths[family])
        early = digest(model.model.layers[0].mlp.experts.gate_up_proj.detach().clone().reshape(-1))
        loaded = load_into_sharded(model, shard_by_layer, strategy="sharded").model
        out["used early"] = {"early": early, "state": _state(loaded)}
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import transformers

    root = tmp_path_factory.mktemp("moe")
    paths, plain = {}, {}
    for family in FAMILIES:
        torch.manual_seed(0)
        paths[family] = str(root / family)
        getattr(transformers, family)(_config(family)).save_pretrained(paths[family], max_shard_size=20_000)
        reference = getattr(transformers, family).from_pretrained(paths[family])
        plain[family] = _state(reference)
    return {"paths": paths, "plain": plain}


@pytest.fixture(scope="module")
def loads(checkpoints: dict[str, Any]) -> list[dict[str, Any]]:
    return run_workers(_worker, 2, checkpoints["paths"], timeout=300)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_checkpoint_is_per_expert_and_split_across_files(checkpoints: dict[str, Any], family: str):
    """What the other tests load: the hub's layout, one tensor per expert, a layer's experts in
    more than one file."""
    path = checkpoints["paths"][family]
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    experts = {k: v for k, v in weight_map.items()
               if k.startswith("model.layers.0.") and (".experts.0." in k or ".experts.3." in k)}
    assert len(experts) >= 4 and len(set(experts.values())) > 1, experts


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_no_rank_reads_a_weight_in_from_pretrained(loads: list[dict[str, Any]], family: str, strategy: str):
    """Rank 0 included: it used to load the whole model ("converted on load")."""
    assert [r[family, strategy]["on_meta"] for r in loads] == [1.0, 1.0]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_equals_a_plain_load(loads: list[dict[str, Any]], checkpoints: dict[str, Any], family: str,
                                          strategy: str):
    plain = checkpoints["plain"][family]
    for rank, r in enumerate(loads):
        state = r[family, strategy]["state"]
        assert state.keys() == plain.keys(), (rank, sorted(state.keys() ^ plain.keys()))
        assert [n for n in plain if state[n] != plain[n]] == [], rank


@pytest.mark.parametrize("strategy", ["sharded", "auto"])
@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_reads_its_own_experts_once(loads: list[dict[str, Any]], checkpoints: dict[str, Any], family: str,
                                              strategy: str):
    total = checkpoint_tensor_bytes(checkpoints["paths"][family])
    ranks = [r[family, strategy] for r in loads]
    for rank, r in enumerate(ranks):
        assert r["needed"] <= r["read"] <= r["needed"] + r["row"], (rank, r)
        assert r["read"] <= r["kernel"], (rank, r)
    assert ranks[1]["kernel"] <= ranks[1]["read"] + KERNEL_SLACK, ranks[1]  # rank 0 hosts the store
    assert sum(r["read"] for r in ranks) <= 1.05 * total, ([r["read"] for r in ranks], total)


@pytest.mark.parametrize("family", FAMILIES)
def test_broadcast_rank0_reads_the_checkpoint_once_to_stream_it(loads: list[dict[str, Any]],
                                                                checkpoints: dict[str, Any], family: str):
    """Under broadcast rank 0 reads its own experts and, while it sends them, the other rank's:
    the checkpoint once, never whole in memory."""
    total = checkpoint_tensor_bytes(checkpoints["paths"][family])
    rank0, rank1 = (r[family, "broadcast"] for r in loads)
    assert rank1["read"] == 0 and rank1["streamed"] == 0
    assert total * 0.95 <= rank0["read"] + rank0["streamed"] <= 1.05 * total, (rank0, total)


@pytest.mark.skipif(not EXPERTS_STACKED_ON_LOAD, reason="transformers 4.x keeps a module per expert")
def test_a_stacked_tensor_used_before_prepare_reads_itself_as_a_plain_load_holds_it(
        loads: list[dict[str, Any]], checkpoints: dict[str, Any]):
    plain = checkpoints["plain"][FAMILIES[0]]
    for rank, r in enumerate(loads):
        assert r["used early"]["early"] == plain["model.layers.0.mlp.experts.gate_up_proj"], rank
        assert r["used early"]["state"] == plain, rank
