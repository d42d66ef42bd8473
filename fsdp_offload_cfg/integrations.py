"""The patches themselves: what each replacement does to accelerate and transformers.

Each builder takes the original callable and the validated config and returns the replacement;
each predicate takes the config and the `LaunchContext`. `PATCHES` order is application order.
Replacements stay thin: the real work lives in `fsdp_offload_cfg.loading` and
`fsdp_offload_cfg.offload`. `plan_for` is what a config needs here, checks included.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fsdp_offload_cfg import registry
from fsdp_offload_cfg._logging import get_logger, is_rank0
from fsdp_offload_cfg.config import ConfigError, FSDPOffloadConfig, env_values, load_config, read_config_file
from fsdp_offload_cfg.dtype_groups import one_dtype_per_group, swap_target
from fsdp_offload_cfg.loading.adapters import build_inject_adapter
from fsdp_offload_cfg.loading.resize import build_resize_token_embeddings
from fsdp_offload_cfg.registry import LaunchContext, Patch

logger = get_logger("fsdp_offload_cfg.integrations")

# --------------------------------------------------------------------------------------------
# What the config asks for
# --------------------------------------------------------------------------------------------


def fsdp_requested(cfg: FSDPOffloadConfig) -> bool:
    """accelerate's `distributed_type: FSDP` (or a Trainer `fsdp` setting) in the config."""
    return (cfg.distributed_type or "").upper() == "FSDP"


