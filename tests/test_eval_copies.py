"""Models accelerate keeps whole on every rank: `prepare_model(model, evaluation_mode=True)` shards
nothing under FSDP. TRL prepares GRPO's and RLOO's reward models that way, and GKD's teacher.

A loader-built model is on meta there. Before, the `model.to(device)` inside `prepare_model` read
it tensor by tensor, with a warning on every rank telling the user to load it differently (under
"auto" and "sharded"), or failed on rank 1 with "Cannot copy out of meta tensor" (under
"broadcast", where only rank 0 can read the files). Now it is filled whole on every rank, as a
plain load gives it, checked against the same run with the loader off, on 2 real gloo ranks.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from fsdp_offload_cfg.testing.compare import digest
from fsdp_offload_cfg.testing.configs import loader_config
from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.training import train_steps

pytestmark = pytest.mark.distributed

MODES = ["loader_off", "broadcast", "sharded", "auto"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from fsdp_offload_cfg.testing.models import save_llama, save_qwen2_reward

    root = tmp_path_factory.mktemp("eval_copies")
    return {"policy": save_llama(str(root / "policy")), "reward": save_qwen2_reward(str(root / "reward"))}


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _worker(rank: int, world_size: int, mode: str, paths: dict[str, str]) -> dict[str, Any]:
    import copy

    import transformers
    from accelerate import Accelerator

    import fsdp_offload_cfg

    warnings = _Warnings()
    logging.getLogger("fsdp_offload_cfg").addHandler(warnings)
    fsdp_offload_cfg.patch(loader_config(mode))
    accelerator = Accelerator()
    policy = transformers.AutoModelForCausalLM.from_pretrained(paths["policy"])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    reward = transformers.AutoModelForSequenceClassification.from_pretrained(paths["reward"], num_labels=1)
    reward = accelerator.prepare_model(reward, evaluation_mode=True, device_placement=True)  # as TRL's GRPO does
    tensors = {n: digest(t) for n, t in [*reward.named_parameters(), *reward.named_buffers()]}
    # Scored on a copy in fresh memory, in every mode: a CPU GEMM's rounding depends on where its
    # operands lie, and a plain load leaves each weight at its offset in the file.
    ids = torch.randint(1, 97, (4, 14), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        scores = copy.deepcopy(reward)(input_ids=ids).logits.flatten().tolist()
    return {"tensors": tensors, "scores": scores, "warnings": warnings.messages,
            "losses": train_steps(accelerator, policy, optimizer, rank, use_cache=False)}


@pytest.fixture(scope="module")
def runs(checkpoints: dict[str, str]) -> Any:
    """Each mode's run, launched when a test first asks for it (one failing mode fails its tests)."""
    done: dict[str, list[dict[str, Any]]] = {}

    def run(mode: str) -> list[dict[str, Any]]:
        if mode not in done:
            done[mode] = run_workers(_worker, 2, mode, checkpoints)
        return done[mode]

    return run


@pytest.mark.parametrize("mode", MODES[1:])
def test_a_model_prepared_for_evaluation_is_the_plain_load_on_every_rank(runs: Any, mode: str) -> None:
    for rank in (0, 1):
        got, plain = runs(mode)[rank], runs("loader_off")[rank]
        assert got["tensors"] == plain["tensors"], (mode, rank)
        assert got["scores"] == plain["scores"], (mode, rank)
        assert got["losses"] == plain["losses"], (mode, rank)  # the policy trains on after it


@pytest.mark.parametrize("mode", MODES[1:])
def test_no_rank_is_told_to_load_it_another_way(runs: Any, mode: str) -> None:
    """The fill is the loader's own step, not a use before prepare: no rank warns."""
    for rank in (0, 1):
        assert runs(mode)[rank]["warnings"] == [], (mode, rank)
