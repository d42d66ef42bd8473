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

from fsdp_offload_cfg import registry
from fsdp_offload_cfg._logging import get_logger, is_rank0
from fsdp_offload_cfg._sizes import show_size
from fsdp_offload_cfg.config import ConfigError, FSDPOffloadConfig
from fsdp_offload_cfg.config.derived import budget_bytes, mixed_compute_dtype, stated_rates

if TYPE_CHECKING:
    from fsdp_offload_cfg.estimate.plan import Plan

logger = get_logger("fsdp_offload_cfg.budget")

_FN = "_fsdp_offload_cfg_checkpoint_fn"  # a wrapper's own checkpoint function, while it passes through
_PLANNED = "_fsdp_offload_cfg_budget_planned"  # set on the model once its layers follow a plan


def _call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module(*args, **kwargs)


def set_checkpointing(wrapper: nn.Module, on: bool) -> None:
    """Turn a `CheckpointWrapper` on, or make it call its module straight through."""
    if _FN not in wrapper.__dict__:
        wrapper.__dict__[_FN] = wrapper.checkpoint_fn
    wrapper.checkpoint_fn = wrapper.__dict__[_FN] if on else _call


def wrap_layers(model: nn.Module, cfg: FSDPOffloadConfig) -> None:
    """Before sharding: a checkpoint wrapper, passing through, around each layer the offload will
    group; refuses a model whose layers checkpoint themselves (transformers' gradient checkpointing)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper

    from fsdp_offload_cfg.estimate.probe import offload_groups

    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise ConfigError(f"{cfg.source}: activation_memory_budget decides which layers to checkpoint, and this "
                          "model already checkpoints every layer (transformers' gradient checkpointing: the "
                          "Trainer's gradient_checkpointing, ms-swift's --gradient_checkpointing); turn that off, "
                          "or drop the budget")
    names = {id(m): n for n, m in model.named_modules()}
    for group in offload_groups(model, list(cfg.transformer_layer_cls_to_wrap or ()) or None):
        if isinstance(group, CheckpointWrapper):  # wrapped by hand before prepare: the plan takes it over
            set_checkpointing(group, False)
            continue
        wrapped = checkpoint_wrapper(group)  # preserve_rng_state=True: recomputed dropout draws the same masks
        set_checkpointing(wrapped, False)
        model.set_submodule(names[id(group)], wrapped)


def enable_budget(model: nn.Module, cfg: FSDPOffloadConfig) -> None:
    """After prepare: the offload on every layer, all of them kept until the plan is made, and the
    planner at the first training forward; `unpatch()` removes both."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from fsdp_offload_cfg.integrations.common import summarize_offload_at_exit
    from fsdp_offload_cfg.offload import enable_activation_offload

    handle = enable_activation_offload(model, dataclasses.replace(cfg.activation_cpu_offload, enabled=True))
    registry.on_uninstall(handle.remove)
    if not all(isinstance(g, CheckpointWrapper) for g in handle.groups):
        names = [type(g).__name__ for g in handle.groups if not isinstance(g, CheckpointWrapper)]
        raise ConfigError(f"{cfg.source}: activation_memory_budget: the offload groups {', '.join(names[:3])} are "
                          "not the layers wrapped for the plan; set transformer_layer_cls_to_wrap to the decoder "
                          "layer class")
    handle.handler.kept_groups = frozenset(range(len(handle.groups)))
    planner = _Planner(model, handle, cfg, _host_group())
    hook = model.register_forward_pre_hook(planner, with_kwargs=True)
    registry.on_uninstall(hook.remove)
    summarize_offload_at_exit()


