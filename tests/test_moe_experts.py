"""MoE checkpoints in the layout the hub stores them in: one tensor per expert
(`mlp.experts.3.gate_proj.weight`). transformers 5 stacks them on load into one tensor per layer
(`mlp.experts.gate_up_proj`, a `WeightConverter`); the loader took that for a conversion it cannot
read slice by slice, and under `sharded` and `auto` fell back to rank 0 loading the whole model,
for every such MoE (Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5, ...). Now a stacked tensor is read
as its experts' tensors one after another (`safetensors_index.composed`), so each rank reads only
its own experts.

Qwen3-VL-MoE stores its experts stacked but with two dims swapped, which transformers 5 transposes
on load (`Transpose(1, 2)`): the same fallback. Its rows still keep their bytes together, so a rank
reads its own experts and turns them (`FileTensor.transposed`).

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
from fsdp_offload_cfg.testing.models import in_qwen3_vl_moe_hub_layout, shard_by_layer
from fsdp_offload_cfg.testing.reads import KERNEL_SLACK, checkpoint_tensor_bytes, needed_and_row, rchar

pytestmark = pytest.mark.distributed

PER_EXPERT = ["Qwen3MoeForCausalLM", "MixtralForCausalLM"]
# experts stored stacked, `[E, hidden, 2 * intermediate]`, which transformers 5 transposes on load
TRANSPOSED = ["Qwen3VLMoeForConditionalGeneration"]
FAMILIES = PER_EXPERT + TRANSPOSED
EXPERTS_STACKED_ON_LOAD = importlib.util.find_spec("transformers.core_model_loading") is not None
STRATEGIES = ["broadcast", "sharded", "auto"]
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _config(family: str) -> Any:
    import transformers

    if family == "Qwen3MoeForCausalLM":
        return transformers.Qwen3MoeConfig(**SMALL, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=16, decoder_sparse_step=1)
    if family == "MixtralForCausalLM":
        return transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
    text = dict(SMALL, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                decoder_sparse_step=1, rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0])
    return transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision)


def _state(model: torch.nn.Module) -> dict[str, str]:
    """Digest of every parameter and buffer, gathered whole (every rank takes part)."""
    from torch.distributed.tensor import DTensor

    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {n: digest((t.full_tensor() if isinstance(t, DTensor) else t).reshape(-1)) for n, t in named.items()}


def _shard_by_layer(model: torch.nn.Module) -> torch.nn.Module:
    """`shard_by_layer`; a vision-language model's decoder layers are its language model's."""
    from torch.distributed.fsdp import fully_shard

    if not hasattr(model.model, "language_model"):
        return shard_by_layer(model)
    for layer in model.model.language_model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _worker(rank: int, world_size: int, paths: dict[str, str]) -> dict[str, Any]:
    import transformers
    from transformers import PreTrainedModel

    from fsdp_offload_cfg.loading import (
        auto_from_pretrained,
        load_into_sharded,
        rank0_from_pretrained,
        sharded_from_pretrained,
    )

    loads = {"broadcast": rank0_from_pretrained, "sharded": sharded_from_pretrained, "auto": auto_from_pretrained}
    out: dict[str, Any] = {}
    for family, path in paths.items():
        for strategy, load in loads.items():
            model = load(PreTrainedModel.from_pretrained, getattr(transformers, family), path)
            weights = [p for p in model.parameters()]
            on_meta = sum(p.numel() for p in weights if p.is_meta) / sum(p.numel() for p in weights)
            before = rchar()
            report = load_into_sharded(model, _shard_by_layer, strategy=strategy)
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
        if family in TRANSPOSED:
            in_qwen3_vl_moe_hub_layout(paths[family], SMALL["hidden_size"])
        reference = getattr(transformers, family).from_pretrained(paths[family])
        plain[family] = _state(reference)
    return {"paths": paths, "plain": plain}


@pytest.fixture(scope="module")
def loads(checkpoints: dict[str, Any]) -> list[dict[str, Any]]:
    return run_workers(_worker, 2, checkpoints["paths"], timeout=300)


@pytest.mark.parametrize("family", PER_EXPERT)
def test_the_checkpoint_is_per_expert_and_split_across_files(checkpoints: dict[str, Any], family: str):
    """What the other tests load: the hub's layout, one tensor per expert, a layer's experts in
    more than one file."""
    path = checkpoints["paths"][family]
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    experts = {k: v for k, v in weight_map.items()
               if k.startswith("model.layers.0.") and (".experts.0." in k or ".experts.3." in k)}
    assert len(experts) >= 4 and len(set(experts.values())) > 1, experts


def test_the_transposed_checkpoint_is_in_the_hubs_layout(checkpoints: dict[str, Any]):
    from safetensors import safe_open

    path = checkpoints["paths"][TRANSPOSED[0]]
    shapes = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                shapes.update({k: f.get_slice(k).get_shape() for k in f.keys() if "layers.0.mlp.experts" in k})  # noqa: SIM118 - not a dict
    assert sorted(shapes.values()) == [[4, 24, 32], [4, 32, 48]], shapes


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_no_rank_reads_a_weight_in_from_pretrained(loads: list[dict[str, Any]], family: str, strategy: str):
    """Rank 0 included: it used to load the whole model ("converted on load"; Qwen3-VL-MoE's
    transpose until `_transposed`)."""
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
