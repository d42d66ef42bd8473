"""`estimate --activation-budget`: the per-layer plan (keep, offload, checkpoint, both).

What a plan claims is checked against what does not come from the planner: the FLOPs it times
layers with against the layer's arithmetic, a mixed plan's saved bytes against the C allocator
after a real forward with exactly those layers checkpointed, and its choices against the time
model's extremes (free copies: offload; copies slower than recompute: checkpoint).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from fsdp_offload_cfg import cli, load_config
from fsdp_offload_cfg._sizes import UNITS
from fsdp_offload_cfg.estimate import EstimateError, estimate_memory
from fsdp_offload_cfg.estimate.activations import settings
from fsdp_offload_cfg.estimate.model import build_on_meta, example_batch, example_image, layer_class_names, read_model
from fsdp_offload_cfg.estimate.plan import TimeModel, plan_to_budget, uniform_plans
from fsdp_offload_cfg.estimate.probe import measure_activations
from fsdp_offload_cfg.offload.options import ActivationOffloadConfig
from fsdp_offload_cfg.testing.models import save_llama
from fsdp_offload_cfg.testing.real_runs import MALLINFO2, allocator_held_after_forward, real_model

SEQ, BATCH = 512, 2
OFFLOAD = ActivationOffloadConfig(enabled=True, mode="async")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """hidden 256, GQA, 4 layers: at 512 tokens its activations (~50 MB) dwarf the allocator's
    other traffic during a forward."""
    return save_llama(str(tmp_path_factory.mktemp("plan") / "llama"), hidden_size=256, intermediate_size=688,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=1000,
                      max_position_embeddings=1024)


def config():
    return load_config({"distributed_type": "FSDP", "mixed_precision": "bf16", "num_processes": 2,
                        "fsdp_config": {"version": 2, "activation_cpu_offload": {"enabled": False, "mode": "async"}}})


def profile_of(path: str, target: str = "cuda"):
    source = read_model(path)
    model = build_on_meta(source, torch.bfloat16, torch.bfloat16)
    batch = example_batch(source, BATCH, SEQ, torch.bfloat16, example_image(source.config, model))
    return measure_activations(model, batch,
                               layer_class_names(model, None), target=target)


def test_layer_flops_are_the_layers_arithmetic(llama: str):
    """2 FLOPs per weight per token for the projections, plus causal attention's two matmuls over
    half the T x T scores (a fused kernel skips the masked blocks)."""
    profile = profile_of(llama)
    h, inter, heads, kv_heads = 256, 688, 8, 4
    head_dim = h // heads
    weights = h * h + 2 * h * kv_heads * head_dim + h * h + 3 * h * inter
    tokens = BATCH * SEQ
    attention = 2 * BATCH * heads * SEQ * SEQ * 2 * head_dim // 2
    assert profile.flops == [2 * tokens * weights + attention] * 4


def test_uniform_plans_replay_the_four_settings_of_the_estimate(llama: str):
    """The per-layer replay, given the same choice for every layer, is the estimate's own table."""
    profile = profile_of(llama)
    time = TimeModel(compute_flops=1e12, copy_bytes=1e10, overlapped=True)
    uniform = uniform_plans(profile, OFFLOAD, True, time)
    assert {name: plan.residency for name, plan in uniform.items()} == settings(profile, OFFLOAD, True)


