"""Rank 0 loads the checkpoint on the CPU; every other rank builds the same model on `meta`.

These are the bodies of the `PreTrainedModel.from_pretrained` and `_from_config` patches. They
are accelerate-independent: the caller decides whether the loader is on; here we only need a
process group. Why global rank 0 and not transformers' local rank 0: transformers reads the
checkpoint once per node, so N nodes hold N full copies in host memory; one reader is enough
because `load_into_sharded` sends every rank its shard anyway.

Protocol (every rank, in this order, so that no rank ever waits on a collective that another
rank skipped):
  1. rank 0 runs the original; the others wait for it through the process group's store (not in
     a collective, which would time out on a checkpoint that takes rank 0 longer to read than the
     process-group timeout);
  2. rank 0 broadcasts (error or None, what it built: config, `ModelSpec`, generation config);
     if rank 0 failed, every rank raises now, naming the cause;
  3. the other ranks build the model on `meta` from rank 0's config, then reshape it to rank 0's
     spec (dtypes incl. `_keep_in_fp32_modules`, ties), and all ranks agree that worked.
The non-zero ranks never open a weight file, and hold zero parameter or buffer bytes.
"""

from __future__ import annotations

import copy
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_offload_cfg.loading._sync import (
    attempt,
    broadcast_from_rank0,
    describe_error,
    distributed_ready,
    raise_if_any_failed,
    wait_for_rank0,
)
from fsdp_offload_cfg.loading.checkpoint import NeedsBroadcast, meta_from_pretrained
from fsdp_offload_cfg.loading.spec import ModelSpec, describe, mismatch, rebuild_on_meta

logger = logging.getLogger("fsdp_offload_cfg.loading")

SOURCE_ATTR = "_fsdp_offload_cfg_rank0_source"

# `from_pretrained` keyword arguments that configure loading, not the model's `__init__`
# (transformers 5.23: named parameters are added from the signature at call time).
_LOADING_KWARGS = frozenset(
    {
        "_commit_hash", "_from_auto", "_from_pipeline", "adapter_kwargs", "adapter_name", "allow_all_kernels",
        "attn_implementation", "device_map", "device_mesh", "distributed_config", "dtype",
        "experts_implementation", "generation_config", "gguf_file", "kernel_config", "key_mapping",
        "max_memory", "offload_buffers", "offload_folder", "output_loading_info", "proxies",
        "quantization_config", "state_dict", "subfolder", "torch_dtype", "tp_plan", "tp_size",
        "tqdm_class", "trust_remote_code", "use_kernels", "variant", "mirror", "_fast_init",
        "low_cpu_mem_usage", "from_tf", "from_flax", "offload_state_dict", "config",
        "pretrained_model_name_or_path",
    }
)  # fmt: skip

_local = threading.local()


@dataclass(frozen=True)
class _Rank0Built:
    """What rank 0 tells the others after a successful load (small; pickled)."""

    config: Any  # PreTrainedConfig
    spec: ModelSpec
    generation_config: Any
    loading_info: dict | None
    rng_state: torch.Tensor  # rank 0's CPU RNG state afterwards: all ranks continue alike


def is_rank0_source(model: nn.Module) -> bool:
    """True if `model` came out of `rank0_from_pretrained`/`rank0_from_config` (on any rank)."""
    return bool(getattr(model, SOURCE_ATTR, False))


def rank0_from_pretrained(original_from_pretrained: Callable[..., Any], cls: type, *args: Any, **kwargs: Any) -> Any:
    """`cls.from_pretrained(*args, **kwargs)` on global rank 0 only; a meta twin elsewhere.

    `original_from_pretrained` is the unpatched classmethod (bound or its `__func__`). Without a
    multi-rank process group, or when called from inside another patched call, this is exactly
    the original. `device_map` is dropped: rank 0 loads on the CPU and FSDP places the shards.
    """
    if not distributed_ready() or _inside():
        return _call(original_from_pretrained, cls, *args, **kwargs)
    source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    if kwargs.get("device_map") is not None:
        logger.info("rank-0 loading: ignoring device_map=%r (rank 0 loads on the CPU)", kwargs["device_map"])
    kwargs = {k: v for k, v in kwargs.items() if k != "device_map"}

    def load() -> Any:
        return _call(original_from_pretrained, cls, *args, **kwargs)

    def build(built: _Rank0Built) -> nn.Module:
        init_kwargs = _model_init_kwargs(original_from_pretrained, kwargs, built.config)
        return _build_on_meta(cls, built, args[1:], init_kwargs, kwargs.get("allow_all_kernels", False))

    return _rank0_or_meta(load, build, f"load {source}")


