"""PEFT adapters on a loader-built model train exactly like adapters on a plain load.

On 2 real gloo ranks through `patch()`, `get_peft_model` and `accelerator.prepare`, the same seed,
with the loader off, "broadcast" and "sharded": the adapters after prepare and the losses of a
few steps (with LoRA dropout, so the RNG stream after `get_peft_model` counts too) are bit-equal.
Under "sharded" they used to drift from step 1: PEFT's adapters followed the meta base weight to
`meta` and rank 0 drew them again at prepare. DoRA's magnitude needs the base weights: rank 0
reads them for it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_offload_cfg.testing.compare import digest as _digest
from fsdp_offload_cfg.testing.configs import loader_config as _config
from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.training import train_steps

pytestmark = pytest.mark.distributed

MODES = ["loader_off", "broadcast", "sharded"]
ADAPTERS = {
    "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.1},
    "lora_gaussian": {"r": 4, "target_modules": ["q_proj", "v_proj", "down_proj"], "init_lora_weights": "gaussian"},
    # ms-swift seeds each rank with seed + rank: each rank draws other adapters, and a plain FSDP2
    # run keeps each rank's own rows (rank 0's were sent to every rank before)
    "lora_seed_per_rank": {"r": 4, "target_modules": ["q_proj", "v_proj"]},
    "dora": {"r": 4, "target_modules": ["q_proj", "v_proj"], "use_dora": True},
    # a copy of a base module to train: rank 0 reads the base whole, the other ranks compute DoRA on
    # meta (LlamaFactory's new tokens: `additional_target`); it read the base on rank 1 and failed there
    "dora_modules_to_save": {"r": 4, "target_modules": ["q_proj", "v_proj"], "use_dora": True,
                             "modules_to_save": ["lm_head"]},
    "pissa": {"r": 4, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": "pissa"},
    "dora_bf16": {},  # the "dora" adapter on a bf16 base
    "dora_saved": {},  # the "dora" adapter, trained a little and saved, loaded with `PeftModel.from_pretrained`
}
STEPS = 3


def _train_worker(rank: int, world_size: int, mode: str, path: str, adapters: list[str]) -> dict[str, Any]:
    from accelerate import Accelerator
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(_config(mode))
    out: dict[str, Any] = {}
    for name in adapters:
        accelerator = Accelerator()
        torch.manual_seed(7 + rank if name == "lora_seed_per_rank" else 7)  # one seed on every rank, as scripts set it
        try:
            if name == "dora_saved":
                model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), _saved_dora(path, rank),
                                                  is_trainable=True)
            elif name == "dora_bf16":  # a bf16 base, float32 adapters (PEFT's autocast_adapter_dtype)
                base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
                model = get_peft_model(base, LoraConfig(**ADAPTERS["dora"]))
            else:
                model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(**ADAPTERS[name]))
            base = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
            on_meta_before_prepare = base.is_meta
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
            model, optimizer = accelerator.prepare(model, optimizer)
        except (RuntimeError, NotImplementedError) as exc:
            out[name] = {"error": str(exc)}
            continue
        state = accelerator.get_state_dict(model)
        prepared = {k: _digest(v) for k, v in state.items() if "lora_" in k}
        losses = train_steps(accelerator, model, optimizer, rank, steps=STEPS, use_cache=False)
        trained = {k: _digest(v) for k, v in accelerator.get_state_dict(model).items() if "lora_" in k}
        out[name] = {"prepared": prepared, "losses": losses, "trained": trained,
                     "base_on_meta_before_prepare": on_meta_before_prepare}
    return out


def _saved_dora(path: str, rank: int) -> str:
    """A trained-looking DoRA adapter (B and the magnitude away from their init), saved by a plain
    load on this rank: what `PeftModel.from_pretrained` loads."""
    import os
    import tempfile

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg

    with fsdp_offload_cfg.local_loading():
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(**ADAPTERS["dora"]))
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_magnitude_vector" in name:
                p.add_(torch.randn(p.shape, generator=generator).to(p.dtype) * 0.1)
    # under the test's own temporary directory, which pytest removes (not the system's /tmp)
    out = os.path.join(tempfile.mkdtemp(prefix=f"dora_saved_r{rank}_", dir=os.path.dirname(path)), "adapter")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    from fsdp_offload_cfg.testing.models import save_llama

    path = save_llama(str(tmp_path_factory.mktemp("adapters") / "llama"))
    return {mode: run_workers(_train_worker, 2, mode, path, list(ADAPTERS), timeout=300) for mode in MODES}


@pytest.mark.parametrize("mode", ["broadcast", "sharded"])
@pytest.mark.parametrize("adapter", ["lora", "lora_gaussian", "lora_seed_per_rank"])
def test_adapters_and_losses_equal_the_run_without_the_loader(runs: dict[str, Any], mode: str, adapter: str):
    for rank in (0, 1):
        plain, ours = runs["loader_off"][rank][adapter], runs[mode][rank][adapter]
        assert ours["losses"] == plain["losses"], (rank, ours["losses"], plain["losses"])
    plain, ours = runs["loader_off"][0][adapter], runs[mode][0][adapter]  # get_state_dict gathers on rank 0
    assert plain["prepared"], "no adapter tensors were compared"
    assert ours["prepared"] == plain["prepared"], "adapters after prepare differ"
    assert ours["trained"] == plain["trained"], "trained adapters differ"


@pytest.mark.parametrize("mode", ["broadcast", "sharded"])
def test_an_init_computed_from_the_base_is_refused_on_every_rank_naming_it(runs: dict[str, Any], mode: str):
    """PiSSA computes the adapter from the SVD of the base weights before PEFT places it: on a
    meta base that failed inside PEFT on the other ranks only (rank 0 then waited in prepare)."""
    assert runs["loader_off"][0]["pissa"]["losses"], "PiSSA trains without the loader"
    for rank in (0, 1):
        error = runs[mode][rank]["pissa"].get("error", "")
        assert "init_lora_weights='pissa' computes the adapter from the base weights" in error, (rank, error)
        assert "fsdp_cpu_ram_efficient_loading: false" in error


@pytest.mark.parametrize("mode", ["broadcast", "sharded"])
@pytest.mark.parametrize("adapter", ["dora", "dora_bf16", "dora_saved", "dora_modules_to_save"])
def test_dora_equals_the_run_without_the_loader(runs: dict[str, Any], mode: str, adapter: str):
    """DoRA's magnitude is a norm of the base weights' rows: each rank computes its own rows after
    the load (under "sharded" it used to stop at prepare: no rank held the base weights). A saved
    DoRA adapter keeps the magnitude it was saved with (computing it from the base would differ)."""
    for rank in (0, 1):
        assert runs[mode][rank][adapter]["losses"] == runs["loader_off"][rank][adapter]["losses"], rank
    plain, ours = runs["loader_off"][0][adapter], runs[mode][0][adapter]
    assert any("lora_magnitude_vector" in k for k in plain["prepared"])
    assert ours["prepared"] == plain["prepared"] and ours["trained"] == plain["trained"]


@pytest.mark.parametrize("mode", ["broadcast", "sharded"])
def test_dora_leaves_the_base_weights_unread_on_rank_0_until_prepare(runs: dict[str, Any], mode: str):
    """No rank reads the base model whole for DoRA (rank 0 used to: a full copy of the model on one
    rank, the peak the loader exists to avoid)."""
    for rank in (0, 1):
        assert runs[mode][rank]["dora"]["base_on_meta_before_prepare"], rank
        assert runs[mode][rank]["dora_saved"]["base_on_meta_before_prepare"], rank
    assert not runs["loader_off"][0]["dora"]["base_on_meta_before_prepare"]
