"""TRL's trainers on real gloo ranks, configured the way `accelerate launch --config_file` users
configure them: the plugin's keys in the accelerate config, `patch()` first, TRL unchanged.

Each run is compared with the same run without the loader and the offload: the losses must be
equal. DPO loads its reference model itself (`create_model_from_path`, on every rank) and shards
it with its own `prepare_fsdp`, not through accelerate's prepare.
"""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_offload_cfg.testing.dist import run_workers

pytest.importorskip("trl")
pytestmark = pytest.mark.distributed

PLUGIN = {"fsdp_cpu_ram_efficient_loading": True, "activation_cpu_offload": {"mode": "sync", "min_tensor_bytes": 0}}
STOCK = {"fsdp_cpu_ram_efficient_loading": False}


def _config(keys: dict[str, Any]) -> dict[str, Any]:
    return {
        "distributed_type": "FSDP",
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            **keys,
        },
    }


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    from fsdp_offload_cfg.testing.models import save_llama, save_word_tokenizer

    path = save_llama(str(tmp_path_factory.mktemp("ckpt") / "llama"), pad_token_id=0, eos_token_id=1)
    save_word_tokenizer(path)
    return path


def _worker(rank: int, world_size: int, trainer: str, path: str, out: str, keys: dict[str, Any],
            trls_reference: bool = False) -> dict[str, Any]:
    """`trls_reference`: the reference model sharded as TRL's `prepare_fsdp` shards it, the root alone."""
    import numpy as np
    from datasets import Dataset

    import fsdp_offload_cfg
    from fsdp_offload_cfg.integrations import trl as trl_integration
    from fsdp_offload_cfg.testing.models import words

    if trls_reference:
        trl_integration._shard_layers = lambda model, accelerator: None

    fsdp_offload_cfg.patch(_config(keys))
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    rng = np.random.default_rng(0)
    common = dict(output_dir=out, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
                  report_to=[], save_strategy="no", seed=0, max_length=24, dataloader_num_workers=0, bf16=False, use_cpu=True)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(path)
    if trainer == "sft":
        data = Dataset.from_dict({"text": [words(rng, 12) for _ in range(16)]})
        run = SFTTrainer(model=path, args=SFTConfig(**common), train_dataset=data, processing_class=tokenizer)
    else:
        data = Dataset.from_dict({
            "prompt": [words(rng, 6) for _ in range(16)],
            "chosen": [words(rng, 6) for _ in range(16)],
            "rejected": [words(rng, 6) for _ in range(16)],
        })  # fmt: skip
        run = DPOTrainer(model=path, args=DPOConfig(**common), train_dataset=data, processing_class=tokenizer)
    run.train()
    stats = fsdp_offload_cfg.offload_stats()
    from torch.distributed.fsdp import FSDPModule

    reference = getattr(run, "ref_model", None)
    return {
        "reference_units": sum(isinstance(m, FSDPModule) for m in reference.modules()) if reference else 0,
        "losses": [entry["loss"] for entry in run.state.log_history if "loss" in entry],
        "offloaded": stats["offloaded_bytes"] if stats else 0,
        "fsdp": type(run.accelerator.state.distributed_type).__name__ + ":" + run.accelerator.state.distributed_type.value,
    }


@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_trl_trainer_same_losses_with_loader_and_offload(llama: str, tmp_path, trainer: str) -> None:
    plugin = run_workers(_worker, 2, trainer, llama, str(tmp_path / "plugin"), PLUGIN, timeout=300)
    stock = run_workers(_worker, 2, trainer, llama, str(tmp_path / "stock"), STOCK, True, timeout=300)
    for rank in range(2):
        assert plugin[rank]["fsdp"].endswith(":FSDP"), plugin[rank]
        assert len(plugin[rank]["losses"]) == 3, plugin[rank]
        assert plugin[rank]["losses"] == stock[rank]["losses"], (rank, plugin[rank], stock[rank])
        assert plugin[rank]["offloaded"] > 0 and stock[rank]["offloaded"] == 0
        # DPO's reference model: TRL shards its root alone, one unit gathered whole for every
        # reference forward; here each decoder layer is its own unit, with the losses unchanged
        assert (plugin[rank]["reference_units"], stock[rank]["reference_units"]) == \
            ((3, 1) if trainer == "dpo" else (0, 0)), (plugin[rank], stock[rank])


def _grpo_worker(rank: int, world_size: int, path: str, reward: str, out: str, keys: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    from datasets import Dataset

    import fsdp_offload_cfg
    from fsdp_offload_cfg.testing.models import words

    fsdp_offload_cfg.patch(_config(keys))
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    rng = np.random.default_rng(0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    data = Dataset.from_dict({"prompt": [words(rng, 6) for _ in range(16)]})
    args = GRPOConfig(output_dir=out, max_steps=2, per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=6, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
                      seed=0, bf16=False, use_cpu=True)
    run = GRPOTrainer(model=path, reward_funcs=[reward], args=args, train_dataset=data, processing_class=tokenizer,
                      reward_processing_classes=[tokenizer])
    run.train()
    return {"losses": [entry["loss"] for entry in run.state.log_history if "loss" in entry],
            "rewards": [entry["reward"] for entry in run.state.log_history if "reward" in entry]}


def test_grpo_with_a_reward_model_under_broadcast_loading(llama: str, tmp_path) -> None:
    """GRPO loads its reward model by path and prepares it with `evaluation_mode=True` (whole on
    every rank). Under `load_strategy: broadcast` rank 1 failed there: "Cannot copy out of meta
    tensor". The rewards are the stock run's up to the last bit or two: the scores are the same
    model's (`test_eval_copies.py` checks every tensor bit for bit), but a CPU GEMM rounds by
    where its operands lie, and a plain load leaves each weight at its offset in the file. The
    losses are compared to the same tolerance: with two generations per prompt of one length, the
    two advantages of a group are +a and -a, so GRPO's loss (beta 0, one iteration: ratio 1) is
    their mean, zero up to rounding; its logged value (1e-8 or 0.0) is the rounding residue of
    rewards one bit apart, not a figure either run can be held to."""
    from fsdp_offload_cfg.testing.models import save_qwen2_reward, save_word_tokenizer

    reward = save_qwen2_reward(str(tmp_path / "reward"))
    save_word_tokenizer(reward)
    plugin = run_workers(_grpo_worker, 2, llama, reward, str(tmp_path / "plugin"),
                         {**STOCK, "fsdp_cpu_ram_efficient_loading": True, "load_strategy": "broadcast"}, timeout=300)
    stock = run_workers(_grpo_worker, 2, llama, reward, str(tmp_path / "stock"), STOCK, timeout=300)
    for rank in range(2):
        assert len(plugin[rank]["losses"]) == 2, plugin[rank]
        assert plugin[rank]["losses"] == pytest.approx(stock[rank]["losses"], rel=0, abs=1e-6), (rank, plugin, stock)
        assert plugin[rank]["rewards"] == pytest.approx(stock[rank]["rewards"], rel=1e-6, abs=0), (rank, plugin, stock)
