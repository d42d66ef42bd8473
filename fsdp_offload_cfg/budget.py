"""`activation_memory_budget` at run time: each decoder layer planned at the first training forward.

The planner (`estimate/plan.py`) needs what each layer saves and computes, and both depend on the
batch's shape, which a run learns only at its first forward. So prepare installs, inert, every
mechanism a plan may use: a checkpoint wrapper around each layer that passes straight through
(applied before sharding, where accelerate's own `fsdp2_apply_ac` puts it), and the activation
offload on every layer with all of them kept on the device. The first forward under grad, on
every rank and before any layer runs, takes the largest batch shape over the ranks, measures the
model's saves on `meta` at that shape as the estimate does, plans, and switches each layer's
wrapper and offload to its choice. Every rank plans from the same inputs and agrees before it
goes on (`agreed`), so a budget no plan meets stops every rank with the same message.

Prior art: torchtitan's budgeted offload (PR #3521) plans at compile time on the traced graph,
which needs `torch.compile`; this plans per layer on the meta forward, as the offload and
checkpointing act, and so works eagerly and under any framework that calls accelerate's prepare.

Exactness: a choice changes only where a saved tensor waits (the offload's copies are exact) or
whether it is recomputed (`checkpoint_wrapper` with the RNG state preserved, so dropout draws
the same masks), so gradients are bit-identical to the same run without a budget.

With `auto` the budget itself is worked out at that first forward, before the plan
(`estimate/room.py`): the device's memory less what is taken (measured here, before FSDP gathers
the root) and what is to come (estimated), less the margin; each rank measures its own and the
tightest rank's decides. It is kept for later plans: by then the optimizer's state is allocated
and measuring again would count it twice.

The plan is made for the largest batch shape any rank has seen: every training forward the ranks
agree on it (one small all-reduce over a gloo group, which never waits on the device), and a
batch longer or wider than any before is planned again before its first layer runs, so its
activations stay within the budget too. The rates the plan weighs time with are measured once on
the device (`estimate/rates.py`; the slowest rank's), unless the config states them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_offload_cfg import model_state
from fsdp_offload_cfg._logging import get_logger, is_rank0
from fsdp_offload_cfg._sizes import show_size
from fsdp_offload_cfg.config import ConfigError, FSDPOffloadConfig
from fsdp_offload_cfg.config.derived import auto_budget, budget_bytes, mixed_compute_dtype, stated_rates
from fsdp_offload_cfg.layer_classes import transformers_model
from fsdp_offload_cfg.offload.options import ActivationOffloadConfig
from fsdp_offload_cfg.ranks import agreed, every_rank, host_group, max_over_ranks, min_over_ranks

if TYPE_CHECKING:
    from fsdp_offload_cfg.estimate.plan import Plan
    from fsdp_offload_cfg.estimate.probe import ActivationProfile
    from fsdp_offload_cfg.estimate.room import Room

logger = get_logger("fsdp_offload_cfg.budget")


def _call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module(*args, **kwargs)


def set_checkpointing(wrapper: nn.Module, on: bool) -> None:
    """Turn a `CheckpointWrapper` on, or make it call its module straight through."""
    if model_state.get(wrapper, "checkpoint_fn") is None:
        model_state.put(wrapper, "checkpoint_fn", wrapper.checkpoint_fn)
    wrapper.checkpoint_fn = model_state.get(wrapper, "checkpoint_fn") if on else _call


def wrap_layers(model: nn.Module, cfg: FSDPOffloadConfig) -> None:
    """Before sharding: a checkpoint wrapper, passing through, around each layer the offload will
    group; refuses a model whose layers checkpoint themselves (transformers' gradient checkpointing)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper

    from fsdp_offload_cfg.estimate.probe import offload_groups

    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise ConfigError(f"{cfg.source}: activation_memory_budget decides which layers to checkpoint, and this "
                          "model already checkpoints its layers (transformers' own checkpointing: the Trainer's "
                          "activation_checkpointing, gradient_checkpointing before transformers 5.23, ms-swift's "
                          "--gradient_checkpointing); turn that off, or drop the budget")
    names = {id(m): n for n, m in model.named_modules()}
    for group in offload_groups(model, list(cfg.transformer_layer_cls_to_wrap or ()) or None):
        if isinstance(group, CheckpointWrapper):  # wrapped by hand before prepare: the plan takes it over
            set_checkpointing(group, False)
            continue
        wrapped = checkpoint_wrapper(group)  # preserve_rng_state=True: recomputed dropout draws the same masks
        set_checkpointing(wrapped, False)
        model_state.put(wrapped, "budget_wrapper", True)  # the budget's own: `remove` takes it away
        model.set_submodule(names[id(group)], wrapped)


def enable_activation_budget(model: nn.Module, budget: int | str, *, layer_classes: list[str] | None = None,
                             offload: ActivationOffloadConfig | None = None, mixed_precision: str | None = None,
                             compute_tflops: float | None = None, copy_gb_per_s: float | None = None,
                             device_memory: int | str | None = None) -> BudgetPlanner:
    """`activation_memory_budget` for a script that shards with `fully_shard` itself (torchrun, no
    accelerate): call it after sharding and before the first forward. The same planning as
    through accelerate's prepare, at the first training forward; the arguments are the config's
    keys (`budget`: activation_memory_budget, bytes, a size or `auto`; `layer_classes`:
    transformer_layer_cls_to_wrap; `mixed_precision`: bf16/fp16 as the `MixedPrecisionPolicy`
    computes, else the parameters' dtype; the rates and `device_memory`:
    activation_budget_*). Returns the planner: `.plan`, `.budget`, `.room` once planned,
    `.remove()` to stop planning, offloading and checkpointing.

    Layers are wrapped after sharding here (accelerate wraps them before): the checkpoint wrapper
    then sits outside each layer's FSDP2 module, whose pre-backward hook gathers the parameters
    before the recomputation runs, so the recomputed forward is the forward (tested bit-equal).
    FSDP1 is refused: its units own their layers' forward through flat parameters, and the plan's
    per-layer wrappers and offload boundaries would not see the layers the estimate measures."""
    from fsdp_offload_cfg.config import load_config

    _refuse_fsdp1(model)
    keys = {"activation_memory_budget": budget, "transformer_layer_cls_to_wrap": layer_classes,
            "activation_budget_compute_tflops": compute_tflops, "activation_budget_copy_gb_per_s": copy_gb_per_s,
            "activation_budget_device_memory": device_memory}
    cfg = load_config({"distributed_type": "FSDP", "mixed_precision": mixed_precision or "no",
                       "fsdp_config": {"version": 2, **{k: v for k, v in keys.items() if v is not None}}},
                      name="enable_activation_budget()")
    if offload is not None:
        cfg = dataclasses.replace(cfg, activation_cpu_offload=offload)
    wrap_layers(model, cfg)
    return enable_budget(model, cfg)


def _refuse_fsdp1(model: nn.Module) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ConfigError("enable_activation_budget(): this model is wrapped by FSDP1 (FullyShardedDataParallel), "
                          "whose units run their layers through flat parameters: the plan's per-layer checkpoint "
                          "wrappers and offload boundaries cannot act on them. Shard with FSDP2 "
                          "(torch.distributed.fsdp.fully_shard on each layer, then the model)")


def enable_budget(model: nn.Module, cfg: FSDPOffloadConfig) -> BudgetPlanner:
    """After prepare: the offload on every layer, all of them kept until the plan is made, and the
    planner at the first training forward; the planner's `remove()` takes both away."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from fsdp_offload_cfg.offload import enable_activation_offload
    from fsdp_offload_cfg.offload.stats import summarize_offload_at_exit

    handle = enable_activation_offload(model, dataclasses.replace(cfg.activation_cpu_offload, enabled=True))
    if not all(isinstance(g, CheckpointWrapper) for g in handle.groups):
        names = [type(g).__name__ for g in handle.groups if not isinstance(g, CheckpointWrapper)]
        raise ConfigError(f"{cfg.source}: activation_memory_budget: the offload groups {', '.join(names[:3])} are "
                          "not the layers wrapped for the plan; set transformer_layer_cls_to_wrap to the decoder "
                          "layer class")
    handle.handler.kept_groups = frozenset(range(len(handle.groups)))
    planner = BudgetPlanner(model, handle, cfg, host_group())
    # Both hooks are host-side bookkeeping (a collective, a meta forward, a plan), never part of a
    # graph: under a model compiled whole dynamo would trace into them (transformers 4.57's meta
    # init crashed it), so they are compiler-disabled. Here, not as decorators on the class:
    # `torch.compiler.disable` imports dynamo (about 2 CPU-s, sympy with it), and a decorator ran
    # it at this module's import, in every process `patch()` ran in, the launchers that start no
    # training (`accelerate launch`, torchrun's agent, `swift sft` under `fsdp-offload-cfg run`).
    disabled = torch.compiler.disable
    # before FSDP's own pre-forward (which gathers the root's parameters): what `auto` measures
    # as taken is then the sharded state, as the estimate counts it
    planner.hook = model.register_forward_pre_hook(disabled(planner.__call__), with_kwargs=True, prepend=True)
    # before the offload's own (it reads the plan's kept groups)
    planner.layer_hook = handle.groups[0].register_forward_pre_hook(disabled(planner.at_first_layer),
                                                                    with_kwargs=True, prepend=True)
    summarize_offload_at_exit()
    return planner


class BudgetPlanner:
    """The root's forward pre-hook: plans at the first forward under grad, and again at a larger one."""

    def __init__(self, model: nn.Module, handle: Any, cfg: FSDPOffloadConfig, group: Any) -> None:
        self.model = model
        self.handle = handle
        self.cfg = cfg
        self.group = group  # the gloo group the ranks agree on batch shapes over, every training forward
        self.shape: tuple[int, int] | None = None  # (batch, tokens) the plan is made for, once made
        self.rates: tuple[float, float] | None = None  # (FLOP/s, copy bytes/s), measured once, then kept
        self.plan: Plan | None = None  # the plan the layers follow (for `planned` and the tests)
        self.no_cache = False  # training forwards run without a KV cache: a plan that checkpoints (see __call__)
        self.passes_at_plan: int | None = None  # the offload's pass count when a plan was made, until checked
        self.auto = auto_budget(cfg)  # `auto`: the budget is worked out at the first plan
        self.budget = budget_bytes(cfg)  # bytes the plans fit in: stated, or the room's once measured
        self.room: Room | None = None  # with `auto`: the tightest rank's room, kept for every later plan
        self.profiled: tuple[tuple[int, int], ActivationProfile, Any] | None = None  # (shape, profile, twin), last
        self.hook: Any = None  # the forward pre-hook handle, until `remove`
        # TRL's `_ForwardRedirection` called the root with its loss's arguments, not the model's: the
        # batch shape shows at the first layer, whose pre-hook (`layer_hook`) plans in its place
        self.redirected = False
        self.layer_hook: Any = None

    def remove(self) -> None:
        """Stop planning: the hook and the offload removed; each layer back in its parent's place
        without the wrapper the budget put around it, and a wrapper the script put there itself
        checkpointing again, as it did before the budget took it over."""
        for hook in (self.hook, self.layer_hook):
            if hook is not None:
                hook.remove()
        self.hook = self.layer_hook = None
        self.handle.remove()
        names = {id(m): n for n, m in self.model.named_modules()}
        for wrapper in self.handle.groups:
            if model_state.get(wrapper, "checkpoint_fn") is None:  # already removed (remove is idempotent)
                continue
            ours = model_state.take(wrapper, "budget_wrapper")
            set_checkpointing(wrapper, not ours)
            model_state.take(wrapper, "checkpoint_fn")
            if ours and id(wrapper) in names:
                self.model.set_submodule(names[id(wrapper)], wrapper._checkpoint_wrapped_module)
        model_state.take(self.model, "planner")

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        from fsdp_offload_cfg.offload.handlers import in_backward

        if not torch.is_grad_enabled() or in_backward():
            return None
        self.refuse_a_bypassed_offload()
        if args and isinstance(args[0], nn.Module):  # TRL's redirection, on every rank alike: no collective skipped
            self.redirected = True
            return None
        self.plan_for(batch_shape(args, kwargs))
        # A checkpointed layer that appends to a KV cache appends again when it is recomputed, and
        # the recomputation then differs from the forward (transformers 4.x: "recomputed metadata").
        # transformers turns the cache off under its own gradient checkpointing, and so does a plan
        # that checkpoints: a training forward has no use for the cache. (Only then: on 4.x the
        # cache's attention mask path differs in the last bits, and a plan without checkpointing
        # must train exactly what the run without a budget trains.)
        return (args, {**kwargs, "use_cache": False}) if self.no_cache else None

    def at_first_layer(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The first layer's forward pre-hook: where TRL's redirection hid the batch from the root's
        hook, plan from the layer's hidden states (batch, tokens, hidden), inside the offload's pass
        that TRL's method runs in (`trl-forward-redirection`); its loss (TRL's chunked heads) asks for
        no cache."""
        from fsdp_offload_cfg.offload.handlers import in_backward

        if not self.redirected or not torch.is_grad_enabled() or in_backward():
            return
        self.redirected = False
        hidden = args[0] if args else kwargs.get("hidden_states")
        self.plan_for(batch_shape((hidden,), {}), in_pass=True)

    def plan_for(self, shape: tuple[int, int] | None, in_pass: bool = False) -> None:
        """Plan at the first training forward, and again where a rank's batch grew past the plan's.
        `in_pass`: the offload's pass of this forward has begun (counted already)."""
        largest = _largest_over_ranks(shape, self.group)
        if self.shape is None:
            self.rates = self.agreed_rates(largest)
            if self.auto is not None:
                self.room = self.agreed_room(largest)
                self.budget = self.room.budget_bytes
            agreed("planning activation_memory_budget", lambda: self.make_plan(largest, in_pass))
        elif largest is not None and (grown := (max(largest[0], self.shape[0]), max(largest[1], self.shape[1]))) \
                != self.shape:
            agreed("planning activation_memory_budget again, for a larger batch", lambda: self.make_plan(grown, in_pass))

    def refuse_a_bypassed_offload(self) -> None:
        """A plan that offloads relies on the offload's hooks, which a model compiled whole bypasses
        (one graph has no layer boundary to offload at): its layers would keep what the plan moves
        and the budget would not be met. Checked at the training forward after the plan's first,
        the same on every rank (every rank compiles the same way)."""
        if self.passes_at_plan is None or self.plan is None:
            return
        bypassed = self.handle.handler.passes == self.passes_at_plan
        self.passes_at_plan = None  # checked once, at the forward after the plan
        if bypassed and any(c.endswith("offload") for c in self.plan.choices):
            raise ConfigError(f"{self.cfg.source}: activation_memory_budget: the plan offloads layers, and the model "
                              "is compiled whole (torch.compile(model), model.compile(), accelerate's dynamo_config), "
                              "which bypasses the offload: compile each decoder layer instead (for layer in "
                              "model.model.layers: layer.compile(); accelerate: dynamo_config "
                              "use_regional_compilation: true), or drop the budget")

    def agreed_rates(self, shape: tuple[int, int] | None) -> tuple[float, float]:
        """(FLOP/s, copy bytes/s) to plan at: the config's, else measured here and taken from the
        slowest rank, so that every rank makes the same plan."""
        flops, copy = stated_rates(self.cfg)
        if flops is not None and copy is not None:
            return flops, copy
        measured = agreed("measuring the device for activation_memory_budget", lambda: self.measure(shape))
        slowest = min_over_ranks(measured, self.group)
        return (flops or slowest[0]), (copy or slowest[1])

    def measure(self, shape: tuple[int, int] | None) -> tuple[float, float]:
        from fsdp_offload_cfg.estimate.rates import measure_rates

        pretrained = transformers_model(self.model)
        text = pretrained.config.get_text_config() if pretrained is not None else None
        hidden = int(getattr(text, "hidden_size", 0) or 1024)
        tokens = shape[0] * shape[1] if shape is not None else 1024
        return measure_rates(self.handle.handler.device, _compute_dtype(self.model, self.cfg), hidden, tokens)

    def make_plan(self, shape: tuple[int, int] | None, in_pass: bool = False) -> None:
        from fsdp_offload_cfg.estimate import EstimateError
        from fsdp_offload_cfg.estimate.plan import BudgetUnreachable, default_time_model, plan_to_budget
        from fsdp_offload_cfg.offload.handlers import AsyncHandler

        assert self.rates is not None and self.budget is not None
        profile, _ = self.profile_at(self.known(shape))
        async_reload = isinstance(self.handle.handler, AsyncHandler)
        time = default_time_model(self.handle.handler.device.type, async_reload, *self.rates)
        try:
            plan = plan_to_budget(profile, self.budget, self.handle.config, async_reload, time)
        except EstimateError as error:
            said = (self.room.unreachable(error.smallest_bytes)
                    if isinstance(error, BudgetUnreachable) and self.room is not None else str(error))
            raise ConfigError(f"{self.cfg.source}: activation_memory_budget: at {shape[0]} x {shape[1]} tokens per "
                              f"rank, {said}") from error
        for boundary, choice in zip(self.handle.groups, plan.choices):
            set_checkpointing(boundary, choice.startswith("checkpoint"))
        self.handle.handler.kept_groups = frozenset(i for i, c in enumerate(plan.choices) if not c.endswith("offload"))
        model_state.put(self.model, "planner", self)
        self.no_cache = _takes_use_cache(self.model) and any(c.startswith("checkpoint") for c in plan.choices)
        replanned = self.shape is not None
        # the plan's forward is about to run, and adds one; or it runs already (TRL's redirection)
        self.passes_at_plan = self.handle.handler.passes - in_pass
        self.shape, self.plan = shape, plan
        if is_rank0():
            logger.info("%s%s", "planned again, for a larger batch: " if replanned else "",
                        describe(plan, shape, self.rates_source(), self.room))

    def known(self, shape: tuple[int, int] | None) -> tuple[int, int]:
        if shape is None:
            raise ConfigError(f"{self.cfg.source}: activation_memory_budget: cannot tell the batch shape from the "
                              "model's forward arguments (no input_ids or inputs_embeds)")
        return shape

    def profile_at(self, shape: tuple[int, int]) -> tuple[ActivationProfile, Any]:
        """The model's saves measured on its `meta` twin at `shape`, and the twin (kept for the
        last shape: `auto`'s room and the first plan read the same one)."""
        if self.profiled is None or self.profiled[0] != shape:
            self.profiled = (shape, *profile_layers(self.model, self.handle, self.cfg, shape))
        return self.profiled[1], self.profiled[2]

    def agreed_room(self, shape: tuple[int, int] | None) -> Room:
        """`auto`'s room: each rank's measured, the tightest taken by every rank; a room with
        nothing left stops every rank with its figures."""
        from fsdp_offload_cfg.estimate import EstimateError

        here = agreed("measuring the device for activation_memory_budget: auto", lambda: self.room_here(shape))
        tightest = _tightest_over_ranks(here, self.group)

        def check() -> Room:
            try:
                return tightest.checked()
            except EstimateError as error:
                raise ConfigError(f"{self.cfg.source}: activation_memory_budget: {error}") from None

        return agreed("checking the room for activations", check)

    def room_here(self, shape: tuple[int, int] | None) -> Room:
        """This rank's room: what it holds measured, what is to come estimated from the twin as
        the estimate counts it (AdamW: the optimizer is not known to the model)."""
        from fsdp_offload_cfg.estimate.model import layer_class_names
        from fsdp_offload_cfg.estimate.room import Room, to_come
        from fsdp_offload_cfg.estimate.states import sharded_states, units_stay_gathered

        assert self.auto is not None
        profile, twin = self.profile_at(self.known(shape))
        device_bytes, taken = device_in_use(self.model, self.handle.handler.device, self.auto.device_bytes, self.cfg)
        layers = layer_class_names(twin, self.cfg.transformer_layer_cls_to_wrap)
        states = sharded_states(twin, layers, _world(), _storage_dtype(self.model, self.cfg),
                                _compute_dtype(self.model, self.cfg), "adamw", profile.trained,
                                units_stay=units_stay_gathered(self.cfg))
        resident = not self.cfg.offload_params
        return Room(device_bytes, taken, to_come(states, resident, profile.output_bytes),
                    self.auto.margin(device_bytes))

    def rates_source(self) -> str:
        """Where the rates came from, for the log line: the config, the device, or one from each."""
        flops, copy = stated_rates(self.cfg)
        measured = "measured on the device" + (", the slowest rank's" if dist.is_initialized()
                                               and dist.get_world_size() > 1 else "")
        if flops is not None and copy is not None:
            return "from the config"
        if flops is None and copy is None:
            return measured
        return "compute from the config, copies " + measured if flops is not None else \
            "copies from the config, compute " + measured


def planned(model: nn.Module) -> BudgetPlanner | None:
    """The budget's planner of `model` once it has planned (its `shape`, `rates`, `plan`); None before."""
    return model_state.get(model, "planner")


def planned_choices(model: nn.Module) -> list[str] | None:
    """Each layer's choice as the model now runs it (keep, offload, checkpoint, checkpoint_offload),
    read from its wrapper and the offload; None before the plan is made, or without a budget."""
    from fsdp_offload_cfg.offload import get_offload_handle

    handle = get_offload_handle(model)
    if handle is None or not handle.active or model_state.get(model, "planner") is None:
        return None
    names = {(False, False): "keep", (False, True): "offload", (True, False): "checkpoint",
             (True, True): "checkpoint_offload"}
    return [names[(g.checkpoint_fn is not _call, i not in handle.handler.kept_groups)]
            for i, g in enumerate(handle.groups)]


def profile_layers(model: nn.Module, handle: Any, cfg: FSDPOffloadConfig,
                   shape: tuple[int, int]) -> tuple[ActivationProfile, nn.Module]:
    """What this model's layers save and compute at `shape`, measured on a `meta` twin as the
    estimate measures it, and the twin."""
    from fsdp_offload_cfg.estimate.adapters import adapters_like, gathered_in
    from fsdp_offload_cfg.estimate.heads import FusedLogProbs, is_trl_fused_forward
    from fsdp_offload_cfg.estimate.model import (
        ModelSource,
        build_on_meta,
        example_batch,
        example_image,
        layer_class_names,
    )
    from fsdp_offload_cfg.estimate.probe import measure_activations
    from fsdp_offload_cfg.offload.groups import own_class

    pretrained = transformers_model(model)
    if pretrained is None:
        raise ConfigError(f"{cfg.source}: activation_memory_budget plans transformers models; this model has no "
                          "PreTrainedModel inside it")
    source = ModelSource("", pretrained.config, (), "")
    dtype = _compute_dtype(model, cfg)
    twin = build_on_meta(source, dtype, cls=own_class(pretrained))
    twin = adapters_like(model, twin)  # a LoRA run: its adapters
    layers = layer_class_names(twin, cfg.transformer_layer_cls_to_wrap)
    batch = example_batch(source, *shape, dtype, example_image(source.config, twin))
    target = handle.handler.device.type
    # TRL's trainers score tokens tile by tile, no logits (`estimate/heads.py`): its fused head is
    # the model's own forward, or the one the offload's root forward wraps; its distillation loss
    # runs in the forward's place (TRL's redirection), which puts its head on the model meanwhile
    fused = any(is_trl_fused_forward(f) for f in (vars(pretrained).get("forward"), handle.model_forward))
    autocast = dtype if mixed_compute_dtype(cfg) else None
    redirected = model_state.get(model, "loss_head")
    head = (dataclasses.replace(redirected, autocast=autocast) if redirected is not None
            else FusedLogProbs(autocast) if fused else None)
    with gathered_in(twin, dtype if mixed_compute_dtype(cfg) else None):
        try:
            profile = measure_activations(twin, batch, layers, target=target, head=head)
        except Exception:  # noqa: BLE001 - a head whose labels are not token ids (a classifier, a reward model)
            batch.pop("labels", None)  # its loss is a few bytes after the last layer; the layers are what is planned
            profile = measure_activations(twin, batch, layers, target=target, head=head)
    if len(profile.groups) != len(handle.groups):
        raise ConfigError(f"{cfg.source}: activation_memory_budget: the plan measured {len(profile.groups)} layers "
                          f"and the model has {len(handle.groups)}; set transformer_layer_cls_to_wrap to the decoder "
                          "layer class")
    return profile, twin


def device_in_use(model: nn.Module, device: torch.device, stated: int | None,
                  cfg: FSDPOffloadConfig) -> tuple[int, int]:
    """(device bytes, bytes taken) for `auto`. On CUDA: the allocator's allocated bytes, and, where
    no size is stated, the device's total with what lies outside this process's allocator (the
    CUDA context, other processes) counted as taken. Elsewhere (the CPU) only a stated size, and
    the bytes the model holds there (its shards, buffers and gradients)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        if stated is not None:
            return stated, allocated
        return total, allocated + max(0, total - free - torch.cuda.memory_reserved(device))
    if stated is None:
        raise ConfigError(f"{cfg.source}: activation_memory_budget: auto reads the device's memory from CUDA, and "
                          f"this run computes on {device.type}: state the size to plan against with "
                          "activation_budget_device_memory (such as 8GiB), or give the budget in bytes")
    return stated, _bytes_held(model)


def _bytes_held(model: nn.Module) -> int:
    """The bytes of the model's local parameter shards, buffers and gradients."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    return sum(local(t) for t in [*params, *model.buffers(), *(p.grad for p in params if p.grad is not None)])


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _storage_dtype(model: nn.Module, cfg: FSDPOffloadConfig) -> torch.dtype:
    """The dtype the sharded parameters that train are kept in, by the estimate's rule
    (`estimate.inputs.resolve_dtypes`): float32 masters under mixed precision where the installed
    accelerate upcasts, else the dtype the model was loaded in. Not read off the parameters alone:
    under mixed precision a LoRA's first parameter is its frozen base, which stays in the load dtype."""
    from fsdp_offload_cfg.compat.master_weights import accelerate_upcast

    if mixed_compute_dtype(cfg) is not None and accelerate_upcast() != "none":
        return torch.float32
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def describe(plan: Plan, shape: tuple[int, int], rates_source: str, room: Room | None = None) -> str:
    """Rank 0's line: the budget (with `auto`, how it was worked out), each run of layers with one
    choice, the estimates and the rates."""
    from fsdp_offload_cfg.estimate.plan import layer_runs

    choices = "; ".join((f"layers {a}-{b}" if a != b else f"layer {a}") + f": {c.replace('_', ' + ')}"
                        for a, b, c in layer_runs(plan.choices))
    extra = plan.extra_seconds / plan.compute_seconds if plan.compute_seconds else 0.0
    budget = show_size(plan.budget_bytes) if room is None else \
        f"auto ({room.describe()}; the tightest rank's): {show_size(plan.budget_bytes)}"
    return (f"activation_memory_budget {budget} at {shape[0]} x {shape[1]} tokens per rank: "
            f"{choices}; activations on the device {show_size(plan.residency.device_peak_bytes)}, on the host "
            f"{show_size(plan.residency.host_bytes)}, layer time +{extra:.0%} (estimated at "
            f"{plan.time.compute_flops / 1e12:.3g} TFLOP/s and copies at {plan.time.copy_bytes / 1e9:.3g} GB/s, "
            f"{rates_source})")


def batch_shape(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """(batch, tokens) of a forward's inputs: `input_ids`, else `inputs_embeds`, else the first
    positional tensor."""
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args[:1]):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0]), int(value.shape[1])
    return None