def sharded_from_pretrained(original_from_pretrained: Callable[..., Any], cls: type, *args: Any, **kwargs: Any) -> Any:
    """`cls.from_pretrained(*args, **kwargs)` for `load_strategy="sharded"`: EVERY rank, rank 0
    included, runs transformers' own `from_pretrained` with no weight read (`checkpoint.py`),
    so each holds a meta model that records which safetensors tensor fills which parameter.

    Every rank resolves and validates the checkpoint files itself; a failure on any rank raises
    on all of them (rank 0's cause first). When the checkpoint cannot be read slice by slice
    (not safetensors, keys fused or converted on load, ...) all ranks agree to fall back to
    `rank0_from_pretrained` and rank 0 logs one warning saying why.
    """
    if not distributed_ready() or _inside():
        return _call(original_from_pretrained, cls, *args, **kwargs)
    source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    if kwargs.get("device_map") is not None and dist.get_rank() == 0:
        logger.info("sharded loading: ignoring device_map=%r (FSDP places the shards)", kwargs["device_map"])
    plain_kwargs = {k: v for k, v in kwargs.items() if k != "device_map"}

    def meta_load() -> Any:
        return meta_from_pretrained(lambda: _call(original_from_pretrained, cls, *args, **plain_kwargs))

    with _nested():
        result, error = attempt(meta_load)
    fallback = error.reason if isinstance(error, NeedsBroadcast) else None
    failure = describe_error(error) if error is not None and fallback is None else None
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, (failure, fallback, torch.get_rng_state()))
    _raise_if_any_failed_to_load([f for f, _, _ in outcomes], error, f"load {source}")
    reasons = [r for _, r, _ in outcomes if r is not None]
    if reasons:
        if dist.get_rank() == 0:
            logger.warning("load_strategy=sharded: %s: falling back to broadcast (rank 0 reads it): %s",
                           source, reasons[0])  # fmt: skip
        return rank0_from_pretrained(original_from_pretrained, cls, *args, **kwargs)
    torch.set_rng_state(outcomes[0][2])  # as with the broadcast strategy: all ranks continue alike
    model = result[0] if isinstance(result, tuple) else result
    setattr(model, SOURCE_ATTR, True)
    if dist.get_rank() == 0:
        logger.info("sharded loading: %s built on meta on every rank; each rank reads its own shards", source)
    return result


def _raise_if_any_failed_to_load(failures: list[str | None], error: BaseException | None, what: str) -> None:
    """Like `raise_if_any_failed`, but worded as the broadcast strategy words it when rank 0
    failed (every rank opens the files here, so usually all fail alike)."""
    if failures[0] is not None:
        if dist.get_rank() == 0:
            raise error  # type: ignore[misc]
        raise RuntimeError(f"rank 0 failed to {what}: {failures[0]}") from error
    failed = [(rank, msg) for rank, msg in enumerate(failures) if msg is not None]
    if failed:
        raise RuntimeError(f"{what} failed on " + "; ".join(f"rank {r}: {m}" for r, m in failed)) from error


def rank0_from_config(original_from_config: Callable[..., Any], cls: type, config: Any, **kwargs: Any) -> Any:
    """`cls._from_config(config, **kwargs)` (init from scratch) on rank 0; the same call on `meta`
    elsewhere. Rank 0's random init is what `load_into_sharded` later sends to every rank."""
    if not distributed_ready() or _inside():
        return _call(original_from_config, cls, config, **kwargs)

    def load() -> Any:
        return _call(original_from_config, cls, config, **kwargs)

    def build(built: _Rank0Built) -> nn.Module:
        from transformers import initialization

        with torch.device("meta"), initialization.meta_device_safe_creation_ops():
            model = _call(original_from_config, cls, config, **kwargs)
        return _conform(model, built)

    return _rank0_or_meta(load, build, f"initialise {cls.__name__} from its config")


