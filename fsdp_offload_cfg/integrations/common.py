"""What every target's patches share: what the config asks for, the environment accelerate and
transformers read, filling a loader-built model at prepare (accelerate's `fsdp2_prepare_model`
and TRL's `prepare_fsdp` alike), turning the activation offload on, and rank 0's line saying
what is active.

Predicates take the config and the `LaunchContext`; nothing here patches anything.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fsdp_offload_cfg import registry
from fsdp_offload_cfg._logging import get_logger, is_rank0
from fsdp_offload_cfg.compat import allocator
from fsdp_offload_cfg.config import FSDPOffloadConfig, env_values
from fsdp_offload_cfg.layer_classes import transformers_model
from fsdp_offload_cfg.offload.stats import summarize_offload_at_exit
from fsdp_offload_cfg.registry import LaunchContext
from fsdp_offload_cfg.shard_groups import swap_target

logger = get_logger("fsdp_offload_cfg.integrations")


# fsdp_config keys a framework adds to the ones accelerate and transformers know, which it acts on
# itself and passes on to the Trainer's `fsdp_config` (where our schema would refuse them as
# typos): the framework's own, left to it. Keyed by the top-level package of its TrainingArguments
# class. axolotl 0.19: `utils/schemas/fsdp.py`.
FRAMEWORK_FSDP_KEYS = {
    "axolotl": ("cpu_offload_pin_memory", "final_state_dict_type", "mixed_precision_policy"),
}


def without_framework_keys(fsdp_config: dict, framework: str) -> dict:
    """`fsdp_config` minus the keys `framework` adds (either spelling)."""
    theirs = FRAMEWORK_FSDP_KEYS.get(framework, ())
    return {k: v for k, v in fsdp_config.items() if str(k).removeprefix("fsdp_") not in theirs}


def fsdp_requested(cfg: FSDPOffloadConfig) -> bool:
    """accelerate's `distributed_type: FSDP` (or a Trainer `fsdp` setting) in the config."""
    return (cfg.distributed_type or "").upper() == "FSDP"