def _largest_over_ranks(shape: tuple[int, int] | None, group: Any) -> tuple[int, int] | None:
    """The largest batch and the longest sequence of any rank, the same on every rank; None where
    any rank has none."""
    batch, tokens, missing = max_over_ranks([*(shape or (0, 0)), int(shape is None)], group)
    return None if missing else (batch, tokens)


def _tightest_over_ranks(room: Room, group: Any) -> Room:
    """The room of the rank that leaves activations the least, the same on every rank."""
    from fsdp_offload_cfg.estimate.room import Room

    rooms = [Room(*values) for values in every_rank(
        [room.device_bytes, room.taken_bytes, room.to_come_bytes, room.margin_bytes], group)]
    return min(rooms, key=lambda r: r.budget_bytes)


def _takes_use_cache(model: nn.Module) -> bool:
    """The transformers model inside `model` takes `use_cache` (decoders do; wrappers pass it on)."""
    import inspect

    pretrained = transformers_model(model)  # its class's forward: the instance's is the offload's wrapper
    return pretrained is not None and "use_cache" in inspect.signature(type(pretrained).forward).parameters


def _compute_dtype(model: nn.Module, cfg: FSDPOffloadConfig) -> torch.dtype:
    """The dtype this run computes activations in: the config's mixed precision (one rule with
    the estimate, `config.derived`), else the parameters' own."""
    mixed = mixed_compute_dtype(cfg)
    if mixed is not None:
        return getattr(torch, mixed)
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