def _rank0_or_meta(load: Callable[[], Any], build: Callable[[_Rank0Built], nn.Module], what: str) -> Any:
    """The three-step protocol of this module's docstring; returns what `load` would have."""
    rank = dist.get_rank()
    built: _Rank0Built | None = None
    error: BaseException | None = None
    result: Any = None
    if rank == 0:
        with _nested():
            result, error = attempt(load)
        if error is None:
            built, error = attempt(lambda: _summarize(result))
    wait_for_rank0(what)  # rank 0 may take longer than the collective timeout
    message, built = broadcast_from_rank0((describe_error(error) if error is not None else None, built))
    if message is not None:
        if error is not None:
            raise error
        raise RuntimeError(f"rank 0 failed to {what}: {message}")

    if rank != 0:
        with _nested():  # sub-models built inside `__init__` (e.g. a vision tower) stay plain
            model, error = attempt(lambda: build(built))
    raise_if_any_failed(error, f"building the meta model to {what}")
    if rank == 0:
        model = result[0] if isinstance(result, tuple) else result
        gib = built.spec.nbytes / 2**30
        logger.info("rank-0 loading: %s done on rank 0 (%.2f GiB); other ranks are on meta", what, gib)
    else:
        torch.set_rng_state(built.rng_state)
        result = (model, copy.deepcopy(built.loading_info)) if built.loading_info is not None else model
    setattr(model, SOURCE_ATTR, True)
    return result


def _summarize(result: Any) -> _Rank0Built:
    model, loading_info = result if isinstance(result, tuple) else (result, None)
    if getattr(model, "hf_quantizer", None) is not None:
        raise NotImplementedError("quantized models are not supported by the rank-0 meta loader; turn it off")
    return _Rank0Built(
        config=model.config,
        spec=describe(model),
        generation_config=getattr(model, "generation_config", None),
        loading_info=loading_info,
        rng_state=torch.get_rng_state(),
    )


def _build_on_meta(
    cls: type, built: _Rank0Built, model_args: tuple, init_kwargs: dict[str, Any], allow_all_kernels: bool
) -> nn.Module:
    """Construct `cls` on meta the way `from_pretrained` does (same init contexts: meta device,
    default dtype, no tying during `__init__`), from rank 0's final config."""
    from transformers.monkey_patching import patch_output_recorders
    from transformers.utils import ContextManagers

    dtype = built.config.dtype if isinstance(built.config.dtype, torch.dtype) else torch.float32
    contexts = cls.get_init_context(dtype, False, False, allow_all_kernels)
    with ContextManagers(contexts):
        model = cls(copy.deepcopy(built.config), *model_args, **init_kwargs)
        patch_output_recorders(model)
    model = _conform(model, built)
    model.eval()  # from_pretrained returns the model in eval mode
    return model


def _conform(model: nn.Module, built: _Rank0Built) -> nn.Module:
    """Give the meta model rank 0's dtypes and ties; raise if names or shapes differ."""
    problem = mismatch(built.spec, describe(model), what="meta model differs from rank 0's model", check_ties=False)
    if problem is not None:
        raise RuntimeError(problem)
    rebuild_on_meta(model, built.spec)
    if built.generation_config is not None:
        model.generation_config = copy.deepcopy(built.generation_config)
    return model


def _model_init_kwargs(original: Callable[..., Any], kwargs: dict[str, Any], config: Any) -> dict[str, Any]:
    """The kwargs `from_pretrained` would hand to the model's `__init__`: neither loading options
    nor (when the config was read from the checkpoint) config attributes."""
    from transformers import PreTrainedConfig

    named = set(inspect.signature(getattr(original, "__func__", original)).parameters)
    config_given = isinstance(kwargs.get("config"), PreTrainedConfig)
    return {
        k: v
        for k, v in kwargs.items()
        if k not in _LOADING_KWARGS and k not in named and (config_given or not hasattr(config, k))
    }


def _call(original: Callable[..., Any], cls: type, *args: Any, **kwargs: Any) -> Any:
    return getattr(original, "__func__", original)(cls, *args, **kwargs)


def _inside() -> bool:
    return getattr(_local, "depth", 0) > 0


@contextmanager
def _nested() -> Iterator[None]:
    """Calls made while rank 0 runs the original (e.g. a composite model loading a sub-model)
    go straight to the original: the protocol runs once per user call, not once per level."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