class _Planner:
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

    # Host-side bookkeeping (a collective, a meta forward, a plan), never part of a graph: under a
    # model compiled whole dynamo would trace into it (transformers 4.57's meta init crashed dynamo).
    @torch.compiler.disable
    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        from fsdp_offload_cfg.offload.handlers import in_backward

        if not torch.is_grad_enabled() or in_backward():
            return None
        self.refuse_a_bypassed_offload()
        largest = _largest_over_ranks(batch_shape(args, kwargs), self.group)
        if self.shape is None:
            self.rates = self.agreed_rates(largest)
            _agreed("planning activation_memory_budget", lambda: self.make_plan(largest))
        elif largest is not None and (grown := (max(largest[0], self.shape[0]), max(largest[1], self.shape[1]))) \
                != self.shape:
            _agreed("planning activation_memory_budget again, for a larger batch", lambda: self.make_plan(grown))
        # A checkpointed layer that appends to a KV cache appends again when it is recomputed, and
        # the recomputation then differs from the forward (transformers 4.x: "recomputed metadata").
        # transformers turns the cache off under its own gradient checkpointing, and so does a plan
        # that checkpoints: a training forward has no use for the cache. (Only then: on 4.x the
        # cache's attention mask path differs in the last bits, and a plan without checkpointing
        # must train exactly what the run without a budget trains.)
        return (args, {**kwargs, "use_cache": False}) if self.no_cache else None

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
        measured = _agreed("measuring the device for activation_memory_budget", lambda: self.measure(shape))
        slowest = _slowest_over_ranks(measured, self.group)
        return (flops or slowest[0]), (copy or slowest[1])

    def measure(self, shape: tuple[int, int] | None) -> tuple[float, float]:
        from fsdp_offload_cfg.estimate.rates import measure_rates

        pretrained = _transformers_model(self.model)
        text = pretrained.config.get_text_config() if pretrained is not None else None
        hidden = int(getattr(text, "hidden_size", 0) or 1024)
        tokens = shape[0] * shape[1] if shape is not None else 1024
        return measure_rates(self.handle.handler.device, _compute_dtype(self.model, self.cfg), hidden, tokens)

    def make_plan(self, shape: tuple[int, int] | None) -> None:
        if shape is None:
            raise ConfigError(f"{self.cfg.source}: activation_memory_budget: cannot tell the batch shape from the "
                              "model's forward arguments (no input_ids or inputs_embeds)")
        from fsdp_offload_cfg.estimate import EstimateError

        assert self.rates is not None
        try:
            plan = plan_layers(self.model, self.handle, self.cfg, shape, self.rates)
        except EstimateError as error:
            raise ConfigError(f"{self.cfg.source}: activation_memory_budget: at {shape[0]} x {shape[1]} tokens per "
                              f"rank, {error}") from error
        for boundary, choice in zip(self.handle.groups, plan.choices):
            set_checkpointing(boundary, choice.startswith("checkpoint"))
        self.handle.handler.kept_groups = frozenset(i for i, c in enumerate(plan.choices) if not c.endswith("offload"))
        self.model.__dict__[_PLANNED] = self
        self.no_cache = _takes_use_cache(self.model) and any(c.startswith("checkpoint") for c in plan.choices)
        replanned = self.shape is not None
        self.passes_at_plan = self.handle.handler.passes  # the plan's forward is about to run: it adds one
        self.shape, self.plan = shape, plan
        if is_rank0():
            logger.info("%s%s", "planned again, for a larger batch: " if replanned else "",
                        describe(plan, shape, self.rates_source()))

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


def planned(model: nn.Module) -> _Planner | None:
    """The budget's planner of `model` once it has planned (its `shape`, `rates`, `plan`); None before."""
    return model.__dict__.get(_PLANNED)


def planned_choices(model: nn.Module) -> list[str] | None:
    """Each layer's choice as the model now runs it (keep, offload, checkpoint, checkpoint_offload),
    read from its wrapper and the offload; None before the plan is made, or without a budget."""
    from fsdp_offload_cfg.offload import get_offload_handle

    handle = get_offload_handle(model)
    if handle is None or not handle.active or not model.__dict__.get(_PLANNED):
        return None
    names = {(False, False): "keep", (False, True): "offload", (True, False): "checkpoint",
             (True, True): "checkpoint_offload"}
    return [names[(g.checkpoint_fn is not _call, i not in handle.handler.kept_groups)]
            for i, g in enumerate(handle.groups)]