def cpu_fsdp_needed(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    """FSDP asked for, several processes, no GPU: stock accelerate would silently drop FSDP."""
    return fsdp_requested(cfg) and not ctx.accelerator and ctx.distributed


def environment_problems(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> list[str]:
    """Config valid on paper but not runnable on this machine: say so before anything starts."""
    problems = []
    if cpu_fsdp_needed(cfg, ctx) and cfg.version == 1 and cfg.sync_module_states:
        problems.append(
            f"{cfg.source}: fsdp_config.sync_module_states: FSDP1 on a CPU-only machine cannot sync module "
            "states (accelerate needs a GPU for it); set fsdp_sync_module_states: false (and "
            "fsdp_cpu_ram_efficient_loading: false), or use fsdp_version: 2"
        )
    return problems


def loader_enabled(cfg: FSDPOffloadConfig, ctx: LaunchContext | None = None) -> bool:
    return fsdp_requested(cfg) and cfg.cpu_ram_efficient_loading and cfg.version == 2


def plan_for(cfg: FSDPOffloadConfig, source: str, ctx: LaunchContext) -> registry.Plan:
    """The patches and environment `cfg` needs in `ctx`, after every check that can refuse it."""
    problems = environment_problems(cfg, ctx)
    if problems:
        raise ConfigError("\n".join(problems))
    return registry.plan(cfg, source, PATCHES, ctx, accelerate_env(cfg, ctx))


# --------------------------------------------------------------------------------------------
# Environment accelerate and transformers read
# --------------------------------------------------------------------------------------------


def accelerate_env(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> dict[str, str]:
    """The variables `accelerate launch` would export for this config (what transformers gates on),
    plus the plugin's own keys, so that processes this one starts read the same config
    (`config.config_from_env` reads them all back)."""
    if not fsdp_requested(cfg):
        return {}
    env = {"ACCELERATE_USE_FSDP": "true", **env_values(cfg)}
    if cfg.mixed_precision is not None:
        env["ACCELERATE_MIXED_PRECISION"] = cfg.mixed_precision
    if cpu_fsdp_needed(cfg, ctx):
        env["ACCELERATE_USE_CPU"] = "true"
    return env


# --------------------------------------------------------------------------------------------
# FSDP2 on a CPU-only machine (gloo)
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Loading: rank 0 reads, the others build on meta
# --------------------------------------------------------------------------------------------

def ensure_process_group() -> None:
    """Bring the process group up through accelerate (gloo on CPU) if the script has not yet."""
    import torch.distributed as dist

    if not dist.is_initialized():
        from accelerate.state import PartialState

        PartialState()


def _rank0_loading_active(cfg: FSDPOffloadConfig) -> bool:
    from fsdp_offload_cfg.loading.local import rank0_loading_wanted

    return loader_enabled(cfg) and LaunchContext.from_environ().distributed and rank0_loading_wanted()


def build_from_pretrained(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    @functools.wraps(original)
    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("distributed_config") is not None:
            return _shard_on_read(original, cfg, cls, *args, **kwargs)
        if not _rank0_loading_active(cfg):
            return original(cls, *args, **kwargs)
        from fsdp_offload_cfg.loading import auto_from_pretrained, rank0_from_pretrained, sharded_from_pretrained

        ensure_process_group()
        load = {"sharded": sharded_from_pretrained, "broadcast": rank0_from_pretrained}.get(
            cfg.load_strategy, auto_from_pretrained)
        return load(original, cls, *args, **kwargs)

    return from_pretrained


def _shard_on_read(original: Callable[..., Any], cfg: FSDPOffloadConfig, cls: type, *args: Any, **kwargs: Any) -> Any:
    """transformers 5.19+ `from_pretrained(distributed_config=...)`: each rank reads its own slices
    and transformers applies FSDP2 itself (the Trainer then skips accelerate's prepare). Nothing
    is left for the loader to do, so it steps aside; activation offload, normally enabled in
    prepare, is enabled here on the sharded model. transformers' RAM-efficient gate is off for the
    call: on 5.16 it also fills other ranks' shards with `zeros_like` on this path (wrong weights)."""
    from fsdp_offload_cfg.loading.local import transformers_fsdp_gate_off

    with transformers_fsdp_gate_off():
        result = original(cls, *args, **kwargs)
    model = result[0] if isinstance(result, tuple) else result
    offload = cfg.activation_cpu_offload.enabled and isinstance(model, torch.nn.Module)
    if offload:
        _enable_offload(model, cfg)
    if is_rank0():
        logger.info(
            "from_pretrained(distributed_config=...): transformers shards %s as it reads it; the rank-0 loader "
            "steps aside%s", cls.__name__, "; activation offload enabled on the sharded model" if offload else "",
        )  # fmt: skip
    return result


def build_from_config(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    @functools.wraps(original)
    def _from_config(cls: type, config: Any, **kwargs: Any) -> Any:
        if not _rank0_loading_active(cfg):
            return original(cls, config, **kwargs)
        from fsdp_offload_cfg.loading import rank0_from_config

        ensure_process_group()
        return rank0_from_config(original, cls, config, **kwargs)

    return _from_config


# --------------------------------------------------------------------------------------------
# accelerate's prepare: sharded load from rank 0, then activation offload
# --------------------------------------------------------------------------------------------


@contextmanager
def _stock_loading_off(plugin: Any) -> Iterator[None]:
    """accelerate's own meta path crashes on persistent buffers; ours replaces it for the call."""
    saved = plugin.cpu_ram_efficient_loading
    plugin.cpu_ram_efficient_loading = False
    try:
        yield
    finally:
        plugin.cpu_ram_efficient_loading = saved


def build_fsdp2_prepare_model(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    @functools.wraps(original)
    def fsdp2_prepare_model(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule

        plugin = accelerator.state.fsdp_plugin
        if isinstance(model, FSDPModule):
            return original(accelerator, model)
        if _fill_through_loader(model, plugin, cfg):

            def shard(m: torch.nn.Module) -> torch.nn.Module:
                with _stock_loading_off(plugin), one_dtype_per_group(m):
                    return original(accelerator, m)

            model = _load_through_loader(model, shard, plugin, cfg)
        else:
            with one_dtype_per_group(model):
                model = original(accelerator, model)
        if cfg.activation_cpu_offload.enabled:
            _enable_offload(model, cfg)
        return model

    return fsdp2_prepare_model


def _fill_through_loader(model: torch.nn.Module, plugin: Any, cfg: FSDPOffloadConfig) -> bool:
    """Shard and fill `model` with `load_into_sharded` (else accelerate's own prepare)?

    Yes for a model the loader built (on meta on some ranks: only the loader can fill it, whatever
    the switches say now), and for any model when both the plugin and the config ask for
    RAM-efficient loading (it also keeps persistent buffers, which accelerate's path crashes on).
    One decision for all ranks: it is followed by collectives on one path or the other.
    """
    from fsdp_offload_cfg.loading import is_rank0_source
    from fsdp_offload_cfg.loading._sync import any_rank, distributed_ready

    wanted = any(is_rank0_source(m) for m in model.modules()) or bool(
        plugin.cpu_ram_efficient_loading and cfg.cpu_ram_efficient_loading
    )
    return any_rank(wanted) if distributed_ready() else wanted


def _load_through_loader(
    model: torch.nn.Module, shard: Callable[[torch.nn.Module], Any], plugin: Any, cfg: FSDPOffloadConfig
) -> Any:
    from torch.distributed.fsdp import CPUOffloadPolicy

    from fsdp_offload_cfg.loading import load_into_sharded

    cpu_offload = isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    return load_into_sharded(model, shard, strategy=cfg.load_strategy, cpu_offload=cpu_offload).model


def build_trl_prepare_fsdp(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    """TRL shards reference and teacher models itself (`prepare_fsdp`: `fully_shard` and `eval()`),
    not through accelerate's prepare; a model the loader built is filled the same way here."""

    @functools.wraps(original)
    def prepare_fsdp(model: torch.nn.Module, accelerator: Any) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule

        plugin = accelerator.state.fsdp_plugin

        def shard(m: torch.nn.Module) -> torch.nn.Module:
            with one_dtype_per_group(m):
                return original(m, accelerator)

        if isinstance(model, FSDPModule) or plugin.fsdp_version != 2 or not _fill_through_loader(model, plugin, cfg):
            return shard(model)
        return _load_through_loader(model, shard, plugin, cfg)

    return prepare_fsdp


def _trl_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def _peft_adapters_needed(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    """The loader builds meta models and PEFT (which would move new adapters onto them) is there."""
    import importlib.util

    return loader_enabled(cfg) and importlib.util.find_spec("peft") is not None


def _enable_offload(model: torch.nn.Module, cfg: FSDPOffloadConfig) -> None:
    """Offload on a model the patches prepared; `unpatch()` removes it again (and with the last
    handle, the dynamo registration the offload makes)."""
    from fsdp_offload_cfg.offload import enable_activation_offload

    registry.on_uninstall(enable_activation_offload(model, cfg.activation_cpu_offload).remove)
    _summarize_offload_at_exit()


@functools.cache
def _summarize_offload_at_exit() -> None:
    """Once per process: rank 0 says at exit what the activation offload moved (registered by the
    first model the patches enable it on)."""
    import atexit

    def summary() -> None:
        from fsdp_offload_cfg.offload import offload_stats

        stats = offload_stats()
        if is_rank0():
            logger.info("activation offload moved %.2f GiB to the host (%d tensors) and %.2f GiB back; pinned host "
                        "pool peaked at %.2f GiB", stats["offloaded_bytes"] / 2**30, stats["offloaded_tensors"],
                        stats["reloaded_bytes"] / 2**30, stats["pinned_pool_peak_bytes"] / 2**30)  # fmt: skip

    atexit.register(summary)


def build_prepare_model(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    """FSDP1: accelerate wraps the model inside `prepare_model`; hook the offload after it."""

    @functools.wraps(original)
    def prepare_model(self: Any, model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        from accelerate.utils import DistributedType

        prepared = original(self, model, *args, **kwargs)
        if self.distributed_type == DistributedType.FSDP and self.state.fsdp_plugin.fsdp_version == 1:
            _enable_offload(prepared, cfg)
        return prepared

    return prepare_model


def build_prepare_fsdp2(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    """Keep accelerate's optimizer remapping correct when parameters are still on `meta`.

    accelerate maps each old parameter to its sharded replacement by `data_ptr()`; every meta
    tensor reports 0, so all optimizer slots would collapse onto one parameter on ranks != 0.
    Give meta parameters a distinct negative id for the duration of the call.
    """

    @functools.wraps(original)
    def _prepare_fsdp2(self: Any, *args: Any) -> Any:
        tagged = [p for obj in args if isinstance(obj, torch.nn.Module) for p in obj.parameters() if p.is_meta]
        for p in tagged:
            p.data_ptr = functools.partial(int, -id(p))  # type: ignore[method-assign]
        try:
            return original(self, *args)
        finally:
            for p in tagged:
                p.__dict__.pop("data_ptr", None)

    return _prepare_fsdp2


# --------------------------------------------------------------------------------------------
# transformers Trainer: its `fsdp_config` is a config source too
# --------------------------------------------------------------------------------------------


def build_training_args_post_init(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    """Validate `TrainingArguments.fsdp_config` with our schema and make it the active config.

    Runs before the original `__post_init__`, which sets up the device (and so the process group)
    before it even looks at `fsdp_config`: the CPU/gloo patches must already be in place then.
    This patch is config-free, so the switch leaves it (running here) installed.
    """

    @functools.wraps(original)
    def __post_init__(self: Any) -> Any:  # noqa: N807 - replaces __post_init__
        if self.fsdp:
            _adopt_trainer_config(self.fsdp, self.fsdp_config)
        return original(self)

    return __post_init__


def _adopt_trainer_config(fsdp: Any, fsdp_config: Any) -> None:
    """Errors name `TrainingArguments` (and the file, for a path); the session's source says
    `TrainingArguments.fsdp_config`."""
    name, source = "TrainingArguments", "TrainingArguments.fsdp_config"
    if isinstance(fsdp_config, (str, os.PathLike)):
        path = os.fspath(fsdp_config)
        name, source = f"TrainingArguments(fsdp_config={path!r})", f"{source} ({path})"
        fsdp_config = read_config_file(path)
    trainer_cfg = load_config({"fsdp": fsdp, "fsdp_config": dict(fsdp_config or {})}, name=name)
    session = registry.active()
    if session is None or session.config == trainer_cfg:
        return
    if accelerator_state_exists():  # a second TrainingArguments (a framework's copy, an eval run) mid-run
        if is_rank0():
            logger.warning("%s differs from the active config (%s), but an Accelerator already runs with that "
                           "one: keeping it. Pass the same fsdp_config to every TrainingArguments.", source,
                           session.source)  # fmt: skip
        return
    log_active(registry.switch(plan_for(dataclasses.replace(trainer_cfg, source=source), source,
                                        LaunchContext.from_environ())))


def log_active(session: registry.PatchSession) -> None:
    """Rank 0's one line when a config becomes active: where it came from, what it does, the patches."""
    if not is_rank0():
        return
    cfg = session.config
    if not fsdp_requested(cfg):
        logger.info("config from %s; patches: %s", session.source, ", ".join(session.patch_names) or "none")
        return
    loading = cfg.load_strategy if loader_enabled(cfg) else "off"
    offload = "on" if cfg.activation_cpu_offload.enabled else "off"
    logger.info("config from %s (FSDP%d, meta loading: %s, activation offload: %s); patches: %s", session.source,
                cfg.version, loading, offload, ", ".join(session.patch_names) or "none")  # fmt: skip


def accelerator_state_exists() -> bool:
    """An `Accelerator` (accelerate's shared `AcceleratorState`) was built in this process: it has
    read its settings, so patches and config can no longer change under it."""
    import sys

    state = sys.modules.get("accelerate.state")
    return state is not None and bool(state.AcceleratorState._shared_state)


def _always(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    return True


def _offload_fsdp1(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    return fsdp_requested(cfg) and cfg.activation_cpu_offload.enabled and cfg.version == 1


def _fsdp2_prepare_needed(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    """Every FSDP2 run: besides loading and offload, prepare gives odd-dtype modules their own
    group (`dtype_groups`), which stock accelerate needs as much with the loader off."""
    return fsdp_requested(cfg) and cfg.version == 2


def _fully_shard_swap(cfg: FSDPOffloadConfig) -> list[tuple[str, str]]:
    return [swap_target()]


def _sharded_read_swaps(cfg: FSDPOffloadConfig) -> list[tuple[str, str]]:
    """The transformers functions the no-read load (every strategy) swaps while `from_pretrained` runs."""
    from fsdp_offload_cfg.compat.checkpoint_reading import swap_targets

    return swap_targets()


def _trl_prepare_needed(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    """Every FSDP2 run where TRL is installed: it fills loader-built models and splits dtype
    groups (lazy: TRL is patched when it is imported, never imported by `patch()`)."""
    return _fsdp2_prepare_needed(cfg, ctx) and _trl_installed()


def _patches() -> list[Patch]:
    acc = ("torch", "accelerate")
    tf = ("torch", "transformers")
    return [
        Patch("cpu-fsdp-state", "accelerate.state", "PartialState.__init__", build_partial_state_init,
              cpu_fsdp_needed, acc, "bring the process group up on gloo when FSDP is asked for without a GPU"),
        Patch("cpu-fsdp-accelerator-state", "accelerate.state", "AcceleratorState.__init__",
              build_accelerator_state_init, cpu_fsdp_needed, acc,
              "promote MULTI_CPU to FSDP so accelerate runs FSDP2 on the CPU"),
        Patch("rank0-from-pretrained", "transformers.modeling_utils", "PreTrainedModel.from_pretrained",
              build_from_pretrained, loader_enabled, tf,
              "rank 0 reads the checkpoint (or, sharded: every rank reads its own slices); others build on meta",
              swaps=_sharded_read_swaps),
        Patch("rank0-from-config", "transformers.modeling_utils", "PreTrainedModel._from_config",
              build_from_config, loader_enabled, tf, "rank 0 initialises from config; other ranks build on meta"),
        Patch("meta-optimizer-mapping", "accelerate.accelerator", "Accelerator._prepare_fsdp2",
              build_prepare_fsdp2, loader_enabled, acc, "keep optimizer remapping right for meta parameters"),
        Patch("fsdp2-prepare-model", "accelerate.accelerator", "fsdp2_prepare_model", build_fsdp2_prepare_model,
              _fsdp2_prepare_needed, acc,
              "one fully_shard group per dtype; with meta loading, shard on meta and fill params + all buffers "
              "(read by each rank or sent by rank 0); with activation offload, enable it", swaps=_fully_shard_swap),
        # Frameworks call it directly (LlamaFactory's DPO reference model, TRL, ms-swift):
        Patch("fsdp2-prepare-model-utils", "accelerate.utils.fsdp_utils", "fsdp2_prepare_model",
              build_fsdp2_prepare_model, _fsdp2_prepare_needed, acc, "the same, for direct calls",
              swaps=_fully_shard_swap),
        Patch("fsdp2-prepare-model-utils-export", "accelerate.utils", "fsdp2_prepare_model",
              build_fsdp2_prepare_model, _fsdp2_prepare_needed, acc, "the same, for `accelerate.utils.` calls",
              swaps=_fully_shard_swap),
        # Lazy: patch() never imports TRL (or PEFT); the replacement goes in as soon as the module
        # is imported, before TRL's trainers bind it (`from ..models import prepare_fsdp`).
        Patch("trl-prepare-fsdp", "trl.models.utils", "prepare_fsdp", build_trl_prepare_fsdp,
              _trl_prepare_needed, acc,
              "fill loader-built reference/teacher models that TRL shards itself; one group per dtype",
              swaps=_fully_shard_swap, lazy=True),
        Patch("resize-token-embeddings", "transformers.modeling_utils", "PreTrainedModel.resize_token_embeddings",
              build_resize_token_embeddings, loader_enabled, tf,
              "resizing a loader-built model's embeddings: the shape on every rank, the values from rank 0"),
        Patch("peft-adapters-on-host", "peft.tuners.tuners_utils", "BaseTuner.inject_adapter",
              build_inject_adapter, _peft_adapters_needed, ("torch",),
              "new PEFT adapters on a meta base keep the values PEFT drew (on the host) instead of moving to meta",
              lazy=True),
        Patch("fsdp1-activation-offload", "accelerate.accelerator", "Accelerator.prepare_model",
              build_prepare_model, _offload_fsdp1, acc, "enable activation offload on FSDP1 models"),
        Patch("trainer-fsdp-config", "transformers.training_args", "TrainingArguments.__post_init__",
              build_training_args_post_init, _always, tf, "validate the Trainer's fsdp_config and apply its plugin keys",
              config_free=True),
    ]


PATCHES = _patches()
