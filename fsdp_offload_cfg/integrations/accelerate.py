"""accelerate: FSDP2 on a CPU-only machine (gloo), `fsdp2_prepare_model` (dtype groups, the loader's
fill, activation offload), the optimizer remapping of meta parameters, FSDP1's offload."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import re
import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fsdp_offload_cfg import registry, training_cache, vision_sync
from fsdp_offload_cfg._logging import is_rank0
from fsdp_offload_cfg._script import this_script_command
from fsdp_offload_cfg.budget import enable_budget, wrap_layers
from fsdp_offload_cfg.compat.ignored_modules import ignored_modules_sharded_anyway
from fsdp_offload_cfg.config import FSDPOffloadConfig
from fsdp_offload_cfg.integrations.common import (
    built_by_loader,
    cpu_fsdp_needed,
    enable_offload,
    fill_through_loader,
    fill_whole,
    frozen_reshards_after_forward,
    fsdp2_prepare_needed,
    fsdp_requested,
    fully_shard_swap,
    load_through_loader,
    loader_enabled,
    logger,
    stock_loading_off,
)
from fsdp_offload_cfg.layer_classes import defaults_per_model, present_classes_only
from fsdp_offload_cfg.registry import LaunchContext, Patch
from fsdp_offload_cfg.saving import build_accelerator_save_model
from fsdp_offload_cfg.shard_groups import fsdp2_groups


def build_partial_state_init(original: Callable[..., None], cfg: FSDPOffloadConfig) -> Callable[..., None]:
    """Force `cpu=True` so the process group comes up on gloo instead of `distributed_type NO`."""

    @functools.wraps(original)
    def __init__(self: Any, cpu: bool = False, **kwargs: Any) -> None:  # noqa: N807 - replaces __init__
        original(self, cpu or cpu_fsdp_needed(cfg, LaunchContext.from_environ()), **kwargs)

    return __init__


def build_accelerator_state_init(original: Callable[..., None], cfg: FSDPOffloadConfig) -> Callable[..., None]:
    """Promote `MULTI_CPU` to `FSDP` with the plugin, exactly as accelerate does for GPUs."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - replaces __init__
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType

        # accelerate's state is a shared singleton: only promote on the call that builds it
        was_initialized = bool(self._shared_state) and self.initialized
        original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        plugin = bound.arguments.get("fsdp_plugin")
        if was_initialized or plugin is None or self.distributed_type != DistributedType.MULTI_CPU:
            return
        if not cpu_fsdp_needed(cfg, LaunchContext.from_environ()):
            return
        self.distributed_type = DistributedType.FSDP
        if self._mixed_precision != "no":
            plugin.set_mixed_precision(self._mixed_precision)
        _unpin_cpu_offload(plugin)
        self.fsdp_plugin = plugin
        # MULTI_CPU reports `cpu:<local rank>`; FSDP1 rejects a device_id that differs from the
        # parameters' plain `cpu`, and there is only one CPU device anyway.
        self.device = torch.device("cpu")
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        PartialState._shared_state["device"] = self.device
        logger.debug("promoted MULTI_CPU to FSDP (gloo) for a CPU-only run")

    return __init__


