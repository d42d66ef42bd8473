"""TRL: reference and teacher models TRL shards itself (`prepare_fsdp`), and axolotl's replacement
of it. Lazy: `patch()` never imports TRL or axolotl; each replacement goes in as soon as its module
is imported, before TRL's trainers bind it (`from ..models import prepare_fsdp`) and before axolotl
installs its own into TRL."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from fsdp_offload_cfg import model_state
from fsdp_offload_cfg._logging import get_logger, is_rank0
from fsdp_offload_cfg.config import FSDPOffloadConfig
from fsdp_offload_cfg.integrations.common import (
    fill_through_loader,
    fsdp2_prepare_needed,
    fully_shard_swap,
    load_through_loader,
    offload_requested,
    reshard_every_unit_after_forward,
    stock_loading_off,
)
from fsdp_offload_cfg.registry import LaunchContext, Patch
from fsdp_offload_cfg.shard_groups import fsdp2_groups

logger = get_logger("fsdp_offload_cfg.integrations")


def build_trl_prepare_fsdp(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    """TRL shards reference and teacher models itself (`prepare_fsdp`: `fully_shard` and `eval()`),
    not through accelerate's prepare; a model the loader built is filled the same way here.

    TRL's FSDP2 branch shards the root alone: one unit, so the reference model's every forward
    (DPO's reference log-probs, a GKD teacher's logits) gathers the whole model at once, in the
    compute dtype, on every rank (a Llama-3-8B: 15 GiB of bf16 beside the policy's step). Its
    layers are sharded first here (`_shard_layers`), each with TRL's own settings, so a forward
    gathers one layer at a time as the policy's does; the root then takes what is left, as in TRL."""
    return _filled_and_resharded(original, cfg, layers_sharded_by_original=False)


def build_axolotl_prepare_fsdp(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    """axolotl (0.19, under `rl:`) replaces TRL's `prepare_fsdp` with its own, which shards through
    its copy of accelerate's `fsdp2_prepare_model` (each layer, then the root). It goes into TRL
    after ours, past it: a reference model the loader built (DPO's second load) reached axolotl's
    copy still on meta, and every rank stopped ("still on the meta device"). Replaced where axolotl
    defines it, ours is what axolotl installs into TRL (its `patch_trl_prepare_fsdp2` reads the
    name from its module): the loader fills the model, axolotl's copy shards it with its own
    loading off (it would broadcast rank 0's meta tensors), and every unit reshards after its
    forward, as under TRL's."""
    return _filled_and_resharded(original, cfg, layers_sharded_by_original=True)


def _filled_and_resharded(original: Callable[..., Any], cfg: FSDPOffloadConfig,
                          layers_sharded_by_original: bool) -> Callable[..., Any]:
    """A `prepare_fsdp(model, accelerator)` whose sharding is `original`'s (after ours of each
    layer, unless `original` shards them itself), a loader-built model filled through it."""

    @functools.wraps(original)
    def prepare_fsdp(model: torch.nn.Module, accelerator: Any) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule

        plugin = accelerator.state.fsdp_plugin

        def shard(m: torch.nn.Module) -> torch.nn.Module:
            with fsdp2_groups(m):
                if plugin.fsdp_version == 2 and not layers_sharded_by_original:
                    _shard_layers(m, accelerator)
                return original(m, accelerator)

        def shard_for_the_loader(m: torch.nn.Module) -> torch.nn.Module:
            with stock_loading_off(plugin):
                return shard(m)

        if isinstance(model, FSDPModule) or plugin.fsdp_version != 2 or not fill_through_loader(model, plugin, cfg):
            model = shard(model)
        else:
            model = load_through_loader(model, shard_for_the_loader, plugin, cfg)
        if plugin.fsdp_version == 2:  # TRL prepares here only models it does not train
            reshard_every_unit_after_forward(model)
        return model

    return prepare_fsdp


def _shard_layers(model: torch.nn.Module, accelerator: Any) -> None:
    """`fully_shard` on each layer accelerate's auto-wrap policy picks for `model` (its own default
    classes, or the ones listed), bottom-up as accelerate's `fsdp2_prepare_model` does, with the
    settings TRL's `prepare_fsdp` gives its root. A model whose layers the policy cannot name (a
    teacher of another architecture than the listed classes), or a plugin with ignored modules
    (TRL alone knows which of its versions passes them), stays TRL's one unit."""
    from accelerate.utils import fsdp_utils
    from accelerate.utils.other import get_module_children_bottom_up
    from torch.distributed import fsdp

    plugin = accelerator.state.fsdp_plugin
    if plugin.ignored_modules:
        return
    try:
        plugin.set_auto_wrap_policy(model)
        policy = fsdp_utils.fsdp2_prepare_auto_wrap_policy(plugin, model)
    except ValueError as error:
        if is_rank0():
            logger.info("%s stays one FSDP unit, as TRL shards it: %s", type(model).__name__, error)
        return
    if policy is None:
        return
    mesh = getattr(accelerator, "torch_device_mesh", None)
    kwargs = {"reshard_after_forward": plugin.reshard_after_forward, "offload_policy": plugin.cpu_offload,
              "mp_policy": plugin.mixed_precision_policy or fsdp.MixedPrecisionPolicy(),
              "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None}
    for module in get_module_children_bottom_up(model)[:-1]:
        if policy(module) and not isinstance(module, fsdp.FSDPModule):
            fsdp.fully_shard(module, **kwargs)


def build_forward_redirection_call(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    """TRL's `_ForwardRedirection` (its distillation trainers) runs a method of the model in
    place of its forward: it swaps the model's `forward` for one that calls the method and calls
    the model. The offload's forward, which makes each call one pass of the offload, was swapped
    out with it: the student's layers ran outside any pass, and the offload moved nothing, without
    a word. The method now runs as the offload's forward runs. Where the method is the
    distillation loss, the head it runs is on the model for the length of the call
    (`model_state.loss_head`): an activation budget planning inside it counts that head, not the
    full logits of the model's own."""

    @functools.wraps(original)
    def __call__(self: Any, wrapper_module: torch.nn.Module, original_module: torch.nn.Module,  # noqa: N807
                 method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from fsdp_offload_cfg.offload import get_offload_handle

        handle = get_offload_handle(original_module)
        if handle is None or not handle.active:
            return original(self, wrapper_module, original_module, method, *args, **kwargs)
        model_state.put(original_module, "loss_head", distillation_head(method, args))
        try:
            return original(self, wrapper_module, original_module, functools.partial(handle.run_as_forward, method),
                            *args, **kwargs)
        finally:
            model_state.take(original_module, "loss_head")

    return __call__


def distillation_head(method: Callable[..., Any], args: tuple) -> Any:
    """The head of TRL's distillation loss when `method(*args)` is it
    (`DistillationTrainer._compute_loss(student, inputs, num_items_in_batch)`, its trainer holding
    the teacher): the divergence over the completion's positions against the teacher's hidden
    states (`estimate.heads.ChunkedDistillation`, without autocast: the budget adds its own); None
    for another method (the teacher's no-grad hidden states, another trainer's)."""
    from fsdp_offload_cfg.estimate.heads import ChunkedDistillation

    trainer = getattr(method, "__self__", None)
    teacher = getattr(trainer, "teacher_model", None)
    inputs = args[1] if len(args) > 1 else None
    if not isinstance(teacher, torch.nn.Module) or not isinstance(inputs, dict) or "completion_ids" not in inputs:
        return None
    teacher = trainer.accelerator.unwrap_model(teacher)
    text = teacher.config.get_text_config()
    completion = inputs["completion_ids"].size(1)
    total = completion + inputs["prompt_ids"].size(1)
    return ChunkedDistillation(min(completion, total - 1), text.hidden_size, next(teacher.parameters()).dtype)


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _trl_prepare_needed(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    """Every FSDP2 run where TRL is installed: it fills loader-built models and splits dtype
    groups (lazy: TRL is patched when it is imported, never imported by `patch()`)."""
    return fsdp2_prepare_needed(cfg, ctx) and _installed("trl")


def _axolotl_prepare_needed(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    return _trl_prepare_needed(cfg, ctx) and _installed("axolotl")


def _redirection_needed(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    return offload_requested(cfg) and _installed("trl")


PATCHES = [
    Patch("trl-prepare-fsdp", "trl.models.utils", "prepare_fsdp", build_trl_prepare_fsdp,
          _trl_prepare_needed, ("torch", "accelerate"),
          "reference/teacher models TRL shards itself: one unit per layer (TRL's is the whole model, gathered "
          "at once), loader-built ones filled, one group per dtype",
          swaps=fully_shard_swap, lazy=True),
    Patch("axolotl-trl-prepare-fsdp", "axolotl.monkeypatch.trainer.trl", "prepare_fsdp", build_axolotl_prepare_fsdp,
          _axolotl_prepare_needed, ("torch", "accelerate"),
          "the prepare_fsdp axolotl puts into TRL for RL: loader-built reference models filled, every unit "
          "resharded after its forward", lazy=True),
    Patch("trl-forward-redirection", "trl.models.utils", "_ForwardRedirection.__call__", build_forward_redirection_call,
          _redirection_needed, ("torch",), "a model method TRL runs in place of its forward (distillation) runs "
          "as the activation offload's forward", lazy=True),
]
