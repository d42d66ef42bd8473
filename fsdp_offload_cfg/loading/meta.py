"""The three loading strategies, as the bodies of the `PreTrainedModel.from_pretrained` and
`_from_config` patches (the patch named `loader-from-pretrained` dispatches to all three):

- `broadcast` (`rank0_from_pretrained`): rank 0 describes the model and every other rank builds it
  on `meta` from that description; at prepare rank 0 streams each rank its slices from the files.
- `sharded` (`sharded_from_pretrained`): every rank, rank 0 included, runs transformers' own
  `from_pretrained` reading no weight (`checkpoint.py`), so each holds a meta model recording which
  safetensors tensor fills which parameter, and reads its own slices at prepare. A checkpoint
  that cannot be read slice by slice raises `NotSliceable` on every rank alike, which falls
  back to `broadcast`.
- `auto` (`auto_from_pretrained`, the default): `sharded` where every rank can read the files,
  rank 0's description for a rank that cannot, `broadcast` for a checkpoint that cannot be read
  slice by slice.

The meta model is guarded until prepare fills it (`guard.py`). They are accelerate-independent:
the caller decides whether the loader is on; here we only need a process group. Why global rank
0 and not transformers' local rank 0: transformers reads the checkpoint once per node, so N nodes
hold N full copies in host memory; one reader is enough because `load_into_sharded` sends every
rank its shard anyway.

Protocol of rank 0's description (`broadcast`, and `auto` for the ranks that cannot read the
files): no collective at all, so a load that only some ranks make behaves on them like a plain
load (rank 0 alone: a real model; another rank alone: a meta model that refuses to run, and a
clear error if it waits on a rank 0 that never loads):
  1. rank 0 marks the call started in the process group's store, runs the original, and posts
     (error or None, what it built: config, `ModelSpec`, generation config, RNG state) there;
  2. the other ranks wait for that post (`Rank0Mailbox`: no collective, so no timeout while rank
     0 reads for longer than the process-group timeout), raise if rank 0 failed, build the model
     on `meta` from rank 0's config and reshape it to rank 0's spec (dtypes incl.
     `_keep_in_fp32_modules`, ties);
  3. a model still on meta refuses its forward until `prepare` fills it (`load_into_sharded`
     checks every rank's model against rank 0's, in collectives that every rank reaches).
A load pairs with rank 0's load of the same call (class, checkpoint, shaping arguments), not
with rank 0's load of the same position (`pairing.py`).
The non-zero ranks never open a weight file, and hold zero parameter or buffer bytes.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_offload_cfg import model_state
from fsdp_offload_cfg._logging import get_logger
from fsdp_offload_cfg.compat import model_init
from fsdp_offload_cfg.loading.checkpoint import (
    NotSliceable,
    meta_from_pretrained,
    record_of,
)
from fsdp_offload_cfg.loading.guard import guard_until_prepared
from fsdp_offload_cfg.loading.local import LOCAL_LOADING_HINT, transformers_fsdp_gate_off
from fsdp_offload_cfg.loading.mailbox import Rank0Mailbox
from fsdp_offload_cfg.loading.pairing import LoadCall, load_call
from fsdp_offload_cfg.loading.quantized import refusal
from fsdp_offload_cfg.loading.spec import ModelSpec, describe, mismatch, rebuild_on_meta
from fsdp_offload_cfg.ranks import attempt, describe_error, distributed_ready, remember_failed_step

logger = get_logger("fsdp_offload_cfg.loading")

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
    rng_before: torch.Tensor  # rank 0's CPU RNG state before: did its load draw, and from this rank's state?
    kernels: Any = None  # how from_pretrained kernelized rank 0's model (transformers 5.25), replayed on the others


def is_rank0_source(model: nn.Module) -> bool:
    """True if `model` came out of `rank0_from_pretrained`/`rank0_from_config` (on any rank)."""
    return bool(model_state.found(model, "loader_source"))


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
        return _described_from_files(lambda: _call(original_from_pretrained, cls, *args, **kwargs), source)

    def build(built: _Rank0Built) -> nn.Module:
        init_kwargs = _model_init_kwargs(original_from_pretrained, kwargs, built.config)
        return _build_on_meta(cls, built, args[1:], init_kwargs, kwargs.get("allow_all_kernels", False))

    return _rank0_or_meta(load, build, f"load {source}", load_call(cls, "from_pretrained", args, kwargs))


def _described_from_files(load: Callable[[], Any], source: Any) -> Any:
    """Rank 0 under "broadcast": transformers' own load with no weight read (meta, with the
    checkpoint record), so rank 0 holds no more than any rank and streams the weights from the
    files at prepare; the full load where the checkpoint cannot be read slice by slice (`.bin`,
    keys converted on load), with one log line saying why."""
    rng = torch.get_rng_state()  # a fallback load draws what the attempt drew (keys missing from the files)
    with transformers_fsdp_gate_off():
        result, error = attempt(lambda: meta_from_pretrained(load))
    if isinstance(error, NotSliceable):
        logger.info("rank-0 loading: %s cannot be read slice by slice (%s): rank 0 loads it whole", source, error.reason)
        torch.set_rng_state(rng)
        return load()
    if error is not None:
        raise error
    return result


def sharded_from_pretrained(original_from_pretrained: Callable[..., Any], cls: type, *args: Any, **kwargs: Any) -> Any:
    """`cls.from_pretrained(*args, **kwargs)` for `load_strategy="sharded"`: EVERY rank, rank 0
    included, runs transformers' own `from_pretrained` with no weight read (`checkpoint.py`),
    so each holds a meta model that records which safetensors tensor fills which parameter.

    Every rank resolves and validates the checkpoint files itself and raises its own error (no
    collective: a load that only some ranks make must not wait on the others). When the
    checkpoint cannot be read slice by slice (not safetensors, keys fused or converted on load,
    ...) every rank sees the same files and falls back to `rank0_from_pretrained` alike; rank 0
    logs one warning saying why.
    """
    if not distributed_ready() or _inside():
        return _call(original_from_pretrained, cls, *args, **kwargs)
    source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    if kwargs.get("device_map") is not None and dist.get_rank() == 0:
        logger.info("sharded loading: ignoring device_map=%r (FSDP places the shards)", kwargs["device_map"])
    plain_kwargs = {k: v for k, v in kwargs.items() if k != "device_map"}

    def meta_load() -> Any:
        return meta_from_pretrained(lambda: _call(original_from_pretrained, cls, *args, **plain_kwargs))

    rng = torch.get_rng_state()
    with _nested(), transformers_fsdp_gate_off():  # every rank loads like rank 0, reading nothing
        result, error = attempt(meta_load)
    if isinstance(error, NotSliceable):  # every rank sees the same files and decides alike
        if dist.get_rank() == 0:
            logger.warning("load_strategy=sharded: %s: falling back to broadcast (rank 0 reads it): %s",
                           source, error.reason)  # fmt: skip
        torch.set_rng_state(rng)
        return rank0_from_pretrained(original_from_pretrained, cls, *args, **kwargs)
    if error is not None:  # maybe on this rank alone: if it ends the process, prepare tells the others
        remember_failed_step(f"load {source} (load_strategy sharded)", error)
        raise error
    model = result[0] if isinstance(result, tuple) else result
    _mark(model, f"load {source}")
    model_state.put(model, "load_call", load_call(cls, "from_pretrained", args, kwargs))  # each rank built its own: unpaired
    if dist.get_rank() == 0:
        logger.info("sharded loading: %s built on meta on every rank; each rank reads its own shards", source)
    return result


def auto_from_pretrained(original_from_pretrained: Callable[..., Any], cls: type, *args: Any, **kwargs: Any) -> Any:
    """`cls.from_pretrained(*args, **kwargs)` for `load_strategy="auto"` (the default): the lightest
    strategy the checkpoint and the ranks allow, with one rank-0 log line saying which and why.

    Every rank tries to build the model on meta from the files itself (as "sharded"). Rank 0 also
    posts its description (as "broadcast"), so a rank that cannot read the files (no shared
    storage on its node, a path that exists only on rank 0's) builds from it instead of failing;
    at prepare, tensors every rank can read are read by every rank, the rest rank 0 streams from
    the files. A checkpoint that cannot be read slice by slice (`.bin`, keys converted on load)
    is loaded whole by rank 0 and sent, as "broadcast" does with such files.
    """
    if not distributed_ready() or _inside():
        return _call(original_from_pretrained, cls, *args, **kwargs)
    source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    plain_kwargs = {k: v for k, v in kwargs.items() if k != "device_map"}
    rng = torch.get_rng_state()
    with _nested(), transformers_fsdp_gate_off():
        result, error = attempt(lambda: meta_from_pretrained(
            lambda: _call(original_from_pretrained, cls, *args, **plain_kwargs)))
    if isinstance(error, NotSliceable):  # every rank sees the same files and decides alike
        if dist.get_rank() == 0:
            logger.info("load_strategy auto: %s cannot be read slice by slice (%s): rank 0 loads it whole and "
                        "sends it", source, error.reason)  # fmt: skip
        torch.set_rng_state(rng)
        return rank0_from_pretrained(original_from_pretrained, cls, *args, **kwargs)
    call = load_call(cls, "from_pretrained", args, kwargs)
    what = f"load {source}"
    mailbox = Rank0Mailbox(f"described:{call.digest}", f"describe {source}")
    if dist.get_rank() == 0:
        mailbox.start()
        _post_description(mailbox, result, error, rng)
        logger.info("load_strategy auto: %s built on meta on every rank that can read it; each reads its own "
                    "slices at prepare, rank 0 streams them to any rank that cannot", source)  # fmt: skip
    elif error is not None:  # this rank cannot read the files: it builds from rank 0's description
        logger.warning("rank %d cannot read %s itself (%s): it builds the model from rank 0's description; rank 0 "
                       "sends it its weights at prepare", dist.get_rank(), source, describe_error(error))  # fmt: skip

        def build(built: _Rank0Built) -> nn.Module:
            init_kwargs = _model_init_kwargs(original_from_pretrained, plain_kwargs, built.config)
            return _build_on_meta(cls, built, args[1:], init_kwargs, kwargs.get("allow_all_kernels", False))

        result = _build_from_description(mailbox, what, build, rng, cause=error)
    model = result[0] if isinstance(result, tuple) else result
    _mark(model, what)
    model_state.put(model, "load_call", call)  # built by each rank (or from rank 0's description): unpaired
    return result


def rank0_from_config(original_from_config: Callable[..., Any], cls: type, config: Any, **kwargs: Any) -> Any:
    """`cls._from_config(config, **kwargs)` (init from scratch) on rank 0; the same call on `meta`
    elsewhere. Rank 0's random init is what `load_into_sharded` later sends to every rank."""
    if not distributed_ready() or _inside():
        return _call(original_from_config, cls, config, **kwargs)

    def load() -> Any:
        return _call(original_from_config, cls, config, **kwargs)

    def build(built: _Rank0Built) -> nn.Module:
        with model_init.meta_safe_creation():
            model = _call(original_from_config, cls, config, **kwargs)
        return _conform(model, built)

    what = f"initialise {cls.__name__} from its config"
    return _rank0_or_meta(load, build, what, load_call(cls, "_from_config", (config,), kwargs))


def _rank0_or_meta(load: Callable[[], Any], build: Callable[[_Rank0Built], nn.Module], what: str,
                   call: LoadCall) -> Any:
    """The protocol of this module's docstring; returns what `load` would have. `call` pairs
    this load with rank 0's load of the same call (`pairing.py`)."""
    mailbox = Rank0Mailbox(call.digest, what)
    call = dataclasses.replace(call, repeat=mailbox.repeat)
    rng = torch.get_rng_state()
    if dist.get_rank() == 0:
        mailbox.start()
        with _nested():
            result, error = attempt(load)
        built = _post_description(mailbox, result, error, rng)
        model = result[0] if isinstance(result, tuple) else result
        streams = record_of(model) is not None
        logger.info("rank-0 loading: %s %s (%.2f GiB); other ranks are on meta", what,
                    "described on rank 0, which streams the weights from the files at prepare" if streams else
                    "done on rank 0", built.spec.nbytes / 2**30)  # fmt: skip
        _mark(model, what)
        model_state.put(model, "load_call", call)
        return result
    result = _build_from_description(mailbox, what, build, rng)
    model = result[0] if isinstance(result, tuple) else result
    _mark(model, what)
    model_state.put(model, "load_call", call)
    return result


def _post_description(mailbox: Rank0Mailbox, result: Any, error: BaseException | None,
                      rng_before: torch.Tensor) -> _Rank0Built:
    """Rank 0: post what the other ranks build the model from, or its error, which they then
    raise too; the error is raised here as well."""
    built = None
    if error is None:
        built, error = attempt(lambda: _summarize(result, rng_before))
    error = mailbox.post((describe_error(error), None) if error is not None else (None, built)) or error
    if error is not None:  # under auto the ranks that built the model themselves go on to prepare
        remember_failed_step(mailbox.what, error)
        raise error
    return built


def _build_from_description(mailbox: Rank0Mailbox, what: str, build: Callable[[_Rank0Built], nn.Module],
                            rng_before: torch.Tensor, cause: BaseException | None = None) -> Any:
    """Any other rank: wait for rank 0's description, build the model from it, and continue the
    RNG as after rank 0's load; returns what the load returns (the model, with its loading info
    where the call asked for it). `cause`: why this rank did not build from the files itself.
    A failure here is this rank's alone where rank 0 succeeded: if it ends the process, the ranks
    that go on hear of it when they prepare (`ranks.say_this_rank_is_gone`), not at the
    process-group timeout."""
    def received_and_built() -> tuple[_Rank0Built, nn.Module]:
        message, built = mailbox.receive(f"Otherwise make the same call on every rank. {LOCAL_LOADING_HINT}")
        if message is not None:
            raise RuntimeError(f"rank 0 failed to {what}: {message}") from cause
        with _nested():  # sub-models built inside `__init__` (e.g. a vision tower) stay plain
            return built, build(built)

    result, error = attempt(received_and_built)
    if error is not None:
        remember_failed_step(f"{what} from rank 0's description", error)
        raise error
    built, model = result
    _continue_rng(built, rng_before)
    return (model, copy.deepcopy(built.loading_info)) if built.loading_info is not None else model


def _mark(model: nn.Module, what: str) -> None:
    """Flag `model` as the loader's and guard its use before `prepare` (`guard.py`)."""
    model_state.put(model, "loader_source", True)
    guard_until_prepared(model, what)


def _continue_rng(built: _Rank0Built, before: torch.Tensor) -> None:
    """This rank's CPU RNG after a load it did not make, as after its own plain load: rank 0's
    state when this rank started from rank 0's (one seed everywhere); its own, untouched, when
    rank 0's load drew nothing (a framework seeding each rank differently, like ms-swift's
    seed + rank, then draws each rank's own adapters and heads, as in its plain run)."""
    if torch.equal(before, built.rng_before):
        torch.set_rng_state(built.rng_state)
    elif not torch.equal(built.rng_before, built.rng_state):
        torch.set_rng_state(built.rng_state)
        logger.warning("rank %d started this load from another random state than rank 0 and rank 0's load drew "
                       "random numbers (weights missing from the checkpoint): this rank continues from rank 0's "
                       "state, which a plain load on this rank would not", dist.get_rank())  # fmt: skip


def _summarize(result: Any, rng_before: torch.Tensor) -> _Rank0Built:
    model, loading_info = result if isinstance(result, tuple) else (result, None)
    if getattr(model, "hf_quantizer", None) is not None:  # not seen before the load (`quantized.py`)
        raise NotImplementedError(refusal(type(model).__name__, f"quantizer {type(model.hf_quantizer).__name__}"))
    return _Rank0Built(
        config=model.config,
        spec=describe(model),
        generation_config=getattr(model, "generation_config", None),
        loading_info=loading_info,
        rng_state=torch.get_rng_state(),
        rng_before=rng_before,
        kernels=model_init.kernels_chosen(model),
    )


def _build_on_meta(
    cls: type, built: _Rank0Built, model_args: tuple, init_kwargs: dict[str, Any], allow_all_kernels: bool
) -> nn.Module:
    """Construct `cls` on meta the way `from_pretrained` does (same init contexts: meta device,
    default dtype, no tying during `__init__`), from rank 0's final config."""
    dtype = built.config.dtype if isinstance(built.config.dtype, torch.dtype) else torch.float32
    with model_init.meta_init(cls, dtype, allow_all_kernels, built.config):
        model = cls(copy.deepcopy(built.config), *model_args, **init_kwargs)
        model_init.after_init(model)
    model = _conform(model, built)
    model.eval()  # from_pretrained returns the model in eval mode
    model_init.kernelize_as_chosen(model, built.kernels)
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
    named = set(inspect.signature(getattr(original, "__func__", original)).parameters)
    config_given = model_init.is_config(kwargs.get("config"))
    return {
        k: v
        for k, v in kwargs.items()
        if k not in _LOADING_KWARGS and k not in named and (config_given or not hasattr(config, k))
    }


def _call(original: Callable[..., Any], cls: type, *args: Any, **kwargs: Any) -> Any:
    """The original `from_pretrained` / `_from_config`, its kernels chosen for the run's device
    (the model may be on meta: `model_init.kernelized_for_the_run_device`)."""
    return model_init.kernelized_for_the_run_device(
        lambda: getattr(original, "__func__", original)(cls, *args, **kwargs))


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
