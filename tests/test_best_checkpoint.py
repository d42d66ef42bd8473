"""`load_best_model_at_end` with a sharded state dict (patch `trainer-checkpoint-folder`).

The Trainer names the best checkpoint where `os.path.exists` finds its folder, right after
`save_model`; under FSDP with `SHARDED_STATE_DICT` the folder appears only later, when the shards
are written. The first rank to ask kept the previous best, so the ranks named different
checkpoints and, at the end, each loaded its shard from its own: a model that was none of them
(on 2 gloo ranks the final evaluation came out 4.4846 or 4.5790 where the best step's is 4.5553).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from fsdp_offload_cfg.testing.configs import loader_config
from fsdp_offload_cfg.testing.dist import run_workers

pytestmark = pytest.mark.distributed


def _worker(rank: int, world_size: int, path: str, out: str) -> dict[str, Any]:
    import numpy as np
    from datasets import Dataset

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(loader_config("loader_off", fsdp_state_dict_type="SHARDED_STATE_DICT"))
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    ids = np.random.default_rng(0).integers(1, 97, (16, 12)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = TrainingArguments(output_dir=out, max_steps=3, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                             learning_rate=5e-2, logging_steps=1, report_to=[], save_strategy="steps", save_steps=1,
                             eval_strategy="steps", eval_steps=1, seed=0, use_cpu=True, load_best_model_at_end=True,
                             metric_for_best_model="eval_loss")
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(path), args=args, train_dataset=data,
                      eval_dataset=data)
    named: list[tuple[int, str]] = []  # after each checkpoint: the best step, and the checkpoint this rank names
    save = trainer._save_checkpoint

    def save_and_record(*a: Any, **k: Any) -> Any:
        result = save(*a, **k)
        named.append((trainer.state.best_global_step, os.path.basename(trainer.state.best_model_checkpoint or "")))
        return result

    trainer._save_checkpoint = save_and_record
    trainer.train()
    evaluations = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    return {"named": named, "evaluations": evaluations, "best_step": trainer.state.best_global_step,
            "final": trainer.evaluate()["eval_loss"]}


def test_every_rank_names_and_loads_the_best_checkpoint(tmp_path: Any) -> None:
    from fsdp_offload_cfg.testing.models import save_llama

    results = run_workers(_worker, 2, save_llama(str(tmp_path / "llama")), str(tmp_path / "out"))
    for rank in (0, 1):
        got = results[rank]
        assert [name for _, name in got["named"]] == [f"checkpoint-{best}" for best, _ in got["named"]], (rank, got)
        assert got["final"] == got["evaluations"][got["best_step"]], (rank, got)  # the best checkpoint, whole
    assert results[0]["named"] == results[1]["named"]
    assert len(set(results[0]["evaluations"].values())) == 3, "the steps differ: the test tells checkpoints apart"
