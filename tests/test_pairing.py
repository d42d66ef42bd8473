"""A load pairs with rank 0's load of the same call, never with whatever rank 0 loaded at the same
position (`fsdp_offload_cfg/loading/pairing.py`), on 2 real gloo ranks through `patch()`.

The case that went wrong: rank 0 alone loads an evaluation copy with `rms_norm_eps=0.5`, then
every rank loads the checkpoint and prepares it. Loads were paired by a per-rank counter, so rank 1
built its model from the evaluation copy's config and the two ranks' logits differed (by 0.33),
silently.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.logs import MessageLog
from fsdp_offload_cfg.testing.models import shard_by_layer

pytestmark = pytest.mark.distributed

STRATEGIES = ["broadcast", "sharded"]
IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])


def _config(strategy: str) -> dict[str, Any]:
    return {"distributed_type": "FSDP", "mixed_precision": "no",
            "fsdp_config": {"fsdp_version": 2, "fsdp_cpu_ram_efficient_loading": True, "load_strategy": strategy}}


def _prepared_logits(model: torch.nn.Module) -> tuple[float, list[float]]:
    from fsdp_offload_cfg.loading import load_into_sharded

    model = load_into_sharded(model, shard_by_layer, strategy=model._strategy).model
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    return model.config.rms_norm_eps, logits.flatten()[:64].tolist()


def _load(path: str, strategy: str, **kwargs: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model._strategy = strategy
    return model


def _eval_copy_then_every_rank(rank: int, world: int, path: str, strategy: str) -> dict[str, Any]:
    """Rank 0 alone loads an evaluation copy with other settings, then the same checkpoint again
    with the same settings as the solo load (a repeat), then every rank loads and prepares."""
    import logging

    import torch.distributed as dist

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(_config(strategy))
    warnings = MessageLog("fsdp_offload_cfg.loading", logging.WARNING)
    if rank == 0:
        _load(path, strategy, rms_norm_eps=0.5)
        _load(path, strategy)  # the same call as the one every rank makes next: only its repeat differs
    dist.barrier()
    eps, logits = _prepared_logits(_load(path, strategy))
    return {"eps": eps, "logits": logits, "warnings": warnings}


def _ranks_prepare_different_calls(rank: int, world: int, path: str, strategy: str) -> str:
    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(_config(strategy))
    solo = _load(path, strategy, rms_norm_eps=0.5) if rank == 0 else None
    every = _load(path, strategy)
    _prepared_logits(solo if rank == 0 else every)
    return "prepared"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    from fsdp_offload_cfg.testing.models import save_llama

    return save_llama(str(tmp_path_factory.mktemp("pairing") / "llama"))


def _plain_logits(path: str) -> list[float]:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path)(input_ids=IDS).logits.flatten()[:64].tolist()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_load_rank_0_made_alone_does_not_shift_the_pairing(checkpoint: str, strategy: str):
    results = run_workers(_eval_copy_then_every_rank, 2, checkpoint, strategy, timeout=180)
    assert [r["eps"] for r in results] == [1e-6, 1e-6]
    assert results[0]["logits"] == results[1]["logits"] == _plain_logits(checkpoint)
    shifted = [w for w in results[1]["warnings"] if "rank 0 made it alone before" in w]
    if strategy == "broadcast":  # rank 1 paired with rank 0's first repeat of the same call: said, harmless
        assert len(shifted) == 1 and "its load #1 of LlamaForCausalLM.from_pretrained(" in shifted[0], shifted
    else:  # every rank built its own model: nothing was paired
        assert shifted == []


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_preparing_models_of_different_calls_stops_every_rank_naming_both(checkpoint: str, strategy: str):
    results = run_workers(_ranks_prepare_different_calls, 2, checkpoint, strategy, timeout=180, expect_errors=True)
    for rank, result in enumerate(results):
        assert "Traceback" in result, f"rank {rank} prepared: {result}"
        assert f"rank 1 prepares the model of LlamaForCausalLM.from_pretrained('{checkpoint}'" in result, result
        assert f"rank 0 the model of LlamaForCausalLM.from_pretrained('{checkpoint}'" in result, result
        assert "which differ in config.rms_norm_eps: 1e-06 vs 0.5 (rank 1's value first)" in result, result
        assert "local_loading" in result