def cpu_fsdp_needed(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    """FSDP asked for, several processes, on the CPU: stock accelerate would silently drop FSDP.

    On the CPU means no GPU, or `use_cpu` (`accelerate launch --cpu`) on a machine with one:
    accelerate then brings the group up on gloo as MULTI_CPU, as it does without a GPU."""
    return fsdp_requested(cfg) and ctx.distributed and (not ctx.accelerator or bool(cfg.use_cpu))


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


EXPANDABLE_SEGMENTS_TEXT = ("the CUDA allocator makes expandable segments in each process, so that reserved memory "
                            "stays near allocated (fsdp_expandable_segments: false keeps torch's default)")


def offload_requested(cfg: FSDPOffloadConfig) -> bool:
    """The activation offload, or a budget's plan, runs under this config (prepare enables them)."""
    budget = cfg.activation_memory_budget is not None and cfg.version == 2
    return fsdp_requested(cfg) and (cfg.activation_cpu_offload.enabled or budget)


def expandable_segments_wanted(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    """Turn the CUDA allocator's expandable segments on in this process (`compat.allocator` says
    why): by default where the offload runs, on a CUDA device, and the user has set no allocator
    variable; `expandable_segments: true` also without the offload, unless the user's variable
    says otherwise (the launch's environment wins over the file)."""
    if not ctx.cuda_allocator or cfg.use_cpu or cfg.expandable_segments is False:
        return False
    user = allocator.user_variable(registry.environ_before_patching())
    if cfg.expandable_segments is None:
        return user is None and offload_requested(cfg)
    return user is None or allocator.stated_expandable(user[1]) is None


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
    if cfg.debug:
        env["ACCELERATE_DEBUG_MODE"] = "true"
    if cfg.enable_cpu_affinity:
        env["ACCELERATE_CPU_AFFINITY"] = "1"
    return {**env, **launch_sections_env(cfg)}


# The variable `accelerate launch` always sets when it exports a section: set, the launch did.
_SECTION_MARKERS = {"parallelism_config": "ACCELERATE_USE_PARALLELISM_CONFIG",
                    "dynamo_config": "ACCELERATE_DYNAMO_BACKEND"}


def launch_sections_env(cfg: FSDPOffloadConfig) -> dict[str, str]:
    """The file's `parallelism_config` and `dynamo_config` sections as `accelerate launch` exports
    them: the PARALLELISM_CONFIG_* and ACCELERATE_DYNAMO_* variables an `Accelerator` built without
    those arguments reads.

    Under torchrun (`fsdp-offload-cfg run --config F -- torchrun ...`) or `patch("F")` in a plain
    script nobody exported them: a file asking for HSDP ran as plain FSDP, one asking for
    compilation ran eagerly, without a word. A section is not exported where a launch already
    exported it: its values are the file's with its command line over them (accelerate's order).
    Only the keys the file gives: accelerate reads the same defaults for the others."""
    before = registry.environ_before_patching()
    env = {}
    if cfg.parallelism_config and _SECTION_MARKERS["parallelism_config"] not in before:
        env["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"
        env.update({str(k).upper(): str(v) for k, v in cfg.parallelism_config.items()})
    if cfg.dynamo_config and _SECTION_MARKERS["dynamo_config"] not in before:
        for key, value in cfg.dynamo_config.items():
            name = str(key).removeprefix("dynamo_").upper()
            env[f"ACCELERATE_DYNAMO_{name}"] = str(value).upper() if name == "BACKEND" else str(value)
    return env


def ensure_process_group() -> None:
    """Bring the process group up through accelerate (gloo on CPU) if the script has not yet."""
    import torch.distributed as dist

    if not dist.is_initialized():
        from accelerate.state import PartialState

        PartialState()


def rank0_loading_active(cfg: FSDPOffloadConfig) -> bool:
    from fsdp_offload_cfg.loading.local import rank0_loading_wanted

    return loader_enabled(cfg) and LaunchContext.from_environ().distributed and rank0_loading_wanted()


def enable_offload(model: torch.nn.Module, cfg: FSDPOffloadConfig) -> None:
    """Offload on a model the patches prepared; `unpatch()` removes it again (and with the last
    handle, the dynamo registration the offload makes)."""
    from fsdp_offload_cfg.offload import enable_activation_offload

    registry.on_uninstall(enable_activation_offload(model, cfg.activation_cpu_offload).remove)
    summarize_offload_at_exit()


def accelerator_state_exists() -> bool:
    """An `Accelerator` (accelerate's shared `AcceleratorState`) was built in this process: it has
    read its settings, so patches and config can no longer change under it."""

    state = sys.modules.get("accelerate.state")
    return state is not None and bool(state.AcceleratorState._shared_state)


def fsdp2_prepare_needed(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    """Every FSDP2 run: besides loading and offload, prepare keeps ties in one group and gives
    odd-dtype modules their own (`shard_groups`), which stock accelerate needs as much with the
    loader off."""
    return fsdp_requested(cfg) and cfg.version == 2


def fully_shard_swap(cfg: FSDPOffloadConfig) -> list[tuple[str, str]]:
    return [swap_target()]


def log_active(session: registry.PatchSession) -> None:
    """Rank 0's one line when a config becomes active: where it came from, what it does, the patches."""
    if not is_rank0():
        return
    cfg = session.config
    if not fsdp_requested(cfg):
        found = "" if session.source.startswith("no config found") else "config from "  # not "config from no config"
        logger.info("%s%s; patches: %s", found, session.source, ", ".join(session.patch_names) or "none")
        return
    loading = cfg.load_strategy if loader_enabled(cfg) else "off"
    offload = "on" if cfg.activation_cpu_offload.enabled else "off"
    if cfg.activation_memory_budget is not None and cfg.version == 2:
        offload = f"planned per layer to activation_memory_budget {cfg.activation_memory_budget} at the first forward"
    logger.info("config from %s (FSDP%d%s, meta loading: %s, activation offload: %s); patches: %s", session.source,
                cfg.version, _parallelism_text(session), loading, offload, ", ".join(session.patch_names) or "none")  # fmt: skip
    user = allocator.user_variable(registry.environ_before_patching())
    if cfg.expandable_segments and user is not None and allocator.stated_expandable(user[1]) is False:
        logger.warning("fsdp_config.expandable_segments is true and %s=%s says otherwise: the variable wins, as a "
                       "launch's environment wins over the file", *user)  # fmt: skip


def _parallelism_text(session: registry.PatchSession) -> str:
    """The file's `parallelism_config` and `dynamo_config` where this session exported them (no
    launch had): the line says what the job gets, which it silently did not before."""
    parts = []
    for section, prefix in (("parallelism_config", "parallelism_config_"), ("dynamo_config", "dynamo_")):
        if _SECTION_MARKERS[section] in session.env_before:
            values = getattr(session.config, section).items()
            parts.append(f", {section} " + ", ".join(f"{str(k).removeprefix(prefix)} {v}" for k, v in values))
    return "".join(parts)


def fill_through_loader(model: torch.nn.Module, plugin: Any, cfg: FSDPOffloadConfig) -> bool:
    """Shard and fill `model` with `load_into_sharded` (else accelerate's own prepare)?

    Yes for a model the loader built (on meta on some ranks: only the loader can fill it, whatever
    the switches say now), and for any model when both the plugin and the config ask for
    RAM-efficient loading (it also keeps persistent buffers, which accelerate's path crashes on).
    One decision for all ranks: it is followed by collectives on one path or the other.
    """
    asked = bool(plugin.cpu_ram_efficient_loading and cfg.cpu_ram_efficient_loading)
    built = _on_any_rank(_built_here(model))
    if asked and not built:
        _say_it_came_whole(model, cfg)
    return built or asked


def _say_it_came_whole(model: torch.nn.Module, cfg: FSDPOffloadConfig) -> None:
    """Rank 0's warning when meta loading is on but the model reached prepare whole on other
    ranks too, so every rank held the whole model, which is what meta loading exists to avoid (on
    by default under `accelerate launch`) and stock accelerate says nothing. On every rank (a
    collective): the ranks' models differ. What the line says depends on how it came whole
    (`_how_it_came_whole`)."""
    from fsdp_offload_cfg._sizes import show_size
    from fsdp_offload_cfg.loading.spec import meta_tensor_names, named_tensors
    from fsdp_offload_cfg.ranks import every_rank, named_ranks

    whole = not meta_tensor_names(model)
    held = sum(t.nbytes for _, t in named_tensors(model)) if whole else 0
    gathered = every_rank([int(whole), held])  # one process: [[whole, held]], no rank above 0
    ranks = [r for r, (w, _) in enumerate(gathered) if r > 0 and w]
    if not ranks or not is_rank0():
        return
    name = type(model).__name__
    logger.warning("%s reached prepare whole on %s though meta loading is on (cpu_ram_efficient_loading): %s",
                   name, named_ranks(ranks), _how_it_came_whole(model, cfg, show_size(max(h for _, h in gathered))))


def _how_it_came_whole(model: torch.nn.Module, cfg: FSDPOffloadConfig, size: str) -> str:
    """The cause and the fix for the script's shape. A transformers model was loaded before the
    config was active (the Trainer's shape: `from_pretrained` before the `TrainingArguments` that
    bring the config, or before `patch()`), or built by its class's constructor, which no loader
    sees. A model of the user's own code (a torch module) has no loader at all: its ranks but 0
    build it on meta, and prepare fills their shards from rank 0's (a model real on every rank
    keeps each rank's own shard, as without meta loading: `sharded.agree_sources`)."""
    name = type(model).__name__
    if transformers_model(model) is None:
        return (f"{name} is not a transformers model, so no loader built it: each of those ranks held the whole "
                f"model ({size}) besides rank 0, and prepare shards each rank's own copy, as without meta loading. To "
                f'hold it on rank 0 alone, build it on meta on the other ranks: `with torch.device("meta") if not '
                f"accelerator.is_main_process else contextlib.nullcontext(): model = {name}(...)`; prepare then fills "
                f"their shards from rank 0's.")
    after = ("TrainingArguments(fsdp_config=...), which bring the config" if cfg.source.startswith("TrainingArguments")
             else "fsdp_offload_cfg.patch(), outside local_loading()")
    return (f"it was loaded before the config was active, or built by its class ({name}(config)), which no loader "
            f"sees, so each of those ranks held the whole model ({size}) besides rank 0. Load it with from_pretrained "
            f"or from_config after {after}: a model loaded then stays on meta until prepare fills its shards.")


def built_by_loader(model: torch.nn.Module) -> bool:
    """`model` (or what it wraps) came out of the loader, on any rank: one answer on every rank."""
    return _on_any_rank(_built_here(model))


def _built_here(model: torch.nn.Module) -> bool:
    from fsdp_offload_cfg.loading import is_rank0_source

    return any(is_rank0_source(m) for m in model.modules())


def _on_any_rank(flag: bool) -> bool:
    from fsdp_offload_cfg.ranks import any_rank, distributed_ready

    return any_rank(flag) if distributed_ready() else flag


def fill_whole(model: torch.nn.Module, cfg: FSDPOffloadConfig) -> torch.nn.Module:
    """Fill a loader-built model that stays whole on every rank (nothing shards it), as a plain
    load gives it: `load_into_sharded` with no sharding, so each rank reads what its record
    backs and rank 0 sends the rest, as it does for shards."""
    from fsdp_offload_cfg.loading import load_into_sharded

    if is_rank0():
        logger.info("%s is kept whole on every rank (accelerate's prepare_model with evaluation_mode=True shards "
                    "nothing): filling it whole on each", type(model).__name__)
    return load_into_sharded(model, lambda m: m, strategy=cfg.load_strategy).model


def load_through_loader(
    model: torch.nn.Module, shard: Callable[[torch.nn.Module], Any], plugin: Any, cfg: FSDPOffloadConfig
) -> Any:
    """`load_into_sharded` with `shard` as its shard function, the config's strategy, and the
    plugin's CPU offload (accelerate's prepare and TRL's `prepare_fsdp` alike)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from fsdp_offload_cfg.loading import load_into_sharded

    cpu_offload = isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    return load_into_sharded(model, shard, strategy=cfg.load_strategy, cpu_offload=cpu_offload).model


@contextmanager
def stock_loading_off(plugin: Any) -> Iterator[None]:
    """For a call that shards a loader-built model: accelerate's own meta path (and its copies',
    axolotl's) would broadcast rank 0's meta tensors, and crashes on persistent buffers; the
    loader fills the model instead."""
    saved = plugin.cpu_ram_efficient_loading
    plugin.cpu_ram_efficient_loading = False
    try:
        yield
    finally:
        plugin.cpu_ram_efficient_loading = saved


def frozen_reshards_after_forward(model: torch.nn.Module) -> None:
    """A model with nothing to train (a reference model, a teacher, a reward model) runs forwards
    under `no_grad` and never a backward, and FSDP2 reshards after backward what it keeps gathered
    from a forward for it. So what a unit keeps stays gathered for the rest of the run, on every
    rank: accelerate 1.14+'s final norm and output head (its `tail` group, `reshard_after_forward=
    False`) and root (PyTorch's root heuristic), a Llama-3-8B's head 0.98 GiB of bf16 beside a 0.12
    GiB shard on 8 ranks; under `reshard_after_forward: false`, every layer: the whole model. Each
    unit of a frozen model reshards after its forward instead (a forward under grad, if one comes,
    gathers again for its backward, as FSDP2 does for any resharded unit)."""
    if not any(p.requires_grad for p in model.parameters()):
        reshard_every_unit_after_forward(model)


def reshard_every_unit_after_forward(model: torch.nn.Module) -> None:
    """Every FSDP2 unit in `model` reshards after its forward (`frozen_reshards_after_forward`;
    TRL's `prepare_fsdp`, which shards only models it does not train, whether or not their
    parameters ask for gradients: its reference models keep `requires_grad`)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_reshard_after_forward(True, recurse=False)