def _unpin_cpu_offload(plugin: Any) -> None:
    """`CPUOffloadPolicy()` pins host memory, which needs CUDA: FSDP2 crashes allocating shards."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    if isinstance(plugin.cpu_offload, CPUOffloadPolicy) and plugin.cpu_offload.pin_memory:
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)


def build_flat_param_to_cpu(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    """FSDP1's `offload_to_cpu` on parameters already on the CPU: stay where they are.

    A full state dict under FSDP1 (accelerate's `get_state_dict`, the Trainer's
    `FULL_STATE_DICT` saves, `save_fsdp_model`) asks for `offload_to_cpu=True`, and torch's
    `FlatParamHandle.to_cpu` moves the gathered flat parameter to the CPU, then frees the
    gathered copy. On the CPU the move returns the same storage, so the free leaves the flat
    parameter on freed memory: the state dict read it, and the process died of SIGSEGV (rank 0
    with `rank0_only`, every rank without). Where the compute device is the CPU there is nothing
    to move, and the context does nothing."""

    @functools.wraps(original)
    def to_cpu(self: Any) -> Any:
        return contextlib.nullcontext() if self.device.type == "cpu" else original(self)

    return to_cpu


def build_set_state_dict_type(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    """FSDP1 on the CPU: an optimizer state dict's `offload_to_cpu` becomes the copy it means.

    Gathering a full optimizer state dict (`FULL_STATE_DICT`: accelerate's plugin asks for
    `offload_to_cpu=True`), torch unflattens each gathered state as a view of one buffer and
    offloads it with `.cpu()`, where it would otherwise clone it; on the CPU `.cpu()` is that
    view, and the next state gathered into the buffer overwrote it. The saved `exp_avg` held other
    values, and a run resumed from that checkpoint diverged at its second step. Without
    `offload_to_cpu` torch clones each state; on the CPU that is the same result, safely."""

    @functools.wraps(original)
    def set_state_dict_type(module: Any, state_dict_type: Any, state_dict_config: Any = None,
                            optim_state_dict_config: Any = None) -> Any:  # fmt: skip
        if getattr(optim_state_dict_config, "offload_to_cpu", False) and _computes_on_the_cpu(module):
            optim_state_dict_config = dataclasses.replace(optim_state_dict_config, offload_to_cpu=False)
        return original(module, state_dict_type, state_dict_config, optim_state_dict_config)

    return set_state_dict_type


def _computes_on_the_cpu(module: Any) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    devices = {getattr(m, "compute_device", None) for m in FullyShardedDataParallel.fsdp_modules(module)}
    return devices == {torch.device("cpu")}


def _fsdp1_on_the_cpu(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    return cpu_fsdp_needed(cfg, ctx) and cfg.version == 1


@contextmanager
def _ignored_modules_kept_on_meta() -> Iterator[None]:
    """accelerate (1.13 and later) moves each module `ignored_modules` names to the device with
    `module.to(device)` as it collects their parameters; on a loader-built model, on meta, that
    raised "Cannot copy out of meta tensor" on every rank. (accelerate 1.16's own meta loading keeps
    them on meta for the same reason.) For the call, a module on meta stays there: FSDP leaves its
    parameters whole, and the loader fills them on every rank as it fills buffers."""
    import accelerate.utils.fsdp_utils as fsdp_utils

    from fsdp_offload_cfg.loading.spec import meta_tensor_names

    original = getattr(fsdp_utils, "get_parameters_from_modules", None)
    if original is None:  # accelerate 1.10: FSDP2 shards ignored modules anyway (compat.ignored_modules)
        yield
        return

    @functools.wraps(original)
    def get_parameters_from_modules(modules: Any, model: torch.nn.Module, device: Any = None) -> set[Any]:
        if isinstance(modules, str):
            pattern = re.compile(modules)
            modules = [m for name, m in model.named_modules() if pattern.fullmatch(name)]
        modules = list(modules or ())
        for module in modules:
            if device is not None and not meta_tensor_names(module):
                module.to(device)
        return {p for m in modules for p in m.parameters()}

    fsdp_utils.get_parameters_from_modules = get_parameters_from_modules
    try:
        yield
    finally:
        fsdp_utils.get_parameters_from_modules = original


_SAID_IGNORED = "_fsdp_offload_cfg_said_ignored_modules"  # on the plugin: said once a run, not at every prepare


def _say_ignored_modules_are_sharded(plugin: Any, cfg: FSDPOffloadConfig) -> None:
    """accelerate 1.10 takes `fsdp_ignored_modules` and shards the modules it names under FSDP2
    like the rest (`compat.ignored_modules`): the user asked for them whole, so rank 0 says so."""
    if getattr(plugin, "ignored_modules", None) is None or getattr(plugin, _SAID_IGNORED, False) or not is_rank0():
        return
    message = ignored_modules_sharded_anyway(f"{cfg.source}: fsdp_ignored_modules")
    if message:
        setattr(plugin, _SAID_IGNORED, True)
        logger.warning(message)


_OURS = "_fsdp_offload_cfg_prepare"  # marks the fsdp2_prepare_model this module built
_preparing = 0  # depth of our fsdp2_prepare_model calls: a framework's copy that calls ours inside ours runs as itself


def build_fsdp2_prepare_model(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    """accelerate's `fsdp2_prepare_model` (or a framework's copy of it) with our steps around it:
    each layer wrapped for a budget's plan, the loader's shard-and-fill (or accelerate's own
    sharding, one `fully_shard` group per dtype), then the offload or the budget's plan."""
    @functools.wraps(original)
    def fsdp2_prepare_model(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule

        global _preparing
        if isinstance(model, FSDPModule) or _preparing:
            return original(accelerator, model)
        _preparing += 1
        try:
            return _prepare(original, accelerator, model, cfg)
        finally:
            _preparing -= 1

    fsdp2_prepare_model.__dict__[_OURS] = True
    return fsdp2_prepare_model


def _prepare(original: Callable[..., Any], accelerator: Any, model: torch.nn.Module, cfg: FSDPOffloadConfig) -> Any:
    plugin = accelerator.state.fsdp_plugin
    _say_ignored_modules_are_sharded(plugin, cfg)
    budget = cfg.activation_memory_budget is not None  # bytes or auto
    if budget:
        wrap_layers(model, cfg)
    if fill_through_loader(model, plugin, cfg):

        def shard(m: torch.nn.Module) -> torch.nn.Module:
            with stock_loading_off(plugin), _ignored_modules_kept_on_meta(), fsdp2_groups(m):
                return original(accelerator, m)

        model = load_through_loader(model, shard, plugin, cfg)
    else:
        with fsdp2_groups(model):
            model = original(accelerator, model)
    frozen_reshards_after_forward(model)
    if budget:
        registry.on_uninstall(enable_budget(model, cfg).remove)  # `unpatch()` takes the plan away
    elif cfg.activation_cpu_offload.enabled:
        enable_offload(model, cfg)
    _vision_on_every_rank(model)
    return model


def build_prepare(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    """`Accelerator.prepare` under FSDP2 takes a model without an optimizer, to evaluate it.

    accelerate up to 1.15 refuses one ("When using FSDP2, a model and optimizer must be passed
    together"), and transformers' Trainer passes one: `trainer.evaluate()` or `predict()` before
    `train()` stops there (transformers #39961 and #48841). accelerate 1.16 takes it itself; the
    patch keeps every version alike and says when FSDP is not running. The model is prepared as for
    training (checkpointing, sharding, the loader, the offload), with no optimizer to remap;
    when it comes back with its optimizer (the Trainer's `train()`, the optimizer built on the
    sharded parameters), only the optimizer is new: checkpointing is not applied a second time.

    An `Accelerator` that runs without FSDP though the config asks for it (a process no launcher
    started) prepares as stock, and rank 0 says that none of fsdp_config applies."""

    @functools.wraps(original)
    def prepare(self: Any, *args: Any, device_placement: Any = None) -> Any:
        if not self.is_fsdp2:
            _say_fsdp_is_not_running(self, cfg)
            return original(self, *args, device_placement=device_placement)
        again = any(_prepared_before(obj) for obj in args)
        if again:
            _optimizers_on_sharded_parameters(args)
        with _checkpointing_done(self.state.fsdp_plugin) if again else contextlib.nullcontext():
            if _model_alone(self, args):
                (model,) = self._prepare_fsdp2(args[0])  # what prepare does, less the optimizer check
                model._is_accelerate_prepared = True
                return model
            return original(self, *args, device_placement=device_placement)

    return prepare


_SAID = "_fsdp_offload_cfg_said_fsdp_is_off"


def _say_fsdp_is_not_running(accelerator: Any, cfg: FSDPOffloadConfig) -> None:
    """The config asks for FSDP, but the `Accelerator` preparing runs without it: nothing of
    fsdp_config (sharding, meta loading, the offload, the budget) applies, and rank 0's line at
    `patch()` said it was on. `FSDP_OFFLOAD_CFG=fsdp2.yaml python train.py` (or `patch("F")`
    run with plain `python`) does this: accelerate reads a config file only in `accelerate
    launch`, and a process no launcher started runs alone (`distributed_type NO`). The run goes
    on as the user started it; the warning says what it is and how to start what they asked for."""
    if getattr(accelerator, _SAID, False) or not is_rank0():
        return
    setattr(accelerator, _SAID, True)  # once: each model and each prepare of the run would say it again
    started = ""
    if not LaunchContext.from_environ().distributed:
        file = f"--config_file {shlex.quote(cfg.source)} " if os.path.isfile(cfg.source) else ""
        started = (f": this process was started without a launcher, and accelerate reads a config file only in "
                   f"`accelerate launch`; start it as `accelerate launch {file}{this_script_command()}` (--num_processes 1 "
                   "for one process), or under torchrun")
    logger.warning("%s asks for FSDP%d, but the Accelerator preparing the model runs without it (distributed_type "
                   "%s, %d process%s), so nothing of its fsdp_config applies: no sharding, meta loading, activation "
                   "offload or budget%s", cfg.source, cfg.version, accelerator.distributed_type.value,
                   accelerator.num_processes, "" if accelerator.num_processes == 1 else "es", started)


def _model_alone(accelerator: Any, args: tuple[Any, ...]) -> bool:
    """One model and nothing else, on plain FSDP2. (Tensor and context parallelism and FP8 change
    the model in `prepare` itself, before `_prepare_fsdp2`: left to accelerate, which refuses.)"""
    parallel = getattr(accelerator, "parallelism_config", None)
    other = parallel is not None and (parallel.tp_enabled or parallel.cp_enabled)
    fp8 = getattr(accelerator.fp8_backend, "value", "NO") != "NO"
    return len(args) == 1 and isinstance(args[0], torch.nn.Module) and not other and not fp8


def _prepared_before(obj: Any) -> bool:
    """`obj` is a model accelerate prepared (sharded) already. (Marked on the model: the Trainer
    empties the Accelerator's list of models at the start of `train()`.)"""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(obj, torch.nn.Module) and getattr(obj, "_is_accelerate_prepared", False) \
        and isinstance(getattr(obj, "_orig_mod", obj), FSDPModule)


def _optimizers_on_sharded_parameters(args: tuple[Any, ...]) -> None:
    """An optimizer built on a prepared model after a forward without backward (an evaluation
    first: the Trainer's `evaluate()` before `train()`, or a loop's) holds the parameters FSDP2
    left gathered there: the root unit does not reshard after its forward (`reshard_after_forward`
    is off at the root, since backward would gather it again at once), so the root's registered
    parameters are its gathered copies then, a Llama's final norm and output head. Each optimizer
    step updated those copies and the next all-gather overwrote them: those weights never trained
    (accelerate 1.14 and later; 1.13 left the root resharded). transformers 5.24's Trainer
    reshards before it builds its optimizer; earlier 5.x Trainers (5.20.2 measured) and loops do
    not. Here every unit is resharded and each optimizer's gathered copies are replaced by the
    sharded parameters registered under the same names (the optimizer holds no state yet: it has
    not stepped before `prepare`)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    optimizers = [o for o in args if isinstance(o, torch.optim.Optimizer)]
    models = [m for m in args if isinstance(m, torch.nn.Module) and isinstance(getattr(m, "_orig_mod", m), FSDPModule)]
    for model in models if optimizers else []:
        gathered = {id(p): name for name, p in model.named_parameters() if not isinstance(p, DTensor)}
        if not gathered:
            continue
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        registered = dict(model.named_parameters())
        sharded = {pid: registered[name] for pid, name in gathered.items() if isinstance(registered.get(name), DTensor)}
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [sharded.get(id(p), p) for p in group["params"]]


@contextmanager
def _checkpointing_done(plugin: Any) -> Iterator[None]:
    """accelerate applies activation checkpointing in every `_prepare_fsdp2`; on a model prepared
    before, it would wrap each checkpointed layer in a second checkpoint (two recomputes)."""
    before = plugin.activation_checkpointing
    plugin.activation_checkpointing = False
    try:
        yield
    finally:
        plugin.activation_checkpointing = before


def build_prepare_model_eval_copy(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    """`Accelerator.prepare_model(model, evaluation_mode=True)` shards nothing under FSDP: every
    rank keeps a whole copy (TRL's GRPO and RLOO reward models, GKD's teacher). A model the
    loader built is on meta there, and the `model.to(device)` inside read it tensor by tensor,
    warning on every rank, or, under "broadcast", failed on every rank but 0 ("Cannot copy out of
    meta tensor") while rank 0 went on into the next collective. Here it is filled whole first,
    on every rank, as a plain load gives it: each rank reads what it can, rank 0 sends the rest."""

    @functools.wraps(original)
    def prepare_model(self: Any, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        if evaluation_mode and built_by_loader(model):
            model = fill_whole(model, cfg)
        return original(self, model, device_placement, evaluation_mode)

    return prepare_model


def build_prepare_model(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    """FSDP1: accelerate wraps (and checkpoints) the model inside `prepare_model`. After it: the
    offload, no KV cache in a forward with gradients of a checkpointed model (`training_cache`),
    and the vision tower on every rank (`vision_sync`)."""

    @functools.wraps(original)
    def prepare_model(self: Any, model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        from accelerate.utils import DistributedType

        prepared = original(self, model, *args, **kwargs)
        if self.distributed_type == DistributedType.FSDP and self.state.fsdp_plugin.fsdp_version == 1:
            if cfg.activation_cpu_offload.enabled:
                enable_offload(prepared, cfg)
            if self.state.fsdp_plugin.activation_checkpointing:
                _cache_off_in_training(prepared)
            _vision_on_every_rank(prepared)
        return prepared

    return prepare_model


def build_prepare_fsdp2(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    """`Accelerator._prepare_fsdp2`, which calls `fsdp2_prepare_model` on each model:

    - its `fsdp2_prepare_model` is ours even where a framework replaced accelerate's with its own
      copy after `patch()` (axolotl does, when it loads the model): for the call, ours wraps
      theirs, else a loader-built model would reach their copy still on meta, and neither the
      loader nor the offload would run;
    - accelerate maps each old parameter to its sharded replacement by `data_ptr()`; every meta
      tensor reports 0, so all optimizer slots would collapse onto one parameter on ranks != 0.
      Meta parameters get a distinct negative id for the duration of the call;
    - a model accelerate checkpoints builds no KV cache in a forward with gradients
      (`training_cache`).
    """

    @functools.wraps(original)
    def _prepare_fsdp2(self: Any, *args: Any) -> Any:
        tagged = [p for obj in args if isinstance(obj, torch.nn.Module) for p in obj.parameters() if p.is_meta]
        for p in tagged:
            p.data_ptr = functools.partial(int, -id(p))  # type: ignore[method-assign]
        try:
            with _ours_outermost(cfg):
                result = original(self, *args)
        finally:
            for p in tagged:
                p.__dict__.pop("data_ptr", None)
        if self.state.fsdp_plugin.activation_checkpointing:
            for obj in result:
                if isinstance(obj, torch.nn.Module):
                    _cache_off_in_training(obj)
        return result

    return _prepare_fsdp2


def _vision_on_every_rank(model: torch.nn.Module) -> None:
    """A sharded vision-language model runs its vision tower on every rank when any rank's batch
    has images (`vision_sync`)."""
    hooked = vision_sync.sync_vision(model)
    if hooked is not None:
        registry.on_uninstall(lambda: vision_sync.remove(hooked))


def _cache_off_in_training(model: torch.nn.Module) -> None:
    """accelerate checkpointed `model`: its training forwards build no KV cache (`training_cache`)."""
    hooked = training_cache.cache_off_in_training(model)
    if hooked is not None:
        registry.on_uninstall(lambda: training_cache.remove(hooked))


_said_replaced: set[str] = set()  # whose copy rank 0 has named already: once per process, not per prepare


@contextmanager
def _ours_outermost(cfg: FSDPOffloadConfig) -> Iterator[None]:
    import accelerate.accelerator as module

    theirs = module.fsdp2_prepare_model
    if getattr(theirs, _OURS, False):
        yield
        return
    where = f"{getattr(theirs, '__module__', '?')}.{getattr(theirs, '__qualname__', theirs)}"
    if is_rank0() and where not in _said_replaced:
        _said_replaced.add(where)
        logger.info("accelerate's fsdp2_prepare_model was replaced after patch() (by %s): ours runs around it", where)
    module.fsdp2_prepare_model = build_fsdp2_prepare_model(theirs, cfg)
    try:
        yield
    finally:
        module.fsdp2_prepare_model = theirs


def build_set_auto_wrap_policy(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    """`FullyShardedDataParallelPlugin.set_auto_wrap_policy` reads only the default layer classes
    the model has (`layer_classes`). It is the first reader on every path: FSDP1's prepare, FSDP2's
    `_prepare_fsdp2` before activation checkpointing, `fsdp2_prepare_model`, TRL's `prepare_fsdp`;
    it keeps the list on the plugin, where `fsdp2_prepare_auto_wrap_policy` reads it after, and
    where the next model's call would read it as the user's (`defaults_per_model`)."""

    @functools.wraps(original)
    def set_auto_wrap_policy(self: Any, model: torch.nn.Module) -> Any:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(getattr(model, "_orig_mod", model), FSDPModule):
            return None  # sharded already (prepared before): nothing left to wrap, and its classes are FSDP<name>
        with defaults_per_model(self), present_classes_only(self, model, cfg.source, cfg.transformer_layer_cls_to_wrap):
            return original(self, model)

    return set_auto_wrap_policy


def _fsdp(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    return fsdp_requested(cfg)


def _fsdp1(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    return fsdp_requested(cfg) and cfg.version == 1


_REQUIRES = ("torch", "accelerate")
PATCHES = [
    Patch("cpu-fsdp-state", "accelerate.state", "PartialState.__init__", build_partial_state_init,
          cpu_fsdp_needed, _REQUIRES, "bring the process group up on gloo when FSDP is asked for without a GPU"),
    Patch("cpu-fsdp-accelerator-state", "accelerate.state", "AcceleratorState.__init__",
          build_accelerator_state_init, cpu_fsdp_needed, _REQUIRES,
          "promote MULTI_CPU to FSDP so accelerate runs FSDP2 on the CPU"),
    Patch("cpu-fsdp1-state-dict", "torch.distributed.fsdp._flat_param", "FlatParamHandle.to_cpu",
          build_flat_param_to_cpu, _fsdp1_on_the_cpu, ("torch",),
          "FSDP1 on the CPU: a full state dict's offload_to_cpu leaves the parameters where they are (torch freed "
          "the storage it had just moved to: SIGSEGV)"),
    Patch("cpu-fsdp1-optim-state-dict", "torch.distributed.fsdp.fully_sharded_data_parallel",
          "FullyShardedDataParallel.set_state_dict_type", build_set_state_dict_type, _fsdp1_on_the_cpu, ("torch",),
          "FSDP1 on the CPU: a full optimizer state dict is cloned, not 'offloaded' as views of a reused buffer "
          "(saved exp_avg values were overwritten)"),
    Patch("prepare-model-alone", "accelerate.accelerator", "Accelerator.prepare", build_prepare, fsdp2_prepare_needed,
          _REQUIRES, "a model prepared without an optimizer (the Trainer's evaluate() or predict() before train()) "
          "is sharded as for training, where accelerate refused it; an Accelerator running without FSDP (a process "
          "no launcher started) says on rank 0 that none of fsdp_config applies"),
    Patch("prepare-fsdp2", "accelerate.accelerator", "Accelerator._prepare_fsdp2", build_prepare_fsdp2,
          fsdp2_prepare_needed, _REQUIRES, "keep optimizer remapping right for meta parameters; run our "
          "fsdp2_prepare_model around a framework's copy installed after patch() (axolotl's); no KV cache in "
          "forwards with gradients of a model accelerate checkpoints"),
    Patch("fsdp2-prepare-model", "accelerate.accelerator", "fsdp2_prepare_model", build_fsdp2_prepare_model,
          fsdp2_prepare_needed, _REQUIRES,
          "one fully_shard group per dtype; with meta loading, shard on meta and fill params + all buffers "
          "(read by each rank or sent by rank 0); with activation offload, enable it; with activation_memory_budget, "
          "wrap each layer for its plan, made at the first training forward", swaps=fully_shard_swap),
    # Frameworks call it directly (LlamaFactory's DPO reference model, TRL, ms-swift):
    Patch("fsdp2-prepare-model-utils", "accelerate.utils.fsdp_utils", "fsdp2_prepare_model",
          build_fsdp2_prepare_model, fsdp2_prepare_needed, _REQUIRES, "the same, for direct calls",
          swaps=fully_shard_swap),
    Patch("fsdp2-prepare-model-utils-export", "accelerate.utils", "fsdp2_prepare_model",
          build_fsdp2_prepare_model, fsdp2_prepare_needed, _REQUIRES, "the same, for `accelerate.utils.` calls",
          swaps=fully_shard_swap),
    Patch("accelerator-save-model", "accelerate.accelerator", "Accelerator.save_model", build_accelerator_save_model,
          fsdp2_prepare_needed, _REQUIRES, "accelerator.save_model(model, dir) of a model sharded by fully_shard "
          "writes stock's files with rank 0 holding one gathered weight at a time (stock gathered the whole model "
          "there first)"),
    Patch("default-layer-classes", "accelerate.utils.dataclasses", "FullyShardedDataParallelPlugin.set_auto_wrap_policy",
          build_set_auto_wrap_policy, _fsdp, _REQUIRES, "TRANSFORMER_BASED_WRAP without layer classes wraps the "
          "_no_split_modules classes the model has (transformers 5 also lists sub-model classes it does not build)"),
    Patch("prepare-model-eval-copy", "accelerate.accelerator", "Accelerator.prepare_model",
          build_prepare_model_eval_copy, loader_enabled, _REQUIRES, "a loader-built model that prepare_model keeps "
          "whole on every rank (evaluation_mode=True: TRL's reward models, GKD's teacher) is filled whole there"),
    Patch("fsdp1-prepare-model", "accelerate.accelerator", "Accelerator.prepare_model",
          build_prepare_model, _fsdp1, _REQUIRES, "enable activation offload on FSDP1 models; a model "
          "accelerate checkpoints builds no KV cache in forwards with gradients"),
]