@pytest.mark.skipif(MALLINFO2 is None, reason="needs glibc's mallinfo2 to read the allocator")
def test_a_mixed_plan_saves_what_the_allocator_holds_with_those_layers_checkpointed(llama: str):
    """Layers 0 and 2 checkpointed, 1 and 3 kept: against a real bf16 forward with torch's
    checkpoint_wrapper on exactly those two layers, measured by the C allocator, within 2.5%."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from fsdp_offload_cfg.estimate.plan import _replay

    profile = profile_of(llama, target="cpu")
    estimated = _replay(profile, ["checkpoint", "keep", "checkpoint", "keep"], OFFLOAD, False).saved_bytes
    model, batch = real_model(llama, torch.bfloat16, BATCH, SEQ)
    for i in (0, 2):
        model.model.layers[i] = checkpoint_wrapper(model.model.layers[i])
    measured = allocator_held_after_forward(model, batch)
    assert abs(estimated / measured - 1) <= 0.025, (estimated, measured)
    all_kept = _replay(profile, ["keep"] * 4, OFFLOAD, False).saved_bytes
    all_checkpointed = _replay(profile, ["checkpoint"] * 4, OFFLOAD, False).saved_bytes
    assert all_checkpointed < estimated < all_kept


def _budgets(profile, time):
    uniform = uniform_plans(profile, OFFLOAD, True, time)
    low = min(p.residency.device_peak_bytes for p in uniform.values())
    high = uniform["plain"].residency.device_peak_bytes
    return uniform, [low + (high - low) * k // 8 for k in range(9)]


@pytest.mark.parametrize("copy_gb_per_s", [1.0, 25.0, 1000.0])
def test_every_plan_fits_and_is_never_slower_than_a_single_setting_that_fits(llama: str, copy_gb_per_s: float):
    profile = profile_of(llama)
    time = TimeModel(compute_flops=20e12, copy_bytes=copy_gb_per_s * 1e9, overlapped=True)
    uniform, budgets = _budgets(profile, time)
    mixed = 0
    for budget in budgets:
        plan = plan_to_budget(profile, budget, OFFLOAD, True, time)
        assert plan.residency.device_peak_bytes <= budget
        fitting = [p.extra_seconds for p in uniform.values() if p.residency.device_peak_bytes <= budget]
        assert plan.extra_seconds <= min(fitting) + 1e-12, (budget, plan.choices)
        mixed += plan.extra_seconds < min(fitting) - 1e-12  # cheaper than any one setting: layers differ
    if uniform["offload"].extra_seconds > 0:  # (copies that all hide: offloading every layer costs nothing)
        assert mixed >= 3  # between the settings' peaks, per-layer choices pay less than any single setting
    assert plan_to_budget(profile, budgets[-1], OFFLOAD, True, time).choices == ["keep"] * 4  # plain fits: nothing


def test_copies_that_hide_go_first_and_slow_copies_lose_to_recompute(llama: str):
    """A budget just under plain's peak: with copies free the plan offloads and recomputes
    nothing; with copies far slower than a forward it checkpoints and moves nothing."""
    profile = profile_of(llama)
    free = TimeModel(compute_flops=1e12, copy_bytes=1e15, overlapped=True)
    budget = uniform_plans(profile, OFFLOAD, True, free)["plain"].residency.device_peak_bytes * 3 // 4
    hidden = plan_to_budget(profile, budget, OFFLOAD, True, free)
    assert "offload" in hidden.choices and not any(c.startswith("checkpoint") for c in hidden.choices)
    assert hidden.extra_seconds == 0.0
    slow = plan_to_budget(profile, budget, OFFLOAD, True, TimeModel(1e12, 1e6, overlapped=True))
    assert "checkpoint" in slow.choices and not any(c.endswith("offload") for c in slow.choices)
    assert slow.residency.host_bytes == 0


def test_a_plan_keeps_the_heads_backward_within_its_budget(llama: str):
    """The head's backward (the loss's and the log-softmax's float32 gradients of the logits)
    runs while every save the plan keeps is still on the device: a plan must leave it room. Plans
    made for the layers' moments alone overran every budget here at that moment."""
    profile = profile_of(llama)
    time = TimeModel(compute_flops=1e12, copy_bytes=1e10, overlapped=True)
    head = profile.head_backward_bytes()
    assert head > 0
    _, budgets = _budgets(profile, time)
    for budget in budgets[:-1]:
        plan = plan_to_budget(profile, budget, OFFLOAD, True, time)
        assert plan.residency.forward_end_device_bytes + head <= plan.residency.device_peak_bytes <= budget


def test_the_last_layer_is_never_offloaded_unless_the_config_says_so(llama: str):
    profile = profile_of(llama)
    free = TimeModel(compute_flops=1e12, copy_bytes=1e15, overlapped=True)
    smallest = min(p.residency.device_peak_bytes for p in uniform_plans(profile, OFFLOAD, True, free).values())
    assert not plan_to_budget(profile, smallest, OFFLOAD, True, free).choices[-1].endswith("offload")
    last_too = ActivationOffloadConfig(enabled=True, mode="async", offload_last_group=True)
    assert plan_to_budget(profile, smallest, last_too, True, free).choices[-1].endswith("offload")


