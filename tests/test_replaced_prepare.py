"""A framework that replaces `accelerate.accelerator.fsdp2_prepare_model` with its own copy after
`patch()`, as axolotl does when it loads a model (`patch_accelerate_fsdp2`): ours must still run
around theirs, or a loader-built model reaches their copy on meta (axolotl's first line is
`model.state_dict()`: "still on the meta device") and the offload never starts.

On 2 real gloo ranks: the framework's copy runs, the loader fills the model, the offload moves
bytes, and every tensor after prepare and both losses equal the run with the loader and the
offload off (which goes through the same framework copy). Also where the copy wraps the layers
(and their parts) with torch's `checkpoint_wrapper` before `fully_shard`, as axolotl's does with
`activation_checkpointing`: the sharded model's names then hold `_checkpoint_wrapped_module`
segments rank 0's description did not ("missing from the source" on every rank).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_offload_cfg.testing.compare import digest as _digest
from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.training import train_steps

pytestmark = pytest.mark.distributed


def _config(ours: bool) -> dict[str, Any]:
    fsdp = {"fsdp_version": 2, "fsdp_cpu_ram_efficient_loading": ours, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}
    if ours:
        fsdp.update(load_strategy="sharded", activation_cpu_offload=True)
    return {"distributed_type": "FSDP", "mixed_precision": "no", "fsdp_config": fsdp}


def _install_framework_copy(kind: str, stock: Any) -> list[int]:
    """Replace accelerate's `fsdp2_prepare_model` as a framework would, after `patch()`:
    "copy" calls accelerate's own function as it was before `patch()` (axolotl's is a copy of
    it); "calls_ours" calls `accelerate.utils.fsdp2_prepare_model`, which is ours by then;
    "checkpoints_first" wraps each decoder layer and each of its direct parts with
    `checkpoint_wrapper` first, as axolotl's copy does."""
    import accelerate.accelerator
    import accelerate.utils

    inner = accelerate.utils.fsdp2_prepare_model if kind == "calls_ours" else stock
    calls: list[int] = []

    def fsdp2_prepare_model(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
        calls.append(1)
        model.state_dict()  # as axolotl's and accelerate's copies do first
        if kind == "checkpoints_first":
            _checkpoint_layers_and_their_parts(model)
        return inner(accelerator, model)

    accelerate.accelerator.fsdp2_prepare_model = fsdp2_prepare_model
    return calls


def _checkpoint_layers_and_their_parts(model: torch.nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    model.config.use_cache = False  # a cache grown in forward fails the recompute (transformers 4 uses one)
    decoder = type(model.model.layers[0])
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, decoder) or any(
        m is child for layer in model.model.layers for child in layer.children()))


def _worker(rank: int, world_size: int, path: str, ours: bool, kind: str) -> dict[str, Any]:
    import accelerate.utils.fsdp_utils
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg

    stock = accelerate.utils.fsdp_utils.fsdp2_prepare_model  # as a framework's copy is: taken before patch()
    fsdp_offload_cfg.patch(_config(ours))
    calls = _install_framework_copy(kind, stock)  # the framework patches accelerate when it loads a model
    accelerator = Accelerator()
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_pretrained(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = {k: _digest(v) for k, v in accelerator.get_state_dict(model).items()}
    losses = train_steps(accelerator, model, optimizer, rank)
    return {"state": state, "losses": losses, "framework_calls": len(calls),
            "offloaded": fsdp_offload_cfg.offload_stats()["offloaded_bytes"]}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    from fsdp_offload_cfg.testing.models import save_llama

    return save_llama(str(tmp_path_factory.mktemp("replaced_prepare") / "llama"))


@pytest.fixture(scope="module")
def plain(llama: str) -> list[dict[str, Any]]:
    return run_workers(_worker, 2, llama, False, "copy", timeout=300)


@pytest.mark.parametrize("kind", ["copy", "calls_ours", "checkpoints_first"])
def test_ours_runs_around_a_framework_copy_installed_after_patch(llama: str, plain: list[dict[str, Any]], kind: str):
    ours = run_workers(_worker, 2, llama, True, kind, timeout=300)
    for rank in (0, 1):
        assert ours[rank]["framework_calls"] == 1  # their copy still runs, once, inside ours
        assert ours[rank]["offloaded"] > 0
        assert ours[rank]["losses"] == plain[rank]["losses"], rank
    assert ours[0]["state"] and ours[0]["state"] == plain[0]["state"]  # get_state_dict gathers on rank 0
