"""One record of ours per module (`fsdp_offload_cfg.model_state`), gone once its uses end.

A model the loader built, prepared with the activation offload or a budget, trained two steps
and then unpatched carries nothing of ours: no record, and no attribute named like ours (the
budget's checkpoint wrappers are gone too: each layer is back in its parent's place).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fsdp_offload_cfg import model_state
from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.training import train_steps

PREFIX = "_fsdp_offload_cfg"


def _ours(model: nn.Module) -> list[str]:
    """Every attribute of ours on any module of `model`, as `module.attribute`."""
    return [f"{name or '<root>'}.{key}" for name, module in model.named_modules()
            for key in module.__dict__ if key.startswith(PREFIX)]


def test_a_record_goes_with_its_last_field():
    module = nn.Linear(2, 2)
    model_state.put(module, "load_call", "call")
    model_state.put(module, "offload", "handle")
    assert model_state.take(module, "load_call") == "call"
    assert model_state.get(module, "offload") == "handle" and model_state.ATTR in module.__dict__
    assert model_state.take(module, "offload") == "handle"
    assert _ours(module) == [] and model_state.take(module, "offload") is None


def test_the_loaders_fields_are_read_through_a_forwarding_wrapper():
    """PEFT's `PeftModel` forwards attribute reads to its base model; a loaded model wrapped after
    its load is still the loader's, as it was when each field was an attribute of its own."""

    class Forwarding(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.inner, name)

    inner = nn.Linear(2, 2)
    model_state.put(inner, "loader_source", True)
    wrapper = Forwarding(inner)
    model_state.put(wrapper, "offload", "handle")  # the wrapper's own record lacks the loader's field
    assert model_state.found(wrapper, "loader_source") is True
    assert model_state.get(wrapper, "loader_source") is False  # its own record: not the loader's
    assert model_state.found(nn.Linear(2, 2), "loader_source") is None


def _worker(rank: int, world_size: int, path: str, setting: str) -> dict[str, Any]:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg

    fsdp: dict[str, Any] = {"fsdp_version": 2, "fsdp_cpu_ram_efficient_loading": True,
                            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
    if setting == "offload":
        fsdp["fsdp_activation_cpu_offload"] = {"mode": "sync", "min_tensor_bytes": 0}
    else:
        fsdp |= {"fsdp_activation_memory_budget": 1 << 30, "fsdp_activation_budget_compute_tflops": 0.05,
                 "fsdp_activation_budget_copy_gb_per_s": 5}
    fsdp_offload_cfg.patch({"distributed_type": "FSDP", "mixed_precision": "no", "fsdp_config": fsdp})
    accelerator = Accelerator()
    model = AutoModelForCausalLM.from_pretrained(path)
    loaded = _ours(model)  # the loader's record: built on meta, guarded until prepare
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    train_steps(accelerator, model, optimizer, rank)
    trained = _ours(model)  # the offload's handle, or the planner and the wrappers' functions
    fsdp_offload_cfg.unpatch()
    return {"loaded": loaded, "trained": trained, "released": _ours(model)}


@pytest.mark.distributed
@pytest.mark.parametrize("setting", ["offload", "budget"])
def test_a_prepared_trained_and_unpatched_model_carries_nothing_of_ours(tmp_path, setting: str):
    from fsdp_offload_cfg.testing.models import save_llama

    path = save_llama(str(tmp_path / "llama"))
    for rank, result in enumerate(run_workers(_worker, 2, path, setting, timeout=300)):
        for stage in ("loaded", "trained"):  # one record a module, never an attribute of its own
            assert result[stage], (rank, stage, result)  # the test would prove nothing otherwise
            assert all(key.endswith(f".{model_state.ATTR}") for key in result[stage]), (rank, stage, result)
        assert f"<root>.{model_state.ATTR}" in result["loaded"]  # the loader's record on the model it built
        assert result["released"] == [], (rank, result)
