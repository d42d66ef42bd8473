"""No KV cache in a forward with gradients of a model accelerate checkpoints (`training_cache.py`).

With `fsdp_activation_checkpointing: true`, a Llama (whose config says `use_cache: true`) filled a
`DynamicCache` in its training forward; each checkpointed layer appended to it again when
backward recomputed it, and on transformers 4.57 the first backward stopped with "Recomputed
values for the following tensors have different metadata than during the forward pass", under
FSDP2 and FSDP1, in a plain accelerate loop and in the 4.x Trainer (transformers #34928). On 5.x
the cache came back with the output, holding every layer's keys and values through backward.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_offload_cfg.testing.configs import loader_config
from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.training import train_steps

FSDP1_AC = {"distributed_type": "FSDP", "mixed_precision": "no", "fsdp_config": {
    "fsdp_version": 1, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_sync_module_states": False,
    "fsdp_cpu_ram_efficient_loading": False, "fsdp_use_orig_params": True, "fsdp_activation_checkpointing": True}}
CONFIGS = {"fsdp2_checkpointed": loader_config("auto", fsdp_activation_checkpointing=True), "fsdp1_checkpointed": FSDP1_AC,
           "fsdp2": loader_config("auto")}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    from fsdp_offload_cfg.testing.models import save_llama

    return save_llama(str(tmp_path_factory.mktemp("training_cache") / "llama"))


def _cache_of(output: Any) -> Any:
    """The cache a forward returned (transformers 5 names it `cache`, 4.x `past_key_values`)."""
    return output.get("cache", output.get("past_key_values"))


def _worker(rank: int, world_size: int, path: str, config: str) -> dict[str, Any]:
    import transformers
    from accelerate import Accelerator

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(CONFIGS[config])
    accelerator = Accelerator()
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()  # as a training loop does; use_cache left to the model's config (true)
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(rank))
    try:
        output = model(input_ids=ids, labels=ids)
        cache = type(_cache_of(output)).__name__
        accelerator.backward(output.loss)
        optimizer.zero_grad()
        losses = train_steps(accelerator, model, optimizer, rank)
    except Exception as exc:  # noqa: BLE001 - what this rank saw is the result
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    with torch.no_grad():  # without gradients nothing is recomputed: the model's own setting stands
        kept = type(_cache_of(model(input_ids=ids))).__name__
    return {"error": None, "cache": cache, "losses": losses, "no_grad_cache": kept}


@pytest.mark.distributed
@pytest.mark.parametrize("config", ["fsdp2_checkpointed", "fsdp1_checkpointed"])
def test_a_checkpointed_model_trains_with_the_models_use_cache_and_builds_no_cache(llama: str, config: str) -> None:
    checkpointed = run_workers(_worker, 2, llama, config)
    plain = run_workers(_worker, 2, llama, "fsdp2")
    for rank in (0, 1):
        assert checkpointed[rank]["error"] is None, checkpointed[rank]["error"]
        assert checkpointed[rank]["cache"] == "NoneType", "a forward with gradients builds no cache"
        assert checkpointed[rank]["losses"] == plain[rank]["losses"], "bit for bit the run without checkpointing"
        assert checkpointed[rank]["no_grad_cache"] == plain[rank]["no_grad_cache"] == "DynamicCache"


def _tiny() -> torch.nn.Module:
    import transformers

    from fsdp_offload_cfg.testing.models import llama_config

    return transformers.LlamaForCausalLM(llama_config())


def test_the_hook_turns_the_cache_off_only_with_gradients_and_goes_with_remove() -> None:
    from fsdp_offload_cfg import training_cache

    model, ids = _tiny(), torch.tensor([[1, 2, 3]])
    assert training_cache.cache_off_in_training(model) is model
    assert training_cache.cache_off_in_training(model) is model  # once
    assert len(model._forward_pre_hooks) == 1
    assert _cache_of(model(input_ids=ids)) is None
    with torch.no_grad():
        assert _cache_of(model(input_ids=ids)) is not None
    training_cache.remove(model)
    assert not model._forward_pre_hooks and _cache_of(model(input_ids=ids)) is not None


def test_the_hook_goes_on_the_model_inside_a_peft_wrapper() -> None:
    """`PeftModelForCausalLM.forward` takes `**kwargs`, not `use_cache`: the transformers model in
    it, whose forward names `use_cache`, is hooked."""
    peft = pytest.importorskip("peft")
    from fsdp_offload_cfg import training_cache

    model = peft.get_peft_model(_tiny(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    hooked = training_cache.cache_off_in_training(model)
    assert type(hooked).__name__ == "LlamaForCausalLM"
    assert _cache_of(model(input_ids=torch.tensor([[1, 2, 3]]))) is None


def test_a_module_without_use_cache_is_left_alone() -> None:
    from fsdp_offload_cfg import training_cache

    assert training_cache.cache_off_in_training(torch.nn.Linear(2, 2)) is None