def test_a_budget_nothing_meets_names_the_smallest_that_does(llama: str):
    profile = profile_of(llama)
    time = TimeModel(compute_flops=1e12, copy_bytes=1e10, overlapped=True)
    with pytest.raises(EstimateError, match=r"activation budget 1 B: no plan fits; the smallest activation "
                                            r"peak on the device a plan reaches is ([0-9.]+) (KiB|MiB)") as error:
        plan_to_budget(profile, 1, OFFLOAD, True, time)
    number, unit = re.search(r"reaches is ([0-9.]+) (KiB|MiB)", error.value.args[0]).groups()
    plan_to_budget(profile, int((float(number) + 0.1) * UNITS[unit.lower()]), OFFLOAD, True, time)  # and that fits


def test_a_budget_just_under_the_smallest_names_both_in_bytes(llama: str):
    """Sizes that round alike ("budget 0.3 MiB ... is 0.3 MiB") would leave the user guessing."""
    profile = profile_of(llama)
    time = TimeModel(compute_flops=1e12, copy_bytes=1e10, overlapped=True)
    smallest = min(p.residency.device_peak_bytes for p in uniform_plans(profile, OFFLOAD, True, time).values())
    with pytest.raises(EstimateError, match=r"\(([0-9]+) bytes\): no plan fits; .* reaches is [0-9.]+ MiB "
                                            r"\(([0-9]+) bytes\)") as error:
        plan_to_budget(profile, smallest - 1, OFFLOAD, True, time)
    named = int(error.value.args[0].split("reaches is ")[1].split("(")[1].split(" bytes")[0])
    assert named <= smallest
    plan_to_budget(profile, named, OFFLOAD, True, time)  # the bytes it names fit


# ------------------------------------------------------------------------------ report and CLI

CONFIG_YAML = """distributed_type: FSDP
mixed_precision: bf16
num_processes: 8
fsdp_config:
  fsdp_version: 2
"""


def _cli(tmp_path: Path, llama: str, *extra: str) -> int:
    config_file = tmp_path / "fsdp2.yaml"
    config_file.write_text(CONFIG_YAML)
    return cli.main(["estimate", str(config_file), "--model", llama, "--seq-len", str(SEQ), "--batch-size",
                     str(BATCH), *extra])


def test_cli_json_plan_has_each_layer_and_the_single_settings(llama: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]):
    report = estimate_memory(config(), llama, seq_len=SEQ, batch_size=BATCH, device="cuda")
    budget = report["activations"]["settings"]["plain"]["device_peak_bytes"] // 2
    assert _cli(tmp_path, llama, "--activation-budget", str(budget), "--format", "json",
                "--copy-gb-per-s", "10") == 0
    out = json.loads(capsys.readouterr().out)
    plan = out["plan"]
    assert plan["budget_bytes"] == budget and plan["device_peak_bytes"] <= budget
    assert [layer["name"] for layer in plan["layers"]] == [g["name"] for g in out["activations"]["per_group"]]
    assert set(plan["uniform"]) == {"plain", "checkpointing", "offload", "checkpointing_and_offload"}
    assert plan["time_model"] == {"compute_tflops": 350.0, "copy_gb_per_s": 10.0, "copies_overlap_compute": True}
    assert out["device_by_setting"]["plan"]["activations_bytes"] <= budget
    assert "plan" not in estimate_memory(config(), llama, seq_len=SEQ, batch_size=BATCH)  # only when asked


