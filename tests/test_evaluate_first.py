"""`trainer.evaluate()` before `trainer.train()` under FSDP2 (patch `prepare-model-alone`).

The Trainer prepares a model it has not trained with `accelerator.prepare(model)`, no optimizer,
and accelerate refuses that under FSDP2: "When using FSDP2, a model and optimizer must be passed
together to `Accelerator.prepare()`" (transformers #39961 and #48841, open on 5.24; users ask for
a baseline evaluation first). Now the model is sharded as for training, and training after it
is the run that evaluates at its start instead (`eval_on_start`, which stock supports), bit for
bit, with each layer checkpointed once. On 2 real gloo ranks.
"""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_offload_cfg.testing.configs import loader_config
from fsdp_offload_cfg.testing.dist import run_workers

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    from fsdp_offload_cfg.testing.models import save_llama

    return save_llama(str(tmp_path_factory.mktemp("evaluate_first") / "llama"))


def _worker(rank: int, world_size: int, path: str, out: str, mode: str, first: str) -> dict[str, Any]:
    import numpy as np
    from datasets import Dataset
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(loader_config(mode, fsdp_activation_checkpointing=True))
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    ids = np.random.default_rng(0).integers(1, 97, (16, 12)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = TrainingArguments(output_dir=out, max_steps=2, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                             learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                             use_cpu=True, eval_strategy="steps", eval_steps=1, eval_on_start=first == "eval_on_start")
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(path), args=args, train_dataset=data,
                      eval_dataset=data)
    try:
        before = [trainer.evaluate()["eval_loss"]] if first == "evaluate" else []
    except ValueError as exc:
        return {"error": str(exc)}
    trainer.train()
    model = trainer.accelerator._models[0]
    optimized = {id(p): p for g in trainer.optimizer.param_groups for p in g["params"]}.values()
    return {"error": None,
            "eval": before + [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e],
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "checkpointed": sum(isinstance(m, CheckpointWrapper) for m in model.modules()),
            "optimizer": sorted({(type(p).__name__, tuple(p.shape)) for p in optimized}), "optimized": len(optimized)}


@pytest.mark.parametrize("mode", ["loader_off", "auto"])
def test_evaluate_before_train_is_the_run_that_evaluates_at_its_start(llama: str, tmp_path: Any, mode: str) -> None:
    evaluated = run_workers(_worker, 2, llama, str(tmp_path / "first"), mode, "evaluate")
    at_start = run_workers(_worker, 2, llama, str(tmp_path / "start"), mode, "eval_on_start")
    for rank in (0, 1):
        got, expected = evaluated[rank], at_start[rank]
        assert got["error"] is None, got["error"]
        assert len(got["eval"]) == 3 and len(got["losses"]) == 2, got
        assert (got["eval"], got["losses"]) == (expected["eval"], expected["losses"]), (rank, got, expected)
        assert got["checkpointed"] == expected["checkpointed"] > 0, "checkpointed as once (2 layers; accelerate 1.13 wraps more)"
        assert got["optimizer"] == expected["optimizer"] and got["optimized"] == expected["optimized"] == 21
        assert {kind for kind, _ in got["optimizer"]} == {"DTensor"}, "the sharded parameters, each once"


def _loop_worker(rank: int, world_size: int, path: str) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator
    from torch.distributed.tensor import DTensor

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(loader_config("loader_off"))
    from transformers import AutoModelForCausalLM

    accelerator = Accelerator()
    model = accelerator.prepare(AutoModelForCausalLM.from_pretrained(path))  # to evaluate it first
    tokens = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        model(input_ids=tokens, labels=tokens)  # FSDP2 leaves the root's parameters gathered after it
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)  # accelerate refuses an optimizer alone

    def full() -> dict[str, torch.Tensor]:
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}

    before = full()
    accelerator.backward(model(input_ids=tokens, labels=tokens, use_cache=False).loss)
    optimizer.step()
    after = full()
    return {"kinds": sorted({type(p).__name__ for g in optimizer.param_groups for p in g["params"]}),
            "untrained": sorted(n for n in before if torch.equal(before[n], after[n]))}


def test_an_optimizer_built_after_an_evaluation_trains_every_weight(llama: str) -> None:
    """A forward without backward leaves FSDP2's root unit gathered (its `reshard_after_forward`
    is off, since backward would gather it again at once), so an optimizer built after it took
    the root's gathered copies: the final norm and the output head of a Llama, whose updates the
    next all-gather overwrote; those weights never trained. Under accelerate 1.14 and later (1.13
    left the root resharded) the Trainer's evaluate() before train() did this on transformers
    5.20.2 (5.24 reshards before it builds the optimizer), and so does a loop, on any version."""
    for rank, got in enumerate(run_workers(_loop_worker, 2, llama)):
        assert got == {"kinds": ["DTensor"], "untrained": []}, (rank, got)
