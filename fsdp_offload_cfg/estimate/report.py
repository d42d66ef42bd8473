"""Assemble the estimate into its JSON document, and print it as a table.

The JSON keys are a stable interface (documented in `docs/estimate.md`): scripts that size jobs
read them. Every byte count is an integer and every key ending in `_bytes` is bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fsdp_offload_cfg._sizes import DEFAULT_MARGIN_FRACTION, AutoBudget, show_size
from fsdp_offload_cfg.config import FSDPOffloadConfig
from fsdp_offload_cfg.config.derived import mixed_compute_dtype, stated_rates
from fsdp_offload_cfg.estimate.activations import Residency, settings
from fsdp_offload_cfg.estimate.adapters import Lora, gathered_in, saved_module_names, with_lora
from fsdp_offload_cfg.estimate.heads import HEAD_WORDS, ChunkedDistillation, FusedLogProbs, Head
from fsdp_offload_cfg.estimate.inputs import Dtypes, EstimateError, resolve_dtypes
from fsdp_offload_cfg.estimate.loading import STRATEGIES, LoadingInputs, peak
from fsdp_offload_cfg.estimate.model import (
    ExampleImage,
    ModelBytes,
    ModelSource,
    build_on_meta,
    example_batch,
    example_image,
    layer_class_names,
    read_model,
    sequence_classifier_bytes,
    whole_model_bytes,
)
from fsdp_offload_cfg.estimate.plan import (
    BudgetUnreachable,
    Plan,
    default_time_model,
    layer_runs,
    plan_to_budget,
    uniform_plans,
)
from fsdp_offload_cfg.estimate.probe import ActivationProfile, measure_activations
from fsdp_offload_cfg.estimate.room import Room, offline_room
from fsdp_offload_cfg.estimate.states import ShardedStates, sharded_states, units_stay_gathered
from fsdp_offload_cfg.layer_classes import listed_but_absent, transformers_model
from fsdp_offload_cfg.loading.prepare import DEFAULT_BUCKET_BYTES


def build_report(config: FSDPOffloadConfig, model_path: str, *, ranks: int, replicas: int = 1, seq_len: int,
                 batch_size: int, optimizer: str, device: str, dtype: str | None,
                 activation_budget: int | AutoBudget | None = None, the_run_plans_it: bool = False,
                 device_memory: int | None = None, rates: tuple[float | None, float | None] = (None, None),
                 accumulating: bool = False, lora: Lora | None = None, reference: bool = False,
                 reward_models: tuple[str, ...] = (), teacher: tuple[str, str | None] | None = None,
                 companions_sharded: bool = False, loss_head: str = "cross_entropy",
                 completion_tokens: int | None = None, colocated_share: float | None = None,
                 machines: int = 1) -> dict[str, Any]:
    """The report `estimate_memory` returns. `activation_budget` is the one to plan (the command
    line's, else the config's: `the_run_plans_it`, and the plan is then the run's setting); under
    `auto`, `device_memory` is the size `inputs.auto_device_bytes` resolved. `lora`: adapters
    trained over a frozen base (`estimate/adapters.py`). `reference`: a frozen copy of the model
    sharded beside it (TRL's reference model). `reward_models`: the paths of reward models held
    whole on every rank (`reward_model_bytes`); `teacher`: a distillation teacher's path and load
    dtype (None: its checkpoint's), whole on every rank likewise; `companions_sharded`: both
    sharded beside the model instead (ms-swift's); `loss_head`, `completion_tokens`: what the
    loss goes through and the positions it scores (`estimate_memory`, `heads.py`);
    `colocated_share`: the device's fraction a colocated engine holds, taken in `auto`'s room;
    `machines`: the machines the ranks run on (`per_machine`)."""
    source = read_model(model_path)
    dtypes = resolve_dtypes(config, source.config, dtype)
    model = build_on_meta(source, dtypes.compute, dtypes.load)
    if lora is not None:
        model = with_lora(model, lora)
    _check_layer_classes(model, list(config.transformer_layer_cls_to_wrap or ()), config.source)
    layers = layer_class_names(model, config.transformer_layer_cls_to_wrap, config.source)
    image = example_image(source.config, model)
    batch = example_batch(source, batch_size, seq_len, dtypes.compute, image)
    head = _trl_head(config, loss_head, teacher, completion_tokens, seq_len)
    with gathered_in(model, dtypes.compute if mixed_compute_dtype(config) else None):
        profile = _measure(model, batch, layers, device, head)
    states = sharded_states(model, layers, ranks, dtypes.storage, dtypes.compute, optimizer, profile.trained,
                            dtypes.frozen, units_stay_gathered(config), dtypes.load if reference else None)
    companions = _companions(config, dtype, reward_models, teacher, ranks if companions_sharded else 1)
    states = dataclasses.replace(states, reward=companions.reward.shard, teacher=companions.teacher.shard,
                                 companions_sharded=companions_sharded)
    step_transient = optimizer_step_transient(states, optimizer, device)
    at_peak = functools.partial(device_at_peak, config, states, profile=profile, step_transient=step_transient,
                                accumulating=accumulating)
    offload = config.activation_cpu_offload
    async_reload = offload.resolved_mode(device) == "async"
    by_setting = settings(profile, offload, async_reload)
    chosen = "plan" if the_run_plans_it else _setting_name(config)
    plan = room = None
    colocated = 0
    if isinstance(activation_budget, AutoBudget):
        colocated = int((colocated_share or 0) * device_memory)
        room = _room(config, states, activation_budget, device_memory, profile.output_bytes, colocated)
        activation_budget = room.budget_bytes
    if activation_budget is not None:
        given = (r if r is not None else c for r, c in zip(rates, stated_rates(config)))  # command line over file
        time_model = default_time_model(device, async_reload, *given)
        try:
            plan = plan_to_budget(profile, activation_budget, offload, async_reload, time_model)
        except BudgetUnreachable as error:
            if room is None:
                raise
            raise EstimateError(f"activation budget {room.unreachable(error.smallest_bytes)}") from None
        by_setting["plan"] = plan.residency
    report = {
        "ranks": ranks * replicas,  # `ranks` shard each tensor; `replicas` copies of each slice (HSDP)
        "replicas": replicas,
        "model": {"path": model_path, "class": type(transformers_model(model)).__name__, "parameters": states.param_count,
                  "groups": len(profile.groups), "layer_classes": layers, "lora": _lora(model, lora)},
        "inputs": {"seq_len": seq_len, "batch_size": batch_size, "optimizer": optimizer, "device": device,
                   "load_dtype": _name(dtypes.load), "storage_dtype": _name(dtypes.storage),
                   "compute_dtype": _name(dtypes.compute), "activation_setting": chosen,
                   "loss_head": head.key if head is not None else "cross_entropy"},
        "per_rank": _per_rank(config, states, by_setting, chosen, at_peak),
        "device_by_setting": {name: _with_peak(at_peak(residency)) for name, residency in by_setting.items()},
        "activations": _activations(profile, by_setting),
        "loading": _loading(config, source, states, dtypes, ranks, device,
                            others_whole=companions.reward.whole + companions.teacher.whole),
        "assumptions": _assumptions(config, source, dtypes, device, optimizer, batch, accumulating, profile, lora,
                                    image, head)
        + _head_advice(profile, by_setting, head) + _cap_said(offload.max_pinned_bytes, by_setting)
        + (_reference_said(dtypes) if reference else [])
        + (_companion_said("reward", ", ".join(reward_models), companions_sharded, "its no-grad forward scores "
                           "the completions before the training forward") if reward_models else [])
        + (_companion_said("teacher", teacher[0], companions_sharded, _teacher_forward_said(head))
           if teacher is not None else [])
        + _companions_loading_said(states)
        + ([f"auto: vLLM, colocated, holds {colocated_share:g} of the device ({show_size(colocated)}), counted as "
            "taken"] if room is not None and colocated else []),
    }
    if plan is not None:
        report["plan"] = _plan(plan, uniform_plans(profile, offload, async_reload, plan.time))
        if room is not None:
            report["plan"]["room"] = {"device_bytes": room.device_bytes, "taken_bytes": room.taken_bytes,
                                      "to_come_bytes": room.to_come_bytes, "margin_bytes": room.margin_bytes,
                                      "colocated_bytes": colocated}  # of taken: vLLM's, colocated
    if device_memory:
        report["device_fit"] = _device_fit(report["device_by_setting"], device_memory)
    report["per_machine"] = _per_machine(report, machines)
    return report


def _per_machine(report: dict[str, Any], machines: int) -> dict[str, Any]:
    """Rank 0's machine: its ranks' host memory together. A host runs out of memory for all the
    ranks it runs, each with a pinned pool of its own that lives the whole run (8 ranks of a
    16 GiB pool pin 128 GiB), which the figures per rank leave to the reader to multiply. The
    ranks split as evenly as the launcher splits them; each counted as rank 0 (its shards the
    largest: an upper bound where they are uneven)."""
    ranks = -(-report["ranks"] // max(machines, 1))
    loading = report["loading"]
    return {"machines": machines, "ranks": ranks, "host_bytes": ranks * report["per_rank"]["host_bytes"],
            "loading_host_peak_bytes": loading["rank0_host_peak_bytes"]
            + (ranks - 1) * loading["other_host_peak_bytes"]}


def _device_fit(by_setting: dict[str, dict[str, int]], device_bytes: int) -> dict[str, Any]:
    """Each setting's peak against a device of `device_bytes` with a tenth of it kept free, as
    `auto`'s default margin keeps: the peaks count what the step allocates, and a device fills up
    at what the allocator reserves, more than that (1.02-1.12x measured with expandable segments,
    which `patch()` turns on with the offload, 1.21-1.33x without: docs/benchmarks.md), besides
    the CUDA context's few hundred MiB."""
    margin = int(device_bytes * DEFAULT_MARGIN_FRACTION)
    left = {name: device_bytes - margin - setting["peak_device_bytes"] for name, setting in by_setting.items()}
    return {"device_bytes": device_bytes, "margin_bytes": margin,
            "by_setting": {name: {"fits": bytes_left >= 0, "left_bytes": bytes_left} for name, bytes_left in left.items()}}


def _plan(plan: Plan, uniform: dict[str, Plan]) -> dict[str, Any]:
    """The budget's plan: each layer's choice, its peak, and its estimated cost against each
    single setting's (the JSON `plan` key)."""
    def cost(p: Plan) -> float:
        return p.extra_seconds / p.compute_seconds if p.compute_seconds else 0.0

    return {
        "budget_bytes": plan.budget_bytes,
        "device_peak_bytes": plan.residency.device_peak_bytes,
        "host_bytes": plan.residency.host_bytes,
        "layers_seconds": plan.compute_seconds,
        "extra_seconds": plan.extra_seconds,
        "extra_time_fraction": cost(plan),
        "time_model": {"compute_tflops": plan.time.compute_flops / 1e12, "copy_gb_per_s": plan.time.copy_bytes / 1e9,
                       "copies_overlap_compute": plan.time.overlapped},
        "layers": [{"name": lp.name, "choice": lp.choice, "device_bytes": lp.device_bytes,
                    "host_bytes": lp.host_bytes, "extra_seconds": lp.extra_seconds} for lp in plan.layers],
        "uniform": {name: {"device_peak_bytes": p.residency.device_peak_bytes, "extra_time_fraction": cost(p),
                           "fits": p.residency.device_peak_bytes <= (plan.budget_bytes or 0)}
                    for name, p in uniform.items()},
    }


def _lora(model: torch.nn.Module, lora: Lora | None) -> dict[str, Any] | None:
    """The JSON `model.lora` key: the adapters asked for and the parameters they train."""
    if lora is None:
        return None
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    targets = lora.target_modules()
    if targets is None:  # PEFT's default for the model's type: the names it chose
        config = next(iter(getattr(model, "peft_config", {}).values()), None)
        targets = sorted(getattr(config, "target_modules", None) or [])
    return {"rank": lora.rank, "targets": targets, "dropout": lora.dropout, "dora": lora.dora,
            "modules_to_save": saved_module_names(model),
            "trainable_parameters": trainable}


def _room(config: FSDPOffloadConfig, states: ShardedStates, auto: AutoBudget, device_bytes: int,
          output_bytes: int, colocated_bytes: int) -> Room:
    """`auto`'s room on a device of `device_bytes`, `colocated_bytes` of it another engine's."""
    try:
        return offline_room(states, auto, device_bytes, resident=not config.offload_params, output_bytes=output_bytes,
                            colocated_bytes=colocated_bytes)
    except EstimateError as error:
        raise EstimateError(f"activation budget {error}") from None


def _with_peak(parts: dict[str, int]) -> dict[str, int]:
    return {f"{k}_bytes": v for k, v in parts.items()} | {"peak_device_bytes": sum(parts.values())}


def _check_layer_classes(model: torch.nn.Module, layers: list[str], source: str) -> None:
    """accelerate refuses a `transformer_layer_cls_to_wrap` the model does not have; so do we, as the run does."""
    refusal = listed_but_absent(model, layers, f"{source}: fsdp_transformer_layer_cls_to_wrap")
    if refusal:
        raise EstimateError(refusal)


def _measure(model: torch.nn.Module, batch: dict[str, torch.Tensor], layers: list[str],
             device: str, head: Head | None = None) -> ActivationProfile:
    try:
        return measure_activations(model, batch, layers, target=device, head=head)
    except Exception as exc:  # any failure of the user's model code, reported with its class
        raise EstimateError(f"{type(model).__name__}: one forward on the meta device failed, so the activations "
                            f"cannot be measured ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from exc


def _setting_name(config: FSDPOffloadConfig) -> str:
    ckpt, offload = config.activation_checkpointing, config.activation_cpu_offload.enabled
    return {(False, False): "plain", (True, False): "checkpointing", (False, True): "offload",
            (True, True): "checkpointing_and_offload"}[(ckpt, offload)]


def _per_rank(config: FSDPOffloadConfig, states: ShardedStates, by_setting: dict[str, Residency], chosen: str,
              at_peak: Callable[[Residency], dict[str, int]]) -> dict[str, int]:
    """Per-rank figures under the config's activation setting."""
    on_device = by_setting[chosen]
    offloadable = states.params + states.frozen_shards + states.grads + states.optimizer
    host = on_device.host_bytes + (offloadable if config.offload_params else 0)
    return {
        "params_bytes": states.params,
        "reference_params_bytes": states.reference,
        "reward_params_bytes": states.reward,
        "teacher_params_bytes": states.teacher,
        "grads_bytes": states.grads,
        "optimizer_bytes": states.optimizer,
        "buffers_bytes": states.buffers,
        "gathered_params_bytes": states.gathered_in_backward(),
        "activations_bytes": by_setting["plain"].saved_bytes,
        "activations_on_device_bytes": on_device.device_peak_bytes,
        "pinned_host_bytes": on_device.host_bytes,
        "host_bytes": host,
        "peak_device_bytes": sum(at_peak(on_device).values()),
    }


def optimizer_step_transient(states: ShardedStates, optimizer: str, device: str) -> int:
    """What the optimizer step allocates beside the states: torch's AdamW on CUDA steps every
    parameter at once (`foreach`, its default there) and holds one parameter-sized temporary (the
    second moment's square root); fused AdamW (the Trainer's default, `adamw_torch_fused`), AdamW
    on the CPU (one parameter at a time) and SGD hold next to nothing."""
    return states.grads if optimizer == "adamw" and device == "cuda" else 0


def device_at_peak(config: FSDPOffloadConfig, states: ShardedStates, residency: Residency,
                   profile: ActivationProfile, step_transient: int = 0, accumulating: bool = False) -> dict[str, int]:
    """What is on the device at the step's worst moment under one activation setting, by kind
    (they sum to `peak_device_bytes`). That moment is the worse of two (measured on an H200,
    docs/estimate.md: counting every gradient at the activations' peak overshot by 8-13%):

    - backward's: the resident states, the gathered units (current + prefetched, and one unit's
      gradients; kept gathered after forward, every unit backward has not yet passed), the
      activations at one moment of backward, the head's (which allocates the logits' gradient
      while everything saved is still there: `logits_grad`, what the head's backward holds
      beyond the saves, `ActivationProfile.head_backward_bytes`) or a group's, and
      the gradients of only the groups backward has finished by then: between steps they are
      None (`zero_grad`'s default), and they appear group by group as backward walks back (all
      of them when `accumulating`: micro-batches before this one left theirs). The moment is the
      worst of activations and gradients together: where the activations are small beside the
      gradients (short sequences, a MoE's experts), a late moment outweighs the activations' own
      peak. A layer's forward is such a moment too, without gradients unless `accumulating`
      (DoRA's weight-sized temporaries at short sequences);
    - the optimizer step's: every gradient, no activation, and the step's own transient.
    """
    resident = not config.offload_params
    groups = max(len(profile.groups), 1)

    def grads(done: int) -> int:
        return (states.grads if accumulating else states.grads * done // groups) if resident else 0

    def gathered(done: int) -> int:  # kept gathered after forward, the units backward has not yet passed
        return states.gathered_in_backward(left=1 - min(done, groups) / groups)

    # (activations, gradients, gathered, at the head's backward) at each moment: backward's, then
    # each group's forward, where gradients exist only when accumulating and the units gathered
    # are those up to it (as many as at that group's backward)
    candidates = [(now, grads(done), gathered(done), i == 0 and now > residency.forward_end_device_bytes)
                  for i, (now, done) in enumerate(residency.moments)]
    candidates += [(now, grads(0), gathered(len(residency.forward_moments) - 1 - i), False)
                   for i, now in enumerate(residency.forward_moments)]
    activations, gradients, gathered_now, at_head = max(candidates, key=lambda c: c[0] + c[1] + c[2])
    backward = {
        "params": (states.params + states.frozen_shards if resident else 0) + states.held_whole,
        "grads": gradients,
        "optimizer": states.optimizer if resident else 0,
        "buffers_and_gathered": states.buffers + gathered_now,
        "activations": residency.forward_end_device_bytes if at_head else activations,
        "logits_grad": activations - residency.forward_end_device_bytes if at_head else 0,
        "optimizer_step": 0,
    }
    step = {**dict.fromkeys(backward, 0), "params": backward["params"], "grads": states.grads if resident else 0,
            "optimizer": backward["optimizer"], "buffers_and_gathered": states.buffers,
            "optimizer_step": step_transient if resident else 0}
    return max(backward, step, key=lambda parts: sum(parts.values()))


def _activations(profile: ActivationProfile, by_setting: dict[str, Residency]) -> dict[str, Any]:
    per_group = profile.bytes_per_group()
    inside = profile.inside_bytes_per_group()
    extra = profile.backward_extra or [0] * len(per_group)
    return {
        "per_group": [{"name": name, "saved_bytes": per_group[i], "inside_bytes": inside[i],
                       "backward_extra_bytes": extra[i], "forward_flops": profile.flops[i],
                       "forward_peak_bytes": profile.forward_peak[i] if profile.forward_peak else 0}
                      for i, name in enumerate(profile.groups)],
        "after_last_group_bytes": per_group[-1],
        "head_backward_bytes": profile.head_backward_bytes(),
        "settings": {name: {"saved_bytes": r.saved_bytes, "device_peak_bytes": r.device_peak_bytes,
                            "host_bytes": r.host_bytes, "capped_bytes": r.capped_bytes}
                     for name, r in by_setting.items()},
    }


def _loading(config: FSDPOffloadConfig, source: ModelSource, states: ShardedStates, dtypes: Dtypes, ranks: int,
             device: str, others_whole: int) -> dict[str, Any]:
    checkpoint, converting = _checkpoint_bytes(source, states, dtypes)
    inputs = LoadingInputs(
        checkpoint_bytes=checkpoint,
        loaded_bytes=states.param_count * dtypes.load.itemsize + states.buffers,
        converting=converting,
        shard_bytes=states.params + states.buffers,
        shards_on_host=device == "cpu" or bool(config.offload_params),
        bucket_bytes=DEFAULT_BUCKET_BYTES,
        world=ranks,
        sliceable=_sliceable(source),
        reference_bytes=states.reference + states.buffers if states.reference else 0,
        others_whole_bytes=others_whole,
        others_kept_bytes=states.reward + states.teacher,
    )
    strategy = config.load_strategy if config.cpu_ram_efficient_loading else "plain"
    chosen = peak(strategy, inputs)
    return {
        "strategy": strategy,
        "rank0_host_peak_bytes": chosen.rank0,
        "other_host_peak_bytes": chosen.others,
        "checkpoint_bytes": checkpoint,
        "by_strategy": {s: {"rank0_host_peak_bytes": p.rank0, "other_host_peak_bytes": p.others}
                        for s in (*STRATEGIES, "plain") for p in [peak(s, inputs)]},
    }


def _sliceable(source: ModelSource) -> bool:
    """Safetensors files next to the config, or no weights at all (a config.json alone: the
    checkpoint the user will load is assumed to be safetensors, as hub checkpoints are)."""
    legacy = any(n.endswith((".bin", ".pt", ".gguf")) for n in os.listdir(source.folder))
    return bool(source.checkpoint_files) or not legacy


def _checkpoint_bytes(source: ModelSource, states: ShardedStates, dtypes: Dtypes) -> tuple[int, bool]:
    """(bytes stored, whether loading converts them): from the safetensors headers when the
    directory has weights, else the parameters in the config's dtype."""
    if source.checkpoint_files:
        from fsdp_offload_cfg.safetensors_index import read_headers

        tensors = read_headers(list(source.checkpoint_files)).values()
        stored = sum(t.dtype.itemsize * math.prod(t.shape) for t in tensors)
        return stored, any(t.dtype.is_floating_point and t.dtype != dtypes.load for t in tensors)
    return states.param_count * dtypes.load.itemsize, False


class Companions(NamedTuple):
    """The frozen models beside the trained one that are not a copy of it."""

    reward: ModelBytes  # every reward model together
    teacher: ModelBytes


def _companions(config: FSDPOffloadConfig, dtype: str | None, reward_models: tuple[str, ...],
                teacher: tuple[str, str | None] | None, world: int) -> Companions:
    rewards = [companion_bytes(path, config, dtype, True, world) for path in reward_models]
    return Companions(
        reward=ModelBytes(sum(r.whole for r in rewards), sum(r.shard for r in rewards)),
        teacher=companion_bytes(teacher[0], config, teacher[1], False, world) if teacher else ModelBytes(0, 0))


def _trl_head(config: FSDPOffloadConfig, loss_head: str, teacher: tuple[str, str | None] | None,
              completion_tokens: int | None, seq_len: int) -> Head | None:
    """The loss head TRL runs instead of the model's (`heads.py`), scoring the last
    `completion_tokens` positions (at most the sequence's; None: every one): its distillation
    against `teacher` (its path and load dtype), or its fused LM head; None for the model's own.
    Both compute in autocast's dtype under mixed precision (accelerate wraps the forward in it)."""
    compute = mixed_compute_dtype(config)
    autocast = getattr(torch, compute) if compute is not None else None
    scored = min(completion_tokens, seq_len - 1) if completion_tokens is not None else None
    if loss_head == "trl_chunked_distillation" and teacher is not None:
        source = read_model(teacher[0])
        text = source.config.get_text_config() if hasattr(source.config, "get_text_config") else source.config
        return ChunkedDistillation(scored or seq_len - 1, text.hidden_size,
                                   resolve_dtypes(config, source.config, teacher[1]).load, autocast)
    return FusedLogProbs(autocast, scored) if loss_head == "trl_fused_lm_head" else None


def _teacher_forward_said(head: Head | None) -> str:
    if not isinstance(head, ChunkedDistillation):  # ms-swift's GKD, or a teacher of the user's own script
        return "its no-grad forward's logits over the whole vocabulary are not counted"
    return (f"TRL's chunked divergence against it over the last {head.completion_tokens} positions: the teacher's "
            "hidden states there, the student's, their float32 tiles and gradient sums (no logits over the whole "
            "vocabulary); the teacher's no-grad forward's own working set (one layer at a time) is not counted")


def companion_bytes(path: str, config: FSDPOffloadConfig, dtype: str | None, reward: bool, world: int) -> ModelBytes:
    """The bytes of a frozen model loaded beside the trained one: a reward model (a one-label
    sequence classifier, `reward`) or a distillation teacher, loaded in `dtype` (None: its
    checkpoint's own); its shard over `world` ranks (1: TRL keeps it whole)."""
    source = read_model(path)
    load = resolve_dtypes(config, source.config, dtype).load
    return sequence_classifier_bytes(source, load, world) if reward else whole_model_bytes(source, load, None, world)


def _companion_said(role: str, path: str, sharded: bool, besides: str) -> list[str]:
    if sharded:
        return [f"the {role} model {path}: sharded beside the model in its load dtype ({role}_params_bytes: rank "
                f"0's shard; ms-swift prepares it as its reference model), no gradient nor optimizer state; {besides}"]
    return [f"the {role} model {path}: held whole on every rank ({role}_params_bytes; TRL prepares it in "
            f"evaluation mode, which accelerate does not shard), on the device even under offload_params; {besides}"]


def _companions_loading_said(states: ShardedStates) -> list[str]:
    if not (states.reference or states.reward or states.teacher):
        return []
    return ["loading counts the frozen models beside the trained one: TRL and ms-swift load every model before "
            "they prepare any, so a plain load holds them all whole on every rank's host at once; the loader builds them on meta "
            "too and fills each at its own prepare, after the model's (on the host only where the shards live there)"]


def _reference_said(dtypes: Dtypes) -> list[str]:
    return [f"the reference model (TRL's DPO, KTO, and GRPO / RLOO with a KL term): a frozen copy sharded beside "
            f"the model in its load dtype "
            f"({_name(dtypes.load)}; reference_params_bytes), no gradient nor optimizer state; its forward runs "
            "before the model's, gathering one layer at a time (this plugin shards its layers; TRL's own "
            "prepare_fsdp gathers it whole)"]


def _assumptions(config: FSDPOffloadConfig, source: ModelSource, dtypes: Dtypes, device: str, optimizer: str,
                 batch: dict[str, torch.Tensor], accumulating: bool, profile: ActivationProfile,
                 lora: Lora | None, image: ExampleImage | None, head: Head | None) -> list[str]:
    batch_size = batch["input_ids"].shape[0]
    trained = ("full fine-tuning: every parameter the loss reaches gets a gradient" if lora is None else
               f"{lora.describe()} (PEFT's get_peft_model): only the adapters"
               f"{' and the modules trained whole' if lora.saved_modules() else ''} get gradients and optimizer state; the "
               f"frozen base is stored in {_name(dtypes.frozen)}")
    out = [
        f"per rank = rank 0, which holds the largest dim-0 shard of every parameter (FSDP2 Shard(0)); "
        f"batch_size={batch_size} is one rank's micro-batch",
        f"parameters, gradients and optimizer state in {_name(dtypes.storage)}; gathered parameters and "
        f"activations in {_name(dtypes.compute)} (mixed_precision: {config.mixed_precision or 'no'})",
        f"{trained}; " + {
            "adamw": "AdamW keeps two moments per parameter (its scalar step counters are not counted); on CUDA "
                     "its step (foreach) holds one parameter-sized temporary",
            "adamw_fused": "fused AdamW keeps two moments per parameter and no step temporary",
            "sgd": "SGD without momentum keeps no state"}[optimizer],
        "gathered parameters: " + (
            "reshard_after_forward false keeps each layer gathered from its forward to its backward, so backward "
            "starts with every layer gathered (on top of the shards); true frees each after its forward"
            if units_stay_gathered(config) else
            "each layer is gathered for its forward and again for its backward (reshard_after_forward true), the "
            "next one prefetched"),
        "the step's peak is the worse of backward's and the optimizer step's (every gradient, no activation); "
        + ("with gradient accumulation every gradient is there in backward too" if accumulating else
           "in backward only the gradients of the groups it has passed are there (no gradient accumulation: "
           "pass --gradient-accumulation-steps if the run accumulates)"),
        "activations measured by one forward "
        + ("with labels" if head is None else f"without labels, {HEAD_WORDS[head.key]} in place of the loss (it "
           "projects the hidden states tile by tile: no logits over the vocabulary)")
        + " on the meta device under saved-tensor hooks; "
        + ("attention as a fused SDPA kernel (flash / memory-efficient: saves q, k, v, output, log-sum-exp)"
           if device == "cuda" else "attention as torch's CPU SDPA backend for these shapes"),
        "use_cache as the model config says: with it on, checkpointed layers keep the KV cache (every layer's "
        "keys and values) alive until backward; frameworks that turn use_cache off for training save that"
        if head is None else "use_cache off, as TRL runs its backbone for this loss",
        "backward's working set measured by one backward on the meta device: what each layer's backward "
        "and the head's (the logits' gradient) hold beside the saves"
        + (f" (not measured: {profile.backward_error}; the head counts its largest save)"
           if profile.backward_error else "")
        + "; a layer's forward, and a checkpointed layer's recompute, hold the most that forward held at once "
        "(its saves and its temporaries, measured by the forward) beside what is kept by then",
        "peak_device_bytes leaves out the CUDA context, allocator fragmentation, communication buffers "
        "and temporaries that live inside one op",
        *([] if head is not None else [
            f"the forward's output ({show_size(profile.output_bytes)}: the logits) is dropped before backward, as "
            "the Trainer drops it; a loop that keeps `outputs` through `backward(outputs.loss)` holds it at the peak "
            "too (activation budget auto counts it)"]),
        "loading figures are host RSS above each rank's baseline after imports; on a GPU run the shards and "
        "the broadcast buckets live on the device unless offload_params",
    ]
    if not source.checkpoint_files:
        out.append(f"no safetensors next to {source.path}: checkpoint assumed stored in {_name(dtypes.load)}")
    if "pixel_values" in batch:
        out.append("one image per sample, its placeholder tokens at the start of the sequence"
                   + (f": {image.sizes[0]} x {image.sizes[1]} pixels, {image.tokens} tokens" if image.sizes else ""))
    elif image is not None:
        out.append(f"text-only batch: one image takes {image.tokens} tokens, more than --seq-len, so the vision "
                   "tower's activations are not included")
    elif hasattr(source.config, "vision_config"):
        out.append("text-only batch: this model's image inputs are not modelled, so the vision tower's activations "
                   "are not included")
    return out


def _head_advice(profile: ActivationProfile, by_setting: dict[str, Residency], trls: Head | None) -> list[str]:
    """A line when the head's backward is most of what the leanest setting leaves on the device:
    the logits' float32 gradients (vocabulary x tokens) that no layer's choice touches, which a
    user with a large vocabulary otherwise tries to checkpoint or offload away (under TRL's
    chunked heads: the float32 sum of the output layer's gradient, vocabulary x hidden)."""
    head = profile.head_backward_bytes()
    smallest = min(r.device_peak_bytes for r in by_setting.values())
    if not smallest or head * 2 < smallest:
        return []
    share = (f"holds {show_size(head)}, {100 * head // smallest}% of the smallest activation peak any setting "
             f"reaches ({show_size(smallest)}); no layer's checkpointing or offload shrinks it")
    if trls is not None:
        return [f"the head's backward ({HEAD_WORDS[trls.key]}: the float32 sum of the output layer's gradient, "
                f"vocabulary x hidden, and its tiles) {share}: a LoRA, which leaves the output layer frozen, does"]
    return [f"the head's backward (the loss's gradients of the logits, float32) {share}: a chunked or fused "
            "cross-entropy (Liger's fused linear cross entropy) or shorter sequences do"]


def _cap_said(cap: int | None, by_setting: dict[str, Residency]) -> list[str]:
    """A line when `max_pinned_bytes` keeps saves on the device that the offload would move:
    the examples set a cap, and an offload row that saves less than expected reads as the
    offload's failing otherwise. Per setting that offloads, what stays past the cap."""
    capped = {name: r.capped_bytes for name, r in by_setting.items() if r.capped_bytes}
    if not capped:
        return []
    shown = "; ".join(f"{name.replace('_', ' ')} {show_size(n)}" for name, n in capped.items())
    return [f"max_pinned_bytes ({show_size(cap or 0)} per rank) caps the pinned host pool; the "
            f"saves past it stay on the device, counted there ({shown}): raise it where the host has room for every "
            "rank's pool"]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------ table


def _hybrid(report: dict[str, Any]) -> str:
    replicas = report.get("replicas", 1)
    return f" ({replicas} replicas x {report['ranks'] // replicas} shards, HSDP)" if replicas > 1 else ""


def _loss_head_shown(key: str) -> str:
    """The table's first line names a head that is not the model's own."""
    return f", loss through {HEAD_WORDS[key]}" if key in HEAD_WORDS else ""


def format_table(report: dict[str, Any]) -> str:
    """The report for people: per-rank memory, the four activation settings, loading."""
    r, inputs = report["per_rank"], report["inputs"]
    lora = report["model"].get("lora")
    trains = (f"; {'DoRA' if lora['dora'] else 'LoRA'} rank {lora['rank']}: "
              f"{lora['trainable_parameters'] / 1e6:,.1f}M trained" if lora else "")
    lines = [
        f"{report['model']['class']} ({report['model']['parameters'] / 1e6:,.1f}M parameters{trains}) on "
        f"{report['ranks']} "
        f"ranks{_hybrid(report)}, batch {inputs['batch_size']} x {inputs['seq_len']} tokens per rank, "
        f"{inputs['optimizer']}, "
        f"{inputs['device']}, compute {inputs['compute_dtype']}{_loss_head_shown(inputs['loss_head'])}",
        "",
        "| per rank | bytes |",
        "|---|---|",
    ]
    rows = [("parameters (sharded)", "params_bytes"), ("gradients (sharded)", "grads_bytes"),
            ("optimizer state (sharded)", "optimizer_bytes"), ("buffers (replicated)", "buffers_bytes"),
            ("gathered parameters (transient)", "gathered_params_bytes"),
            ("activations saved, no checkpointing or offload", "activations_bytes"),
            (f"activations on the device ({inputs['activation_setting']})", "activations_on_device_bytes"),
            ("pinned host pool", "pinned_host_bytes"), ("host memory for training", "host_bytes"),
            ("peak device memory", "peak_device_bytes")]
    if r.get("teacher_params_bytes"):
        rows.insert(1, ("teacher model (whole on every rank, frozen)", "teacher_params_bytes"))
    if r.get("reward_params_bytes"):
        rows.insert(1, ("reward model (whole on every rank, frozen)", "reward_params_bytes"))
    if r.get("reference_params_bytes"):
        rows.insert(1, ("reference model (sharded, frozen)", "reference_params_bytes"))
    lines += [f"| {label} | {show_size(r[key])} |" for label, key in rows]
    fit = report.get("device_fit")
    fit_header = (f" fits {show_size(fit['device_bytes'])}, {show_size(fit['margin_bytes'])} kept free |"
                  if fit else "")
    lines += ["", f"| activations | saved | on the device at peak | host | peak device memory |{fit_header}",
              "|---|---|---|---|---|" + ("---|" if fit else "")]
    for name, s in report["activations"]["settings"].items():
        lines.append(f"| {name.replace('_', ' ')} | {show_size(s['saved_bytes'])} | {show_size(s['device_peak_bytes'])} "
                     f"| {show_size(s['host_bytes'])} | {show_size(report['device_by_setting'][name]['peak_device_bytes'])} |"
                     + (f" {_fits(fit['by_setting'][name])} |" if fit else ""))
    if "plan" in report:
        lines += _plan_table(report["plan"])
    loading = report["loading"]
    lines += ["", "| loading (host peak) | rank 0 | each other rank |", "|---|---|---|"]
    for name, p in loading["by_strategy"].items():
        mark = " (this config)" if name == loading["strategy"] else ""
        lines.append(f"| {name}{mark} | {show_size(p['rank0_host_peak_bytes'])} | {show_size(p['other_host_peak_bytes'])} |")
    lines += _machine_table(report["per_machine"], loading["strategy"])
    lines += ["", "Assumptions:"] + [f"- {a}" for a in report["assumptions"]]
    return "\n".join(lines)


def _machine_table(machine: dict[str, Any], strategy: str) -> list[str]:
    """`per_machine` as a table, where a machine runs two ranks or more (one: the rows per rank)."""
    if machine["ranks"] < 2:
        return []
    whose = "rank 0's machine: its" if machine["machines"] > 1 else "the machine's"
    return ["", f"| host memory, {whose} {machine['ranks']} ranks together | bytes |", "|---|---|",
            f"| training (every rank's host memory for training) | {show_size(machine['host_bytes'])} |",
            f"| loading, {strategy} (every rank's peak, added) | {show_size(machine['loading_host_peak_bytes'])} |"]


def _fits(setting: dict[str, Any]) -> str:
    left = setting["left_bytes"]
    return f"yes, {show_size(left)} to spare" if setting["fits"] else f"no, {show_size(-left)} over"


def _plan_table(plan: dict[str, Any]) -> list[str]:
    """The plan in runs of consecutive layers with the same choice, then the single settings."""
    room = plan.get("room")
    lines = [] if room is None else [
        "", f"Activation budget auto: the device's {show_size(room['device_bytes'])}, less "
        f"{show_size(room['taken_bytes'] - room['colocated_bytes'])} of parameters and buffers, "
        + (f"{show_size(room['colocated_bytes'])} vLLM holds beside the run, " if room["colocated_bytes"] else "")
        + f"{show_size(room['to_come_bytes'])} of gradients, "
        f"optimizer state, gathered layers and the output a loop holds through backward, and a margin of {show_size(room['margin_bytes'])}"]
    lines += ["", f"Plan for an activation budget of {show_size(plan['budget_bytes'])}: activations peak at "
             f"{show_size(plan['device_peak_bytes'])} on the device, {show_size(plan['host_bytes'])} pinned on the host, "
             f"step time of the layers +{plan['extra_time_fraction']:.0%} (estimated)",
             "", "| layers | choice | on the device | on the host | extra ms |", "|---|---|---|---|---|"]
    layers = plan["layers"]
    for first, last, _ in layer_runs([layer["choice"] for layer in layers]):
        run = layers[first:last + 1]
        names = run[0]["name"] if len(run) == 1 else f"{run[0]['name']} .. {run[-1]['name']} ({len(run)})"
        lines.append(f"| {names} | {run[0]['choice'].replace('_', ' + ')} | "
                     f"{show_size(sum(r['device_bytes'] for r in run))} | {show_size(sum(r['host_bytes'] for r in run))} | "
                     f"{1e3 * sum(r['extra_seconds'] for r in run):.1f} |")
    lines += ["", "| single setting | activations on the device | fits | extra step time |", "|---|---|---|---|"]
    for name, u in plan["uniform"].items():
        lines.append(f"| {name.replace('_', ' ')} | {show_size(u['device_peak_bytes'])} | {'yes' if u['fits'] else 'no'} "
                     f"| +{u['extra_time_fraction']:.0%} |")
    model = plan["time_model"]
    lines.append(f"(time model: {model['compute_tflops']:g} TFLOP/s, copies at {model['copy_gb_per_s']:g} GB/s"
                 f"{', overlapping compute' if model['copies_overlap_compute'] else ', in line'}; "
                 "--compute-tflops / --copy-gb-per-s, or the config's activation_budget_compute_tflops / "
                 "activation_budget_copy_gb_per_s, to change)")
    return lines
