"""One original dtype per `fully_shard` group (`fsdp_offload_cfg.dtype_groups`).

transformers 5.24 keeps the MoE router gate of DeepSeek-V3, GLM-4.5 MoE and 22 more families in
float32 in a bf16 model; FSDP2 asserts one original dtype per group at the first forward, so
accelerate's one-unit-per-decoder-layer wrapping stopped training them. Here: which modules get a
group of their own (unit tests on toy modules), and real 2-rank gloo runs through `patch()` and
`accelerator.prepare` with the loader off, broadcast and sharded: the gate stays float32 after
prepare, through steps and in the saved checkpoint, every tensor equals a plain load, and the
losses are bit-equal across the three. A router kept in float32 by hand is split off too.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_offload_cfg.dtype_groups import DtypeGroupError, odd_dtype_modules
from fsdp_offload_cfg.testing.compare import digest as _digest
from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.training import train_steps

# --------------------------------------------------------------------------------------------
# which modules are split off
# --------------------------------------------------------------------------------------------


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 8, dtype=torch.float32))


class Layer(nn.Module):
    """A decoder layer: a bf16 body and a router gate that may be kept in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8, dtype=torch.bfloat16)
        self.mlp = nn.ModuleDict({"up": nn.Linear(8, 16, dtype=torch.bfloat16), "gate": Router()})


def test_a_float32_gate_in_a_bf16_layer_is_split_off():
    layer = Layer()
    assert odd_dtype_modules([layer]) == [layer.mlp["gate"]]


def test_a_uniform_unit_and_frozen_odd_parameters_need_no_group():
    """FSDP checks trainable parameters only: a frozen float32 gate may share the unit."""
    layer = Layer()
    layer.mlp["gate"].to(torch.bfloat16)
    assert odd_dtype_modules([layer]) == []
    layer = Layer()
    layer.mlp["gate"].requires_grad_(False)
    assert odd_dtype_modules([layer]) == []
    layer = Layer()
    assert odd_dtype_modules([layer], ignored={id(layer.mlp["gate"].weight)}) == []


def test_the_largest_uniform_subtree_is_split_not_each_leaf():
    """A float32 block kept whole (a module cast by hand) becomes one group, not one per Linear."""
    layer = Layer()
    layer.mlp.to(torch.float32)  # up and gate: float32, 16x8 + 4x8 elements; attn bf16, 8x8 + 8
    layer.attn = nn.Sequential(nn.Linear(8, 64, dtype=torch.bfloat16), nn.Linear(64, 8, dtype=torch.bfloat16))
    assert odd_dtype_modules([layer]) == [layer.mlp]


def test_the_dominant_dtype_is_the_one_with_most_elements():
    layer = Layer()
    layer.mlp["gate"].weight = nn.Parameter(torch.zeros(512, 8))  # float32 now outweighs the bf16 body
    assert set(odd_dtype_modules([layer])) == {layer.attn, layer.mlp["up"]}


def test_a_listed_unit_splits_whole_members():
    """accelerate's tail unit is a list [final norm, lm_head]: a float32 head goes on its own."""
    norm, head = nn.LayerNorm(8, dtype=torch.bfloat16), nn.Linear(8, 97, dtype=torch.bfloat16)
    norm.float()
    assert odd_dtype_modules([norm, head]) == [norm]


def test_mixed_dtypes_on_one_module_are_refused_with_the_names():
    lin = nn.Linear(8, 8, dtype=torch.bfloat16)
    lin.bias = nn.Parameter(torch.zeros(8))
    holder = nn.Sequential(lin, nn.Linear(8, 8, dtype=torch.bfloat16))
    with pytest.raises(DtypeGroupError, match=r"Linear \(0\) .*bias.*mixed_precision"):
        odd_dtype_modules([holder])


# --------------------------------------------------------------------------------------------
# real runs on 2 gloo ranks
# --------------------------------------------------------------------------------------------

MODES = ["loader_off", "broadcast", "sharded"]
STEPS = 3