def plan_layers(model: nn.Module, handle: Any, cfg: FSDPOffloadConfig, shape: tuple[int, int],
                rates: tuple[float, float]) -> Plan:
    """The estimate's plan for this model at `shape`: its saves measured on a `meta` twin."""
    from fsdp_offload_cfg.estimate.model import ModelSource, build_on_meta, example_batch, layer_class_names
    from fsdp_offload_cfg.estimate.plan import default_time_model, plan_to_budget
    from fsdp_offload_cfg.estimate.probe import measure_activations
    from fsdp_offload_cfg.offload.handlers import AsyncHandler

    pretrained = _transformers_model(model)
    if pretrained is None:
        raise ConfigError(f"{cfg.source}: activation_memory_budget plans transformers models; this model has no "
                          "PreTrainedModel inside it")
    source = ModelSource("", pretrained.config, ())
    dtype = _compute_dtype(model, cfg)
    twin = build_on_meta(source, dtype, cls=_original_class(pretrained))
    layers = layer_class_names(twin, cfg.transformer_layer_cls_to_wrap)
    handler = handle.handler
    batch = example_batch(source, *shape, dtype)
    try:
        profile = measure_activations(twin, batch, layers, target=handler.device.type)
    except Exception:  # noqa: BLE001 - a head whose labels are not token ids (a classifier, a reward model)
        batch.pop("labels")  # its loss is a few bytes after the last layer; the layers are what is planned
        profile = measure_activations(twin, batch, layers, target=handler.device.type)
    if len(profile.groups) != len(handle.groups):
        raise ConfigError(f"{cfg.source}: activation_memory_budget: the plan measured {len(profile.groups)} layers "
                          f"and the model has {len(handle.groups)}; set transformer_layer_cls_to_wrap to the decoder "
                          "layer class")
    async_reload = isinstance(handler, AsyncHandler)
    return plan_to_budget(profile, budget_bytes(cfg), handle.config, async_reload,
                          default_time_model(handler.device.type, async_reload, *rates))


def describe(plan: Plan, shape: tuple[int, int], rates_source: str) -> str:
    """Rank 0's line: the budget, each run of layers with one choice, the estimates and the rates."""
    from fsdp_offload_cfg.estimate.plan import layer_runs

    choices = "; ".join((f"layers {a}-{b}" if a != b else f"layer {a}") + f": {c.replace('_', ' + ')}"
                        for a, b, c in layer_runs(plan.choices))
    extra = plan.extra_seconds / plan.compute_seconds if plan.compute_seconds else 0.0
    return (f"activation_memory_budget {show_size(plan.budget_bytes)} at {shape[0]} x {shape[1]} tokens per rank: "
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


def _host_group() -> Any:
    """The group the planner's per-forward agreement runs over: gloo, so that a few integers never
    round-trip through the device (on NCCL that would stall the host on the device every step).
    Its own group on every backend, gloo included, so that the CPU tests run the GPU's path. Made
    at prepare, where every rank is; None without a process group of several ranks."""
    from fsdp_offload_cfg.loading._sync import distributed_ready

    return dist.new_group(backend="gloo") if distributed_ready() else None


def _largest_over_ranks(shape: tuple[int, int] | None, group: Any) -> tuple[int, int] | None:
    """The largest batch and the longest sequence of any rank, the same on every rank; None where
    any rank has none."""
    from fsdp_offload_cfg.loading._sync import distributed_ready

    if not distributed_ready():
        return shape
    values = torch.tensor([*(shape or (0, 0)), int(shape is None)], dtype=torch.int64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    batch, tokens, missing = values.tolist()
    return None if missing else (batch, tokens)


def _slowest_over_ranks(rates: tuple[float, float], group: Any) -> tuple[float, float]:
    """Each rate's minimum over the ranks."""
    from fsdp_offload_cfg.loading._sync import distributed_ready

    if not distributed_ready():
        return rates
    values = torch.tensor(rates, dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)
    return float(values[0]), float(values[1])


def _agreed(what: str, fn: Any) -> Any:
    """`fn()` on every rank, raised on every rank if it failed on any (`_sync.agreed`)."""
    from fsdp_offload_cfg.loading._sync import agreed, distributed_ready

    return agreed(what, fn) if distributed_ready() else fn()


def _transformers_model(model: nn.Module) -> nn.Module | None:
    """The transformers model inside `model` (itself, or under PEFT and wrappers)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def _takes_use_cache(model: nn.Module) -> bool:
    """The transformers model inside `model` takes `use_cache` (decoders do; wrappers pass it on)."""
    import inspect

    pretrained = _transformers_model(model)  # its class's forward: the instance's is the offload's wrapper
    return pretrained is not None and "use_cache" in inspect.signature(type(pretrained).forward).parameters


def _original_class(model: nn.Module) -> type[nn.Module]:
    """The model's own class (FSDP2 swaps in a subclass named `FSDP<class>`)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def _compute_dtype(model: nn.Module, cfg: FSDPOffloadConfig) -> torch.dtype:
    """The dtype this run computes activations in: the config's mixed precision (one rule with
    the estimate, `config.derived`), else the parameters' own."""
    mixed = mixed_compute_dtype(cfg)
    if mixed is not None:
        return getattr(torch, mixed)
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
