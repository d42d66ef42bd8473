"""`activation_memory_budget` in a run: planned at the first training forward, exact, agreed by all ranks.

On 2 real gloo ranks through `patch()` and `accelerator.prepare`, one seed: a budget that needs a
mix of choices, and one that needs checkpointing too, train bit-for-bit what the same run without
a budget trains (losses, gradient norms, final weights), with the loader off and on; the choices
the layers run with are the planner's for that batch; a budget no plan meets stops every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_offload_cfg.testing.compare import digest as _digest
from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.logs import MessageLog
from fsdp_offload_cfg.testing.models import shard_by_layer

pytestmark = pytest.mark.distributed

BATCH, SEQ, LAYERS = 2, 48, 4
LORA_RANK = 4
AUTO_MARGIN = 2**20
AUTO = "auto-1MiB"  # the `auto` runs' budget: a stated device size (`budgets`), less 1 MiB


# The rates the runs plan at, stated so that a plan is the same on every run: the estimate's CPU
# defaults (measured rates are tested on their own, below).
RATES = {"fsdp_activation_budget_compute_tflops": 0.05, "fsdp_activation_budget_copy_gb_per_s": 5}
# The tight budget's runs copy at a tenth of that: copies then cost more than recomputing a layer,
# and the plan mixes checkpointing with offload (at 5 GB/s the offload alone meets any budget this
# model can: the layers' backward working set, counted since the probe runs backward, puts the
# smallest peak where checkpointing's recompute no longer lowers it).
SLOW_COPY_GB_PER_S = 0.5


def _config(budget: int | str | None, loader: bool = False, rates: bool = True, slow_copies: bool = False,
            device_memory: int | None = None, mixed: str = "no") -> dict[str, Any]:
    fsdp: dict[str, Any] = {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                            "fsdp_cpu_ram_efficient_loading": loader}
    if budget is not None:
        fsdp |= {"fsdp_activation_memory_budget": budget, **(RATES if rates else {})}
        if slow_copies:
            fsdp["fsdp_activation_budget_copy_gb_per_s"] = SLOW_COPY_GB_PER_S
        if device_memory is not None:
            fsdp["fsdp_activation_budget_device_memory"] = device_memory
    return {"distributed_type": "FSDP", "mixed_precision": mixed, "fsdp_config": fsdp}


def _train(rank: int, world: int, path: str, budget: int | str | None, loader: bool, no_cache: bool = False,
           slow_copies: bool = False, device_memory: int | None = None, lora: bool | str = False,
           dtype: torch.dtype = torch.float32, mixed: str = "no") -> dict[str, Any]:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg
    from fsdp_offload_cfg.budget import planned, planned_choices
    from fsdp_offload_cfg.offload import offload_stats

    fsdp_offload_cfg.patch(_config(budget, loader, slow_copies=slow_copies, device_memory=device_memory, mixed=mixed))
    accelerator = Accelerator()
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=dtype)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=LORA_RANK, target_modules="all-linear", use_dora=lora == "dora"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    before = planned_choices(model)
    losses, norms = [], []
    for step in range(3):
        ids = torch.randint(1, 97, (BATCH, SEQ), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(input_ids=ids, labels=ids, **({"use_cache": False} if no_cache else {})).loss
        accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1e9)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = {k: _digest(v) for k, v in accelerator.get_state_dict(model).items()}
    planner = planned(model)
    return {"losses": losses, "norms": norms, "state": state, "before": before, "choices": planned_choices(model),
            "moved": offload_stats()["offloaded_bytes"], "budget": planner.budget if planner else None,
            "room": planner.room if planner else None}


def _plan_for(path: str, budget: int, seq: int = SEQ, rates: tuple[float, float] | None = None,
              lora: bool | str = False) -> list[str]:
    """The estimate's plan for the same model, config, batch and device (what the run must follow),
    at the config's rates or at `rates` (FLOP/s, copy bytes/s); with `lora`, of the LoRA run (of
    the DoRA run with "dora")."""
    from fsdp_offload_cfg import load_config
    from fsdp_offload_cfg.estimate import Lora, estimate_memory

    config = load_config(_config(budget, rates=rates is None) | {"num_processes": 2})
    report = estimate_memory(config, path, seq_len=seq, batch_size=BATCH, device="cpu", dtype="float32",
                             lora=Lora(LORA_RANK, dora=lora == "dora") if lora else None,
                             **({"compute_flops": rates[0], "copy_bytes": rates[1]} if rates else {}))
    return [layer["choice"] for layer in report["plan"]["layers"]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from fsdp_offload_cfg.testing.models import save_llama

    """Wide enough (hidden 256) that at the CPU's assumed rates a layer's copies cost less than its
    recompute: the plans use every choice."""
    return save_llama(str(tmp_path_factory.mktemp("budget") / "llama"), num_hidden_layers=LAYERS, hidden_size=256,
                      intermediate_size=688, num_attention_heads=8, num_key_value_heads=4)


@pytest.fixture(scope="module")
def budgets(model_dir: str) -> dict[str, int]:
    """From the estimate of this model: halfway between its smallest and its plain peak (a mix),
    and just above its smallest (checkpointing and offload, at slow copies)."""
    from fsdp_offload_cfg import load_config
    from fsdp_offload_cfg.estimate import estimate_memory

    report = estimate_memory(load_config(_config(None) | {"num_processes": 2}), model_dir, seq_len=SEQ,
                             batch_size=BATCH, device="cpu", dtype="float32", activation_budget=10**12)
    peaks = [u["device_peak_bytes"] for u in report["plan"]["uniform"].values()]
    low, high = min(peaks), max(peaks)
    mix = (low + high) // 2
    # `auto`: a device that leaves the mix budget once the states, the gathered layers, the
    # float32 logits a loop may hold through backward and the margin are counted, by the
    # estimate's per-rank figures (the run measures its own)
    from transformers import AutoConfig

    logits = BATCH * SEQ * AutoConfig.from_pretrained(model_dir).vocab_size * 4
    states = sum(report["per_rank"][f"{kind}_bytes"] for kind in ("params", "grads", "optimizer", "buffers",
                                                                 "gathered_params")) + logits
    return {"mix": mix, "tight": low + 3 * (high - low) // 100, "plain": high,
            "auto_device": mix + states + AUTO_MARGIN, "auto_short_device": low // 2 + states + AUTO_MARGIN}


@pytest.fixture(scope="module")
def runs(model_dir: str, budgets: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
    cases = {"none": (None, False, False), "none_without_cache": (None, False, True), "mix": (budgets["mix"], False, False),
             "tight": (budgets["tight"], False, False), "tight_loader": (budgets["tight"], True, False),
             "auto": (AUTO, False, False)}
    return {name: run_workers(_train, 2, model_dir, budget, loader, no_cache, name.startswith("tight"),
                              budgets["auto_device"] if name == "auto" else None, timeout=400)
            for name, (budget, loader, no_cache) in cases.items()}


# A plan that checkpoints runs its training forwards without a KV cache, as transformers' own
# gradient checkpointing does (a recomputed layer would append to the cache twice); its reference
# is the same run without a budget and without the cache (on transformers 4.x the cache's mask
# path differs from the cacheless one in the last bits).
BASELINE = {"mix": "none", "tight": "none_without_cache", "tight_loader": "none_without_cache", "auto": "none"}


@pytest.mark.parametrize("case", ["mix", "tight", "tight_loader", "auto"])
def test_a_budget_trains_exactly_what_the_run_without_it_trains(runs: dict[str, Any], case: str):
    baseline = BASELINE[case]
    for rank in (0, 1):
        plain, ours = runs[baseline][rank], runs[case][rank]
        assert ours["losses"] == plain["losses"], (rank, ours["losses"], plain["losses"])
        assert ours["norms"] == plain["norms"], (rank, ours["norms"], plain["norms"])
    assert runs[case][0]["state"] == runs[baseline][0]["state"]  # gathered on rank 0


@pytest.mark.parametrize("case", ["mix", "tight", "tight_loader"])
def test_the_layers_run_the_estimates_plan_for_the_first_batch(runs: dict[str, Any], budgets: dict[str, int],
                                                               model_dir: str, case: str):
    slow = (RATES["fsdp_activation_budget_compute_tflops"] * 1e12, SLOW_COPY_GB_PER_S * 1e9)
    expected = _plan_for(model_dir, budgets[case.removesuffix("_loader")], rates=slow if case != "mix" else None)
    for rank in (0, 1):
        assert runs[case][rank]["before"] is None  # planned at the first forward, not at prepare
        assert runs[case][rank]["choices"] == expected
    if case == "mix":  # halfway: some layers offloaded, the others kept
        assert {"offload", "keep"} <= set(expected), expected
    else:  # nearly the smallest, copies slow: checkpointing, and offload on top of it
        assert any(c.startswith("checkpoint") for c in expected), expected
        assert any(c.endswith("offload") for c in expected), expected
    if any(c.endswith("offload") for c in expected):
        assert all(runs[case][rank]["moved"] > 0 for rank in (0, 1))
    assert runs["none"][0]["choices"] is None and runs["none"][0]["moved"] == 0


@pytest.fixture(scope="module")
def lora_runs(model_dir: str) -> dict[str, Any]:
    """A LoRA run (PEFT on every linear layer) with a budget for which the LoRA estimate plans a
    mix that the full fine-tune's estimate does not (the LoRA saves less: here each adapter's
    frozen base saves no input for its weight's gradient), and the same run without a budget."""
    from fsdp_offload_cfg import load_config
    from fsdp_offload_cfg._sizes import parse_auto
    from fsdp_offload_cfg.estimate import Lora, estimate_memory

    report = estimate_memory(load_config(_config(None) | {"num_processes": 2}), model_dir, seq_len=SEQ,
                             batch_size=BATCH, device="cpu", dtype="float32", activation_budget=10**12,
                             lora=Lora(LORA_RANK))
    peaks = [u["device_peak_bytes"] for u in report["plan"]["uniform"].values()]
    low, high = min(peaks), max(peaks)
    candidates = [low + (high - low) * i // 24 for i in range(1, 24)]
    budget = next(b for b in candidates if _plan_for(model_dir, b, lora=True) != _plan_for(model_dir, b)
                  and {"offload", "keep"} <= set(_plan_for(model_dir, b, lora=True)))
    runs = {name: run_workers(_train, 2, model_dir, b, False, False, False, None, True, timeout=400)
            for name, b in (("none", None), ("mix", budget))}
    # `auto` over a bf16 base, the adapters in float32 (PEFT's), without and with mixed precision:
    # a device that leaves the plain peak
    devices = {}
    for mixed in ("no", "bf16"):
        auto = estimate_memory(load_config(_config(None, mixed=mixed) | {"num_processes": 2}), model_dir, seq_len=SEQ,
                               batch_size=BATCH, device="cpu", dtype="bfloat16", activation_budget=parse_auto(AUTO),
                               device_memory=2**40, lora=Lora(LORA_RANK))
        room = auto["plan"]["room"]
        devices[mixed] = room["taken_bytes"] + room["to_come_bytes"] + AUTO_MARGIN + max(
            u["device_peak_bytes"] for u in auto["plan"]["uniform"].values())
        runs[f"auto_{mixed}"] = run_workers(_train, 2, model_dir, AUTO, False, False, False, devices[mixed], True,
                                            torch.bfloat16, mixed, timeout=400)
    return {"budget": budget, "auto_devices": devices, **runs}


def test_a_lora_run_plans_what_its_adapters_save_and_trains_exactly(lora_runs: dict[str, Any], model_dir: str):
    """The run's meta twin carries the run's PEFT adapters, so a LoRA run's budget plans what it
    saves (the estimate's `--lora-rank` plan), not what a full fine-tune of the model would save
    (a plan for more activations than there are: more layers offloaded or recomputed than needed);
    and it trains bit for bit what the LoRA run without a budget trains."""
    expected = _plan_for(model_dir, lora_runs["budget"], lora=True)  # differs from the full fine-tune's (fixture)
    for rank in (0, 1):
        assert lora_runs["mix"][rank]["choices"] == expected
        plain, ours = lora_runs["none"][rank], lora_runs["mix"][rank]
        assert ours["losses"] == plain["losses"] and ours["norms"] == plain["norms"], rank
    assert lora_runs["mix"][0]["state"] == lora_runs["none"][0]["state"]


def test_a_dora_run_plans_what_its_adapters_save_and_trains_exactly(model_dir: str):
    """DoRA's adapters save more than LoRA's (each adapted layer its base output and its adapter's
    output, which the learned magnitude scales): the run's meta twin carries them, so the run
    plans the estimate's DoRA plan (`Lora(dora=True)`, `--lora-dora`), where the twin was once the
    full fine-tune's; and, with meta loading, it trains bit for bit what the DoRA run without a
    budget and without the loader trains. (With the loader, a budget stopped the run at prepare:
    the magnitudes each rank computes after the load were named with the layers' checkpoint
    wrappers in them, and wanted from rank 0, where they are on meta.)"""
    from fsdp_offload_cfg import load_config
    from fsdp_offload_cfg.estimate import Lora, estimate_memory

    report = estimate_memory(load_config(_config(None) | {"num_processes": 2}), model_dir, seq_len=SEQ,
                             batch_size=BATCH, device="cpu", dtype="float32", activation_budget=10**12,
                             lora=Lora(LORA_RANK, dora=True))
    peaks = [u["device_peak_bytes"] for u in report["plan"]["uniform"].values()]
    low, high = min(peaks), max(peaks)
    budget = next(b for b in (low + (high - low) * i // 24 for i in range(1, 24))
                  if _plan_for(model_dir, b, lora="dora") not in (_plan_for(model_dir, b, lora=True), _plan_for(model_dir, b))
                  and {"offload", "keep"} <= set(_plan_for(model_dir, b, lora="dora")))
    plain, mix = (run_workers(_train, 2, model_dir, b, loader, False, False, None, "dora", timeout=400)
                  for b, loader in ((None, False), (budget, True)))
    for rank in (0, 1):
        assert mix[rank]["choices"] == _plan_for(model_dir, budget, lora="dora"), rank
        assert (mix[rank]["losses"], mix[rank]["norms"]) == (plain[rank]["losses"], plain[rank]["norms"]), rank
    assert mix[0]["state"] == plain[0]["state"]


@pytest.mark.parametrize("mixed", ["no", "bf16"])
def test_auto_in_a_lora_run_counts_the_adapters_states_to_come_as_the_estimate_does(lora_runs: dict[str, Any],
                                                                                   model_dir: str, mixed: str):
    """`auto` in a LoRA run over a bf16 base: what is to come is the float32 adapters' gradients
    and AdamW state (not a full fine-tune's, and not at the frozen base's dtype, which a LoRA's
    first parameter has under mixed precision) and the gathered layers (the adapters gathered in
    float32 without mixed precision), so the run's budget is the `--lora-rank` estimate's for the
    same device, to the byte."""
    from fsdp_offload_cfg import load_config
    from fsdp_offload_cfg._sizes import parse_auto
    from fsdp_offload_cfg.estimate import Lora, estimate_memory

    report = estimate_memory(load_config(_config(None, mixed=mixed) | {"num_processes": 2}), model_dir, seq_len=SEQ,
                             batch_size=BATCH, device="cpu", dtype="bfloat16", activation_budget=parse_auto(AUTO),
                             device_memory=lora_runs["auto_devices"][mixed], lora=Lora(LORA_RANK))
    for rank in (0, 1):
        run = lora_runs[f"auto_{mixed}"][rank]
        assert run["budget"] == report["plan"]["budget_bytes"], (rank, run["room"], report["plan"]["room"])


def test_auto_plans_the_room_a_stated_device_leaves_as_the_estimate_does(runs: dict[str, Any],
                                                                         budgets: dict[str, int], model_dir: str):
    """The device stated as the mix budget plus the estimate's states and margin: what each rank
    measures it holds (its shards and buffers) is what the estimate counts, so the run's budget is
    the mix budget, its layers run the estimate's plan for it, and the offline estimate with
    `--activation-budget auto --device-memory` plans the same."""
    from fsdp_offload_cfg import load_config
    from fsdp_offload_cfg._sizes import parse_auto
    from fsdp_offload_cfg.estimate import estimate_memory

    expected = _plan_for(model_dir, budgets["mix"])
    assert expected != ["keep"] * LAYERS and budgets["mix"] < budgets["plain"]  # the run without a budget exceeds it
    for rank in (0, 1):
        assert runs["auto"][rank]["budget"] == budgets["mix"]
        assert runs["auto"][rank]["choices"] == expected
    report = estimate_memory(load_config(_config(None) | {"num_processes": 2}), model_dir, seq_len=SEQ,
                             batch_size=BATCH, device="cpu", dtype="float32", activation_budget=parse_auto(AUTO),
                             device_memory=budgets["auto_device"])
    assert report["plan"]["budget_bytes"] == budgets["mix"]
    assert [layer["choice"] for layer in report["plan"]["layers"]] == expected
    assert report["plan"]["room"]["margin_bytes"] == AUTO_MARGIN


def _plain_torch(rank: int, world: int, path: str, budget: int | None) -> dict[str, Any]:
    """torchrun's kind of script: `fully_shard` by hand, no accelerate, the budget from code."""
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg
    from fsdp_offload_cfg.budget import planned_choices

    torch.manual_seed(5)
    model = shard_by_layer(AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa"))
    planner = None
    if budget is not None:
        planner = fsdp_offload_cfg.enable_activation_budget(
            model, budget, compute_tflops=RATES["fsdp_activation_budget_compute_tflops"],
            copy_gb_per_s=SLOW_COPY_GB_PER_S)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, choices = [], []
    for step in range(3):
        if step == 2 and planner is not None:
            planner.remove()  # the last step runs as the plain run does
        ids = torch.randint(1, 97, (BATCH, SEQ), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        choices.append(planned_choices(model))
    return {"losses": losses, "choices": choices}


def test_a_plain_torch_fsdp2_script_plans_from_code_and_trains_exactly(model_dir: str, budgets: dict[str, int]):
    """`enable_activation_budget` after `fully_shard`: the layers run the estimate's plan (here
    checkpointing with offload), the losses are the same run's without it, and `remove()` leaves
    the model as it was."""
    ours = run_workers(_plain_torch, 2, model_dir, budgets["tight"], timeout=300)
    plain = run_workers(_plain_torch, 2, model_dir, None, timeout=300)
    expected = _plan_for(model_dir, budgets["tight"],
                         rates=(RATES["fsdp_activation_budget_compute_tflops"] * 1e12, SLOW_COPY_GB_PER_S * 1e9))
    assert any(c.startswith("checkpoint") for c in expected) and any(c.endswith("offload") for c in expected)
    for rank in (0, 1):
        assert ours[rank]["losses"] == plain[rank]["losses"], (rank, ours[rank]["losses"], plain[rank]["losses"])
        assert ours[rank]["choices"] == [expected, expected, None], ours[rank]["choices"]


def _fused_head_profile(rank: int, world: int, path: str, fused: bool) -> dict[str, Any]:
    """A step of a budgeted run whose model TRL patched with its fused LM head (as its trainers
    do), or not; what the plan measured at the head."""
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg
    from fsdp_offload_cfg.budget import planned

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    if fused:
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)
    model = shard_by_layer(model)
    fsdp_offload_cfg.enable_activation_budget(model, 10**9, compute_tflops=0.05, copy_gb_per_s=5)
    ids = torch.randint(1, 97, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    out = model(input_ids=ids, labels=ids, use_cache=False, **({"fused_lm_head": True} if fused else {}))
    (-out.log_probs.sum() if fused else out.loss).backward()
    profile = planned(model).profiled[1]
    return {"head_backward": profile.head_backward_bytes(), "after_last": profile.bytes_per_group()[-1]}


def test_a_budget_plans_trls_fused_lm_head_where_trl_patched_it(model_dir: str):
    """TRL's trainers patch the model with a fused LM head before training (`add_fused_lm_head`):
    no logits, a float32 sum of the output layer's gradient and a 4096 x 32768 tile in its
    backward. The plan, made at the first step, measures that head where the model has it
    (`estimate/heads.py`) and the cross-entropy's where not. Before, always the cross-entropy's."""
    pytest.importorskip("trl.trainer.utils", reason="TRL's fused LM head needs trl").add_fused_lm_head  # noqa: B018
    fused = run_workers(_fused_head_profile, 2, model_dir, True, timeout=300)[0]
    own = run_workers(_fused_head_profile, 2, model_dir, False, timeout=300)[0]
    tile = min(BATCH * (SEQ - 1), 4096) * 32768 * 4  # float32: this run has no mixed precision
    assert fused["head_backward"] >= tile > own["head_backward"], (fused, own)
    assert fused["after_last"] < own["after_last"], (fused, own)  # the labelled states, not the logits


def test_fsdp1_is_refused_saying_why():
    """FSDP1 wraps only on an accelerator; the refusal reads the module's class, so an FSDP1 unit
    is made here without its init (which needs one)."""
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel

    import fsdp_offload_cfg

    unit = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(unit)
    with pytest.raises(fsdp_offload_cfg.ConfigError) as error:
        fsdp_offload_cfg.enable_activation_budget(nn.Sequential(unit, nn.Linear(2, 2)), "1GiB")
    assert str(error.value).startswith("enable_activation_budget(): this model is wrapped by FSDP1 "
                                       "(FullyShardedDataParallel)"), error.value
    assert "fully_shard" in str(error.value)


def test_a_bad_budget_from_code_names_the_call_and_the_key():
    from torch import nn

    import fsdp_offload_cfg

    with pytest.raises(fsdp_offload_cfg.ConfigError, match=r"enable_activation_budget\(\): fsdp_config\."
                                                           r"activation_memory_budget: expected"):
        fsdp_offload_cfg.enable_activation_budget(nn.Linear(2, 2), "lots")


def _fail(rank: int, world: int, path: str, case: str, budget: int | str, device_memory: int | None = None
          ) -> dict[str, Any]:
    """One way to fail (or to plan) per case; returns what each rank saw (an error is returned, not raised)."""
    import logging

    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg
    import fsdp_offload_cfg.budget
    import fsdp_offload_cfg.estimate.rates

    config = _config(budget, rates=case not in ("measured", "measure_fails"), device_memory=device_memory)
    if case == "one_rate":  # the compute rate stated, the copy rate measured
        del config["fsdp_config"]["fsdp_activation_budget_copy_gb_per_s"]
    fsdp_offload_cfg.patch(config)
    if case == "rank1_fails" and rank == 1:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise OSError("no space left on device")

        fsdp_offload_cfg.budget.profile_layers = broken
    if case in ("measured", "one_rate"):  # each rate's slowest rank differs: every rank must plan at
        # (1e9, 1e8). Stated, not probed: a probe on a loaded machine (12 test workers on a GPU box's
        # 16 cores) measured 0.5 GFLOP/s, which would make rank 0 the slower one and the plan another
        fsdp_offload_cfg.estimate.rates.measure_rates = lambda *args: ((1e9, 4e8), (4e9, 1e8))[rank]
    if case == "measure_fails" and rank == 0:
        def no_pinned_memory(*args: Any) -> Any:
            raise RuntimeError("cannot pin memory")

        fsdp_offload_cfg.estimate.rates.measure_rates = no_pinned_memory
    records = MessageLog("fsdp_offload_cfg.budget", logging.NOTSET)
    accelerator = Accelerator()
    if case == "classifier":  # a head whose labels are not token ids (TRL's reward models)
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=3, pad_token_id=0)
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
    if case == "gradient_checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
        for seq in (SEQ, 2 * SEQ, 3 * SEQ) if case in ("longer_batches", "too_small") else (SEQ,):
            ids = torch.randint(1, 97, (BATCH, seq))
            labels = ids[:, 0] % 3 if case == "classifier" else ids
            accelerator.backward(model(input_ids=ids, labels=labels).loss)
    except Exception as exc:  # noqa: BLE001 - what the rank saw is the result
        chained = exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__)
        return {"error": f"{type(exc).__name__}: {exc}", "records": records, "chained": chained}
    planner = fsdp_offload_cfg.budget.planned(model)
    return {"error": None, "records": records, "choices": fsdp_offload_cfg.budget.planned_choices(model),
            "rates": planner.rates if planner else None, "shape": planner.shape if planner else None,
            "budget": planner.budget if planner else None}


@pytest.fixture(scope="module")
def failures(model_dir: str, budgets: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
    budget = {"too_small": 1, "longer_batches": budgets["plain"], "measured": budgets["mix"], "one_rate": budgets["mix"],
              "auto_logged": AUTO, "auto_no_device": "auto", "auto_no_room": "auto-1%", "auto_short": AUTO}
    device = {"auto_logged": budgets["auto_device"], "auto_no_room": 4 * 2**20,
              "auto_short": budgets["auto_short_device"]}
    return {case: run_workers(_fail, 2, model_dir, case, budget.get(case, 10**9), device.get(case), timeout=120,
                              pg_timeout=60)
            for case in ("too_small", "rank1_fails", "gradient_checkpointing", "longer_batches", "classifier",
                         "measured", "measure_fails", "one_rate", "auto_logged", "auto_no_device", "auto_no_room",
                         "auto_short")}


def test_auto_says_on_rank_0_how_the_budget_was_worked_out(failures: dict[str, Any], budgets: dict[str, int]):
    for rank in (0, 1):
        assert failures["auto_logged"][rank]["error"] is None, failures["auto_logged"][rank]["error"]
        assert failures["auto_logged"][rank]["budget"] == budgets["mix"]
    (line,) = [r for r in failures["auto_logged"][0]["records"] if "tokens per rank:" in r]
    assert line.startswith("activation_memory_budget auto (device "), line
    assert "(gradients, AdamW state, gathered layers, the output), margin 1.0 MiB; the tightest rank's): " in line, line
    assert ": layers 0-" in line and "layer time +" in line, line  # the plan and its expected cost
    assert not failures["auto_logged"][1]["records"]


def test_auto_on_a_device_with_no_size_to_read_stops_every_rank_naming_the_key(failures: dict[str, Any]):
    for rank in (0, 1):
        error = failures["auto_no_device"][rank]["error"]
        assert error is not None and error.startswith("ConfigError: <dict>: activation_memory_budget: auto reads "
                                                      "the device's memory from CUDA"), error
        assert "activation_budget_device_memory" in error and not failures["auto_no_device"][rank]["chained"]


def test_auto_with_no_room_left_stops_every_rank_with_the_figures(failures: dict[str, Any]):
    for rank in (0, 1):
        error = failures["auto_no_room"][rank]["error"]
        assert error is not None and error.startswith("ConfigError: <dict>: activation_memory_budget: auto: nothing "
                                                      "is left for activations (device 4.0 MiB, taken "), error
        assert "use more ranks" in error and not failures["auto_no_room"][rank]["chained"], error


def test_auto_that_no_plan_fits_stops_every_rank_with_the_room_and_how_far_short(failures: dict[str, Any]):
    """Room left, but less than any plan needs: said with the room's figures, not "raise the
    budget" (a number an `auto` user never wrote)."""
    for rank in (0, 1):
        error = failures["auto_short"][rank]["error"]
        assert error is not None and "activation_memory_budget: at 2 x 48 tokens per rank, auto: device " in error, error
        assert "that leaves " in error and "more; use more ranks" in error and "Raise the budget" not in error, error


def test_a_budget_no_plan_meets_stops_every_rank_naming_the_key_and_the_smallest(failures: dict[str, Any]):
    for rank in (0, 1):
        error = failures["too_small"][rank]["error"]
        assert error is not None and "activation_memory_budget: at 2 x 48 tokens per rank" in error, error
        assert "no plan fits; the smallest activation peak on the device a plan reaches is" in error
        # the user's to fix: a ConfigError with no chain, which a launch prints as one message per
        # rank (it was a RuntimeError chained to the ConfigError and the EstimateError: ~60 lines)
        assert error.startswith("ConfigError: ") and not failures["too_small"][rank]["chained"], error
        assert "budget 1 B:" in error, error  # in a unit that shows it (it read "0.0 MiB")


def test_a_rank_failing_to_plan_stops_every_rank_naming_it(failures: dict[str, Any]):
    for rank in (0, 1):
        error = failures["rank1_fails"][rank]["error"]
        assert error is not None and "planning activation_memory_budget failed on rank 1: OSError: no space" in error


def test_transformers_gradient_checkpointing_is_refused_at_prepare(failures: dict[str, Any]):
    for rank in (0, 1):
        error = failures["gradient_checkpointing"][rank]["error"]
        assert error is not None and error.startswith("ConfigError: <dict>: activation_memory_budget decides which "
                                                      "layers to checkpoint"), error


def test_a_larger_batch_than_any_before_is_planned_again(failures: dict[str, Any], model_dir: str,
                                                         budgets: dict[str, int]):
    """The budget is the plain peak at 2 x 48 tokens: all kept there; at 2 x 96 and 2 x 144 the
    layers must save less, and follow the estimate's plan at the longest batch."""
    longest = _plan_for(model_dir, budgets["plain"], seq=3 * SEQ)
    assert longest != ["keep"] * LAYERS, longest
    for rank in (0, 1):
        result = failures["longer_batches"][rank]
        assert result["error"] is None, result["error"]
        assert result["choices"] == longest and result["shape"] == (BATCH, 3 * SEQ)
    records = failures["longer_batches"][0]["records"]
    plans = [r for r in records if "activation_memory_budget" in r and "tokens per rank:" in r]
    assert [r.split(" tokens per rank")[0].rpartition(" at ")[2] for r in plans] == ["2 x 48", "2 x 96", "2 x 144"]
    assert plans[0].startswith("activation_memory_budget ") and ": layers 0-3: keep;" in plans[0]
    assert all(r.startswith("planned again, for a larger batch: activation_memory_budget") for r in plans[1:])
    assert "(estimated at 0.05 TFLOP/s and copies at 5 GB/s, from the config)" in plans[0]
    assert not failures["longer_batches"][1]["records"]  # rank 0 says it


def test_the_rates_are_measured_and_every_rank_plans_at_the_slowest(failures: dict[str, Any], model_dir: str,
                                                                    budgets: dict[str, int]):
    """Without rates in the config, each rank measures its device; rank 0 here computes slower and
    rank 1 copies slower, and both ranks plan at each rate's slowest, so their plans agree (the
    estimate's plan at those rates). The probe itself: test_the_probe_measures_positive_rates_on_this_device."""
    expected = _plan_for(model_dir, budgets["mix"], rates=(1e9, 1e8))
    for rank in (0, 1):
        result = failures["measured"][rank]
        assert result["error"] is None, result["error"]
        assert result["rates"] == (1e9, 1e8) and result["choices"] == expected
    (line,) = [r for r in failures["measured"][0]["records"] if "tokens per rank:" in r]
    assert "(estimated at 0.001 TFLOP/s and copies at 0.1 GB/s, measured on the device, the slowest rank's)" in line
    for rank in (0, 1):  # a rank whose probe fails stops every rank, naming it
        error = failures["measure_fails"][rank]["error"]
        assert error is not None and "measuring the device for activation_memory_budget failed on rank 0: " \
            "RuntimeError: cannot pin memory" in error, error


def test_a_rate_stated_in_the_config_is_used_and_the_other_measured(failures: dict[str, Any], model_dir: str,
                                                                    budgets: dict[str, int]):
    """Only the compute rate in the config: the copy rate is measured (the slowest rank's), and the
    log line says which rate came from where."""
    expected = _plan_for(model_dir, budgets["mix"], rates=(5e10, 1e8))
    for rank in (0, 1):
        result = failures["one_rate"][rank]
        assert result["error"] is None, result["error"]
        assert result["rates"] == (5e10, 1e8) and result["choices"] == expected
    (line,) = [r for r in failures["one_rate"][0]["records"] if "tokens per rank:" in r]
    assert ("(estimated at 0.05 TFLOP/s and copies at 0.1 GB/s, compute from the config, copies measured on the "
            "device, the slowest rank's)") in line, line


def test_the_probe_measures_positive_rates_on_this_device():
    from fsdp_offload_cfg.estimate.rates import measure_rates

    flops, copy = measure_rates(torch.device("cpu"), torch.float32, 64, 32)
    assert 0 < flops < float("inf") and 0 < copy < float("inf")


def test_a_wrapper_passing_through_computes_what_the_layer_computes():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from fsdp_offload_cfg.budget import batch_shape, set_checkpointing

    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    wrapper = checkpoint_wrapper(layer)
    x = torch.randn(4, 8, requires_grad=True)
    saved: list[int] = []
    for on in (False, True, False):
        set_checkpointing(wrapper, on)
        # torch < 2.13's checkpoint also saves an empty placeholder beside the input: count real data
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (t.numel() and saved.append(t.numel())) or t,
                                                      lambda t: t):
            out = wrapper(x)
        assert torch.equal(out, layer(x))
        assert (saved == [32]) is on  # checkpointed: only the input is saved; through: every activation
        saved.clear()
    assert batch_shape((), {"input_ids": torch.zeros(3, 7)}) == (3, 7)
    assert batch_shape((torch.zeros(2, 5),), {}) == (2, 5)
    assert batch_shape((), {"inputs_embeds": torch.zeros(1, 9, 4)}) == (1, 9)
    assert batch_shape((), {}) is None


def test_a_classifier_is_planned_without_token_labels(failures: dict[str, Any]):
    for rank in (0, 1):
        result = failures["classifier"][rank]
        assert result["error"] is None and result["choices"] == ["keep"] * LAYERS, result


def test_layers_are_wrapped_once_and_pass_through_until_planned():
    """Before sharding each decoder layer gets one checkpoint wrapper, passing through; a layer the
    script wrapped by hand is taken over, not wrapped twice (its checkpointing left always on)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
    from transformers import LlamaForCausalLM

    from fsdp_offload_cfg import load_config
    from fsdp_offload_cfg.budget import _call, wrap_layers
    from fsdp_offload_cfg.testing.models import llama_config

    model = LlamaForCausalLM(llama_config(num_hidden_layers=3))
    model.model.layers[1] = checkpoint_wrapper(model.model.layers[1])
    wrap_layers(model, load_config(_config(10**9)))
    for layer in model.model.layers:
        assert isinstance(layer, CheckpointWrapper) and not isinstance(layer._checkpoint_wrapped_module,
                                                                       CheckpointWrapper)
        assert layer.checkpoint_fn is _call


def test_remove_unwraps_the_budgets_wrappers_and_gives_the_scripts_its_checkpointing_back():
    """`remove()` undoes the budget: the layers it wrapped are back in their parents' places, and a
    layer the script wrapped by hand keeps its wrapper and checkpoints again, as before."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from fsdp_offload_cfg import load_config, model_state
    from fsdp_offload_cfg.budget import _call, enable_budget, wrap_layers
    from fsdp_offload_cfg.testing.models import llama_config

    model = LlamaForCausalLM(llama_config(num_hidden_layers=3))
    by_hand = checkpoint_wrapper(model.model.layers[1])
    own_fn = by_hand.checkpoint_fn
    model.model.layers[1] = by_hand
    config = load_config(_config(10**9))
    wrap_layers(model, config)
    planner = enable_budget(model, config)
    assert all(layer.checkpoint_fn is _call for layer in model.model.layers)
    planner.remove()
    planner.remove()  # idempotent
    layers = list(model.model.layers)
    assert isinstance(layers[0], LlamaDecoderLayer) and isinstance(layers[2], LlamaDecoderLayer)
    assert layers[1] is by_hand and isinstance(by_hand, CheckpointWrapper) and by_hand.checkpoint_fn is own_fn
    assert [n for n, m in model.named_modules() if model_state.ATTR in m.__dict__] == []


def test_a_plan_that_offloads_under_a_model_compiled_whole_stops_at_the_next_forward():
    """A model compiled whole bypasses the offload's hooks (one graph has no layer boundary), so
    the layers a plan offloads would keep their activations: the next training forward stops,
    naming the fix. Eagerly (as under a per-layer compile, where the root stays eager) the same
    plan runs, and moves bytes."""
    from transformers import LlamaForCausalLM

    from fsdp_offload_cfg import load_config
    from fsdp_offload_cfg.budget import enable_budget, planned_choices, wrap_layers
    from fsdp_offload_cfg.config import ConfigError
    from fsdp_offload_cfg.offload import offload_stats, reset_offload_stats
    from fsdp_offload_cfg.testing.models import llama_config

    ids = torch.randint(0, 90, (2, 64), generator=torch.Generator().manual_seed(1))
    for whole in (True, False):
        torch._dynamo.reset()
        model = LlamaForCausalLM(llama_config(num_hidden_layers=4, hidden_size=128, intermediate_size=256))
        config = load_config(_config(3_000_000))  # at 2 x 64 tokens: layers 1-2 offloaded, 0 and 3 kept
        wrap_layers(model, config)
        enable_budget(model, config)
        if whole:  # dynamo decides what a whole-model graph bypasses; inductor's code generation adds 40 s here
            model.compile(backend="aot_eager")
        reset_offload_stats()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        assert planned_choices(model) == ["keep", "offload", "offload", "keep"]
        if whole:
            with pytest.raises(ConfigError, match="the plan offloads layers, and the model is compiled whole"):
                model(input_ids=ids, labels=ids, use_cache=False)
        else:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            assert offload_stats()["offloaded_bytes"] > 0
        torch._dynamo.reset()


@pytest.mark.slow
def test_a_plan_that_checkpoints_under_a_per_layer_compile_is_exact():
    """Regional compilation (each layer's wrapper compiled, as accelerate's
    `use_regional_compilation` does) with a plan that checkpoints and offloads: gradients to the
    bit those of the same compiled model without a budget, its layers checkpointed where the plan
    checkpoints them (stock `checkpoint_wrapper`). On transformers up to 5.24 that equals the model
    with no layer checkpointed; 5.25's kernels wrapper breaks a checkpointed compiled layer's graph
    (`test_offload.py::test_compiled_llama_grads_are_bit_identical`), which moves its gradients
    by rounding, stock alike."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from transformers import LlamaForCausalLM

    from fsdp_offload_cfg import load_config
    from fsdp_offload_cfg.budget import enable_budget, planned_choices, wrap_layers
    from fsdp_offload_cfg.offload import offload_stats, reset_offload_stats
    from fsdp_offload_cfg.testing.models import llama_config

    ids = torch.randint(0, 90, (2, 64), generator=torch.Generator().manual_seed(1))

    def grads(budget: int | None, checkpointed: list[bool]) -> tuple[list[torch.Tensor], list[str] | None]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config(num_hidden_layers=4, hidden_size=128, intermediate_size=256))
        if budget is not None:
            config = load_config(_config(budget, slow_copies=True))
            wrap_layers(model, config)
            enable_budget(model, config)
        for i, wrap in enumerate(checkpointed):
            if wrap:
                model.model.layers[i] = checkpoint_wrapper(model.model.layers[i])
        for layer in model.model.layers:
            layer.compile()
        reset_offload_stats()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return [p.grad for p in model.parameters()], planned_choices(model) if budget else None

    # between the smallest peak (1.50 MB, offload alone) and checkpointing's (1.72 MB)
    got, choices = grads(1_700_000, [])
    assert choices is not None and any(c.startswith("checkpoint") for c in choices), choices
    assert offload_stats()["offloaded_bytes"] > 0
    expected, _ = grads(None, [c.startswith("checkpoint") for c in choices])
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    torch._dynamo.reset()