def _config(mode: str) -> dict[str, Any]:
    loading = mode != "loader_off"
    fsdp = {"fsdp_version": 2, "fsdp_cpu_ram_efficient_loading": loading,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_state_dict_type": "SHARDED_STATE_DICT"}
    if loading:
        fsdp["load_strategy"] = mode
    return {"distributed_type": "FSDP", "mixed_precision": "no", "fsdp_config": fsdp}


def _cast_by_hand(model: nn.Module) -> None:
    """What a user keeping the router in float32 writes between from_pretrained and prepare (as
    recipes did before transformers 5.24 did it itself; the router casts its input to float32)."""
    model.get_submodule("model.layers.1.mlp.gate").float()


def _gathered_dtypes(model: nn.Module) -> dict[str, str]:
    return {n: str(p.dtype) for n, p in model.named_parameters()}


def _run_worker(rank: int, world_size: int, mode: str, paths: dict[str, str], out_root: str) -> dict[str, Any]:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg

    session = fsdp_offload_cfg.patch(_config(mode))
    results: dict[str, Any] = {}
    for name, path in paths.items():
        accelerator = Accelerator()
        accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = None  # the singleton keeps the first
        model = AutoModelForCausalLM.from_pretrained(path)
        if name == "deepseek_v3_by_hand":
            _cast_by_hand(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        prepared = accelerator.get_state_dict(model)  # every rank takes part
        dtypes_after_prepare = _gathered_dtypes(model)
        losses = train_steps(accelerator, model, optimizer, rank, steps=STEPS, use_cache=False)
        trained = accelerator.get_state_dict(model)
        out = os.path.join(out_root, mode, name)
        if accelerator.is_main_process:
            accelerator.unwrap_model(model).save_pretrained(out, state_dict=trained)
        accelerator.wait_for_everyone()
        results[name] = {
            "losses": losses,
            "dtypes_after_prepare": dtypes_after_prepare,
            "dtypes_after_steps": _gathered_dtypes(model),
            "prepared": {k: _digest(v) for k, v in prepared.items()} if rank == 0 else None,
            "trained_dtypes": {k: str(v.dtype) for k, v in trained.items()} if rank == 0 else None,
            "saved_to": out,
        }
    results["patches"] = session.patch_names
    results["stock_error"] = _stock_first_forward(paths["deepseek_v3"]) if mode == "loader_off" else None
    return results


def _stock_first_forward(path: str) -> str | None:
    """accelerate's own `fsdp2_prepare_model` (the patched one's original) on the same model, then
    one forward: the error it stops with, or None if it trains."""
    import accelerate.utils.fsdp_utils as fsdp_utils
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    stock = fsdp_utils.fsdp2_prepare_model.__wrapped__
    accelerator = Accelerator()
    model = stock(accelerator, AutoModelForCausalLM.from_pretrained(path))
    ids = torch.zeros(1, 4, dtype=torch.long)
    try:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    except AssertionError as exc:
        return str(exc)
    return None


def _plain(path: str, by_hand: bool) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    if by_hand:
        _cast_by_hand(model)
    return dict(model.state_dict())


def _gate_kept_in_float32(path: str) -> bool:
    """A plain load keeps the router gate in float32 while the rest is bf16 (transformers >= 5.24;
    4.x loads these checkpoints in float32 throughout)."""
    plain = _plain(path, by_hand=False)
    return (plain["model.layers.1.mlp.gate.weight"].dtype, plain["model.embed_tokens.weight"].dtype) == (
        torch.float32, torch.bfloat16)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from fsdp_offload_cfg.testing.models import save_deepseek_v3_fused, save_glm4_moe_fused

    root = tmp_path_factory.mktemp("dtype_groups")
    return {  # in the model's own layout, so that "sharded" reads slices instead of falling back
        "deepseek_v3": save_deepseek_v3_fused(str(root / "deepseek_v3")),
        "glm4_moe": save_glm4_moe_fused(str(root / "glm4_moe")),
        "deepseek_v3_by_hand": save_deepseek_v3_fused(str(root / "deepseek_v3_by_hand")),
    }


@pytest.fixture(scope="module")
def runs(checkpoints: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = str(tmp_path_factory.mktemp("trained"))
    return {mode: run_workers(_run_worker, 2, mode, checkpoints, out, timeout=300) for mode in MODES}


CASES = ["deepseek_v3", "glm4_moe", "deepseek_v3_by_hand"]


@pytest.mark.distributed
@pytest.mark.parametrize("name", CASES)
def test_losses_are_bit_equal_with_the_loader_off_broadcast_and_sharded(runs: dict[str, Any], name: str):
    for rank in (0, 1):
        losses = {mode: runs[mode][rank][name]["losses"] for mode in MODES}
        assert losses["broadcast"] == losses["loader_off"] == losses["sharded"], (rank, losses)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CASES)
def test_every_tensor_equals_a_plain_load_after_prepare(runs: dict[str, Any], checkpoints: dict[str, str],
                                                        mode: str, name: str):
    plain = _plain(checkpoints[name], by_hand=name == "deepseek_v3_by_hand")
    prepared = runs[mode][0][name]["prepared"]
    assert prepared == {k: _digest(v) for k, v in plain.items()}


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CASES)
def test_float32_modules_stay_float32_through_steps_and_in_the_saved_checkpoint(
        runs: dict[str, Any], checkpoints: dict[str, str], mode: str, name: str):
    from safetensors import safe_open

    plain = {k: str(v.dtype) for k, v in _plain(checkpoints[name], by_hand=name == "deepseek_v3_by_hand").items()}
    float32 = {k for k, d in plain.items() if d == "torch.float32"}
    if name == "deepseek_v3_by_hand" or _gate_kept_in_float32(checkpoints[name]):  # transformers >= 5.24
        assert "model.layers.1.mlp.gate.weight" in float32
    for rank in (0, 1):
        r = runs[mode][rank][name]
        for when in ("dtypes_after_prepare", "dtypes_after_steps"):
            assert r[when] == {k: plain[k] for k in r[when]}, (rank, when)
    assert runs[mode][0][name]["trained_dtypes"] == plain
    with safe_open(os.path.join(runs[mode][0][name]["saved_to"], "model.safetensors"), "pt") as f:
        saved = {k: str(f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    for key in float32:
        if key in saved:  # transformers may save MoE experts under other names
            assert saved[key] in ("F32", "float32"), (key, saved[key])


@pytest.mark.distributed
def test_the_plugin_is_installed_with_the_loader_off_and_stock_accelerate_needs_it(runs: dict[str, Any],
                                                                                   checkpoints: dict[str, str]):
    """With the loader and the offload off, the prepare patch still runs (it is what splits the
    groups). The stock control: where transformers keeps the gate in float32, accelerate's own
    `fsdp2_prepare_model` stops at the first forward; when an accelerate release fixes that, this
    fails so that docs/compatibility.md stops saying so."""
    assert "fsdp2-prepare-model" in runs["loader_off"][0]["patches"]
    errors = [runs["loader_off"][rank]["stock_error"] for rank in (0, 1)]
    if _gate_kept_in_float32(checkpoints["deepseek_v3"]):
        assert all(e and "uniform original parameter dtype" in e for e in errors), errors
    else:
        assert errors == [None, None], errors

