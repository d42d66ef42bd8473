"""transformers: loading (`from_pretrained`, `_from_config`, `resize_token_embeddings`) and the
Trainer's `fsdp_config` as a config source."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from fsdp_offload_cfg import registry
from fsdp_offload_cfg._logging import is_rank0
from fsdp_offload_cfg.config import ConfigError, FSDPOffloadConfig, load_config, read_config_file
from fsdp_offload_cfg.integrations.common import (
    accelerator_state_exists,
    enable_offload,
    ensure_process_group,
    fsdp2_prepare_needed,
    fsdp_requested,
    loader_enabled,
    log_active,
    logger,
    rank0_loading_active,
    without_framework_keys,
)
from fsdp_offload_cfg.loading.resize import build_resize_token_embeddings
from fsdp_offload_cfg.registry import LaunchContext, Patch
from fsdp_offload_cfg.saving import build_checkpoint_folder, build_save_final_model, build_save_pretrained


def build_from_pretrained(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    @functools.wraps(original)
    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("distributed_config") is not None:
            return _shard_on_read(original, cfg, cls, *args, **kwargs)
        if not rank0_loading_active(cfg):
            return original(cls, *args, **kwargs)
        if kwargs.get("tp_plan") is not None:
            return _tensor_parallel_read(original, cls, *args, **kwargs)
        from fsdp_offload_cfg.loading import auto_from_pretrained, rank0_from_pretrained, sharded_from_pretrained
        from fsdp_offload_cfg.loading.quantized import refuse_quantized

        refuse_quantized(args[0] if args else kwargs.get("pretrained_model_name_or_path"), kwargs, cfg.source)
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
        enable_offload(model, cfg)
    if is_rank0():
        logger.info(
            "from_pretrained(distributed_config=...): transformers shards %s as it reads it; the rank-0 loader "
            "steps aside%s", cls.__name__, "; activation offload enabled on the sharded model" if offload else "",
        )  # fmt: skip
    return result


def _tensor_parallel_read(original: Callable[..., Any], cls: type, *args: Any, **kwargs: Any) -> Any:
    """`from_pretrained(tp_plan=...)` (accelerate's tensor + data parallelism, its ND-parallel
    example): transformers reads each rank's tensor-parallel slices itself, as DTensors on the
    tensor-parallel mesh. The meta loader would have built a different model: on transformers 5
    rank 0 read only its own slices and the other ranks were left on meta (then waited in a
    broadcast that did not match, or sent rank 0's half as the whole); on 4.x the plan was dropped
    and the model came back whole, not tensor-parallel. The loader steps aside; accelerate's
    prepare shards it over the data-parallel ranks as usual, activation offload included.
    transformers' RAM-efficient gate is off for the call, as for every load the loader makes."""
    from fsdp_offload_cfg.loading.local import transformers_fsdp_gate_off

    with transformers_fsdp_gate_off():
        result = original(cls, *args, **kwargs)
    if is_rank0():
        logger.info("from_pretrained(tp_plan=...): transformers reads each rank's tensor-parallel slices of %s "
                    "itself; the meta loader steps aside", args[0] if args else cls.__name__)  # fmt: skip
    return result


def build_from_config(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    @functools.wraps(original)
    def _from_config(cls: type, config: Any, **kwargs: Any) -> Any:
        if not rank0_loading_active(cfg):
            return original(cls, config, **kwargs)
        from fsdp_offload_cfg.loading import rank0_from_config

        ensure_process_group()
        return rank0_from_config(original, cls, config, **kwargs)

    return _from_config


def build_training_args_post_init(original: Callable[..., Any], cfg: FSDPOffloadConfig) -> Callable[..., Any]:
    """Validate `TrainingArguments.fsdp_config` with our schema and make it the active config.

    Runs before the original `__post_init__`, which sets up the device (and so the process group)
    before it even looks at `fsdp_config`: the CPU/gloo patches must already be in place then.
    This patch is config-free, so the switch leaves it (running here) installed.
    """

    @functools.wraps(original)
    def __post_init__(self: Any) -> Any:  # noqa: N807 - replaces __post_init__
        if self.fsdp:
            _refuse_ms_swift_offloader(self)
            framework = type(self).__module__.split(".")[0]
            _hint_axolotl_plugin(framework)
            _adopt_trainer_config(self.fsdp, self.fsdp_config, framework)
        return original(self)

    return __post_init__


def _refuse_ms_swift_offloader(args: Any) -> None:
    """ms-swift's TrainingArguments turn on ms-swift's own activation offloader for the unprefixed
    `activation_cpu_offload` in `fsdp_config` (`swift/trainers/arguments.py`), the key this plugin
    reads too. Its hooks wrap each layer's forward inside ours, so the runtime check of
    `offload/collisions.py` cannot see them and ours would move nothing (on a CPU machine its pinned
    buffers crash first). Refused here, on every rank, before any model exists."""
    fsdp_config = args.fsdp_config
    if not type(args).__module__.startswith("swift.") or not isinstance(fsdp_config, dict):
        return
    if fsdp_config.get("activation_cpu_offload", False):
        raise ConfigError(
            "ms-swift --fsdp JSON: fsdp_config.activation_cpu_offload turns on both ms-swift's own activation "
            "offloader (its ActivationCpuOffloadCallBack) and fsdp_offload_cfg's: two offloaders on one model, one of "
            "which would move nothing. For this plugin's offload spell the key fsdp_activation_cpu_offload (ms-swift "
            "leaves it alone); for ms-swift's, run without fsdp-offload-cfg.")


def _hint_axolotl_plugin(framework: str) -> None:
    """axolotl's schema drops the fsdp_config keys it does not know before its TrainingArguments
    see them; only the plugin entry reads the config as written (`plugins/axolotl.py`)."""
    plugin = sys.modules.get("fsdp_offload_cfg.plugins.axolotl")
    if framework != "axolotl" or (plugin is not None and plugin.registered()) or not is_rank0():
        return
    logger.warning("axolotl's TrainingArguments: axolotl drops the fsdp_config keys it does not know (load_strategy, "
                   "activation_cpu_offload, ...) before they reach them, so this run has only the rest; to use them "
                   "list fsdp_offload_cfg.integrations.axolotl.FsdpOffloadCfgPlugin under plugins: in the axolotl "
                   "config (docs/frameworks.md)")  # fmt: skip


def _adopt_trainer_config(fsdp: Any, fsdp_config: Any, framework: str) -> None:
    """Errors name `TrainingArguments` (and the file, for a path); the session's source says
    `TrainingArguments.fsdp_config`. Keys the framework whose TrainingArguments these are adds
    itself (axolotl's `final_state_dict_type`, ...) are its own, not typos of ours."""
    name, source = "TrainingArguments", "TrainingArguments.fsdp_config"
    if isinstance(fsdp_config, (str, os.PathLike)):
        path = os.fspath(fsdp_config)
        name, source = f"TrainingArguments(fsdp_config={path!r})", f"{source} ({path})"
        fsdp_config = read_config_file(path)
    fsdp_config = without_framework_keys(dict(fsdp_config or {}), framework)
    trainer_cfg = load_config({"fsdp": fsdp, "fsdp_config": fsdp_config}, name=name)
    session = registry.active()
    if session is None or session.config == trainer_cfg:
        return
    if accelerator_state_exists():  # a second TrainingArguments (a framework's copy, an eval run) mid-run
        if is_rank0():
            logger.warning("%s differs from the active config (%s), but an Accelerator already runs with that "
                           "one: keeping it. Pass the same fsdp_config to every TrainingArguments.", source,
                           session.source)  # fmt: skip
        return
    assert session.replan is not None, "a session made by patch() knows how it was planned"
    log_active(registry.switch(session.replan(dataclasses.replace(trainer_cfg, source=source), source)))


def _always(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    return True


def _fsdp(cfg: FSDPOffloadConfig, ctx: LaunchContext) -> bool:
    return fsdp_requested(cfg)


def _sharded_read_swaps(cfg: FSDPOffloadConfig) -> list[tuple[str, str]]:
    """The transformers functions the no-read load (every strategy) swaps while `from_pretrained` runs."""
    from fsdp_offload_cfg.compat.checkpoint_reading import swap_targets

    return swap_targets()


_REQUIRES = ("torch", "transformers")
PATCHES = [
    Patch("loader-from-pretrained", "transformers.modeling_utils", "PreTrainedModel.from_pretrained",
          build_from_pretrained, loader_enabled, _REQUIRES,
          "every rank builds on meta; each reads its own slices, or rank 0 sends them (load_strategy)",
          swaps=_sharded_read_swaps, lazy=True),
    Patch("rank0-from-config", "transformers.modeling_utils", "PreTrainedModel._from_config",
          build_from_config, loader_enabled, _REQUIRES, "rank 0 initialises from config; other ranks build on meta",
          lazy=True),
    Patch("resize-token-embeddings", "transformers.modeling_utils", "PreTrainedModel.resize_token_embeddings",
          build_resize_token_embeddings, loader_enabled, _REQUIRES,
          "resizing a loader-built model's embeddings: the shape on every rank, the values from rank 0", lazy=True),
    Patch("save-pretrained-sharded", "transformers.modeling_utils", "PreTrainedModel.save_pretrained",
          build_save_pretrained, fsdp2_prepare_needed, _REQUIRES,
          "save_pretrained of a model accelerate sharded (FSDP2) gathers it and writes it on rank 0 (transformers 5 "
          "stopped: invalid python storage)", lazy=True),
    Patch("trainer-checkpoint-folder", "transformers.trainer", "Trainer.save_model", build_checkpoint_folder, _fsdp,
          _REQUIRES, "the checkpoint's folder exists on every rank before the Trainer names the best checkpoint "
          "(sharded state dicts: the ranks named, and loaded, different ones)", lazy=True),
    Patch("trainer-final-model", "transformers.trainer", "Trainer.save_model", build_save_final_model, _fsdp,
          _REQUIRES, "trainer.save_model(dir) under a sharded state dict writes the model from_pretrained reads "
          "(stock wrote nothing); a PEFT model's saves gather its adapters alone", lazy=True),
    Patch("trainer-fsdp-config", "transformers.training_args", "TrainingArguments.__post_init__",
          build_training_args_post_init, _always, _REQUIRES,
          "validate the Trainer's fsdp_config and apply its plugin keys", config_free=True, lazy=True),
]