def test_cli_table_and_errors(llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert _cli(tmp_path, llama, "--activation-budget", "1GiB") == 0
    out = capsys.readouterr().out
    assert "Plan for an activation budget of 1.00 GiB" in out and "| single setting |" in out
    assert _cli(tmp_path, llama, "--activation-budget", "1") == 1
    assert "no plan fits; the smallest activation peak on the device a plan reaches is" in capsys.readouterr().err
    assert _cli(tmp_path, llama, "--activation-budget", "lots") == 1
    assert "--activation-budget: expected a size from 1 byte to 1 PiB (such as 12GiB), or auto, auto-2GiB, auto-5% " \
        "(a margin below the device's size); got 'lots'" in capsys.readouterr().err
    assert _cli(tmp_path, llama, "--activation-budget", "1GiB", "--compute-tflops", "0") == 1
    assert "--compute-tflops must be positive" in capsys.readouterr().err
    assert _cli(tmp_path, llama, "--copy-gb-per-s", "3") == 0
    assert "ignored without one" in capsys.readouterr().err


def test_cli_auto_plans_what_the_device_leaves(llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """`--activation-budget auto --device-memory`: the budget is the device less the per-rank
    states, gathered layers and margin the same report shows, less the logits (bf16 under
    mixed precision), which a loop keeping `outputs` through backward holds at its peak, and the
    plan fits it."""
    import json

    from fsdp_offload_cfg._sizes import show_size

    assert _cli(tmp_path, llama, "--activation-budget", "auto-5%", "--device-memory", "8GiB", "--format", "json") == 0
    report = json.loads(capsys.readouterr().out)
    per_rank, room = report["per_rank"], report["plan"]["room"]
    states = sum(per_rank[f"{kind}_bytes"] for kind in ("params", "grads", "optimizer", "buffers", "gathered_params"))
    logits = BATCH * SEQ * 1000 * 2
    assert room == {"device_bytes": 8 * 2**30, "taken_bytes": per_rank["params_bytes"] + per_rank["buffers_bytes"],
                    "to_come_bytes": states - per_rank["params_bytes"] - per_rank["buffers_bytes"] + logits,
                    "margin_bytes": int(8 * 2**30 * 0.05), "colocated_bytes": 0}
    assert report["plan"]["budget_bytes"] == 8 * 2**30 - states - logits - int(8 * 2**30 * 0.05)
    # what the estimate's own peaks leave out, said with its size
    assert f"the forward's output ({show_size(logits)}: the logits) is dropped before backward" in " ".join(
        report["assumptions"]), report["assumptions"]
    assert _cli(tmp_path, llama, "--activation-budget", "auto", "--device-memory", "8GiB") == 0
    assert "Activation budget auto: the device's 8.00 GiB, less " in capsys.readouterr().out
    assert _cli(tmp_path, llama, "--activation-budget", "auto", "--device-memory", "1MiB") == 1
    assert "activation budget auto: nothing is left for activations (device 1.0 MiB" in capsys.readouterr().err
    assert _cli(tmp_path, llama, "--activation-budget", "auto", "--device", "cpu") == 1
    assert "the device's memory is unknown here; pass --device-memory" in capsys.readouterr().err


def test_auto_that_no_plan_fits_says_the_room_and_how_far_short_not_raise_the_budget(
        llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """A device that leaves activations some room, less than any plan needs: the answer was "Raise
    the budget to at least X", a number `auto` users never wrote. It now gives the room's figures,
    how far short they are, and what changes them."""
    import json

    assert _cli(tmp_path, llama, "--activation-budget", "auto-1MiB", "--device-memory", "8GiB", "--format", "json") == 0
    report = json.loads(capsys.readouterr().out)
    room = report["plan"]["room"]
    smallest = min(u["device_peak_bytes"] for u in report["plan"]["uniform"].values())
    device = room["taken_bytes"] + room["to_come_bytes"] + 2**20 + smallest // 2
    assert _cli(tmp_path, llama, "--activation-budget", "auto-1MiB", "--device-memory", str(device)) == 1
    err = capsys.readouterr().err
    assert "activation budget auto: device " in err and "that leaves " in err and "more; use more ranks" in err, err
    assert "Raise the budget" not in err, err


def test_auto_without_a_device_size_is_said_before_the_model_is_read(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]):
    """A flag missing is said at once, not after the model is built and run on meta (12 s for
    an 8B config): here the model path does not even exist, and the device's size is what is said."""
    assert _cli(tmp_path, str(tmp_path / "not-read"), "--activation-budget", "auto", "--device", "cpu") == 1
    err = capsys.readouterr().err
    assert "the device's memory is unknown here; pass --device-memory" in err and "not-read" not in err


def test_auto_on_the_command_line_plans_against_the_configs_device_size(llama: str):
    """`--activation-budget auto-1MiB` without `--device-memory`: the size the config states."""
    from fsdp_offload_cfg._sizes import parse_auto

    stated = load_config({"distributed_type": "FSDP", "mixed_precision": "bf16", "num_processes": 2, "fsdp_config": {
        "version": 2, "activation_memory_budget": "auto", "activation_budget_device_memory": "8GiB"}})
    report = estimate_memory(stated, llama, seq_len=SEQ, batch_size=BATCH, device="cpu",
                             activation_budget=parse_auto("auto-1MiB"))
    assert report["plan"]["room"]["device_bytes"] == 8 * 2**30 and report["plan"]["room"]["margin_bytes"] == 2**20


def test_the_plot_draws_the_plan_and_its_budget(llama: str, tmp_path: Path):
    pytest.importorskip("matplotlib")
    from fsdp_offload_cfg.estimate.plot import GIB, draw_memory

    report = estimate_memory(config(), llama, seq_len=SEQ, batch_size=BATCH, activation_budget=2**25)
    axes = draw_memory(report).axes[0]
    labels = [t.get_text() for t in axes.get_xticklabels()]
    assert labels[-1] == "plan"
    (budget_line,) = axes.collections
    plan = report["device_by_setting"]["plan"]
    below = plan["peak_device_bytes"] - plan["activations_bytes"] - plan["logits_grad_bytes"]
    assert budget_line.get_segments()[0][0][1] == pytest.approx((below + 2**25) / GIB)


def test_the_configs_budget_is_planned_like_the_run_plans_it(llama: str):
    """`estimate --set fsdp_config.activation_memory_budget=...`: the plan is the config's setting."""
    budget = 20 * 2**20
    from_config = estimate_memory(load_config({"distributed_type": "FSDP", "mixed_precision": "bf16",
                                               "num_processes": 2,
                                               "fsdp_config": {"version": 2, "activation_memory_budget": "20MiB"}}),
                                  llama, seq_len=SEQ, batch_size=BATCH, device="cuda")
    from_option = estimate_memory(config(), llama, seq_len=SEQ, batch_size=BATCH, device="cuda",
                                  activation_budget=budget)
    assert from_config["plan"]["layers"] == from_option["plan"]["layers"]
    assert from_config["inputs"]["activation_setting"] == "plan"
    assert from_config["per_rank"]["activations_on_device_bytes"] == from_config["plan"]["device_peak_bytes"]


def test_the_configs_rates_time_the_plan_and_the_command_line_wins(llama: str, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]):
    """The rates a run would plan at (`activation_budget_compute_tflops` / `_copy_gb_per_s`) are the
    estimate's too; `--compute-tflops` / `--copy-gb-per-s` override them, as a command line does."""
    stated = load_config({"distributed_type": "FSDP", "mixed_precision": "bf16", "num_processes": 2,
                          "fsdp_config": {"version": 2, "activation_memory_budget": "20MiB",
                                          "activation_budget_compute_tflops": 20, "activation_budget_copy_gb_per_s": 3}})
    report = estimate_memory(stated, llama, seq_len=SEQ, batch_size=BATCH, device="cuda")
    assert report["plan"]["time_model"] == {"compute_tflops": 20.0, "copy_gb_per_s": 3.0, "copies_overlap_compute": True}
    given = estimate_memory(stated, llama, seq_len=SEQ, batch_size=BATCH, device="cuda", compute_flops=7e12)
    assert given["plan"]["time_model"]["compute_tflops"] == 7.0 and given["plan"]["time_model"]["copy_gb_per_s"] == 3.0
    config_file = tmp_path / "rates.yaml"
    config_file.write_text(CONFIG_YAML.replace("fsdp_config:\n", "fsdp_config:\n  fsdp_activation_memory_budget: 20MiB\n"
                                               "  fsdp_activation_budget_copy_gb_per_s: 3\n"))
    assert cli.main(["estimate", str(config_file), "--model", llama, "--seq-len", str(SEQ), "--batch-size", str(BATCH),
                     "--format", "json", "--compute-tflops", "9"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["time_model"]["compute_tflops"] == 9.0


def test_the_estimate_and_the_run_time_plan_compute_in_the_same_dtype_for_every_mixed_precision():
    """The compute dtype was decided twice: the run-time planner had no fp8 entry (it planned fp8
    activations in the parameters' float32), the estimate took bf16."""
    from types import SimpleNamespace

    from torch import nn

    from fsdp_offload_cfg.budget import _compute_dtype
    from fsdp_offload_cfg.config.keys import LAUNCH
    from fsdp_offload_cfg.estimate import resolve_dtypes

    values = next(key for key in LAUNCH if key.name == "mixed_precision").schema["enum"]
    assert set(values) == {"no", "fp8", "fp16", "bf16"}, values
    model = nn.Linear(4, 4)  # float32 parameters, as loaded
    for value in values:
        cfg = load_config({"distributed_type": "FSDP", "mixed_precision": value, "fsdp_config": {"fsdp_version": 2}})
        planned = _compute_dtype(model, cfg)
        estimated = resolve_dtypes(cfg, SimpleNamespace(dtype=torch.float32), None).compute
        assert planned == estimated, (value, planned, estimated)
