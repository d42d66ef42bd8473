"""PEFT adapters on a loader-built model: created for real on every rank, never drawn again.

Why: PEFT initialises a new adapter on the host (`reset_lora_parameters`: A kaiming or gaussian,
B zeros, from the rank's RNG) and then moves it to the device of its base weight
(`_move_adapter_to_device_of_base_layer`, and each tuner's `_replace_module` again). On a
loader-built model that device is `meta` (on ranks other than 0 under "broadcast", on every
rank under "sharded"), so the values just drawn were dropped. An earlier version drew them again
on rank 0 at prepare time: identical on every rank, but not the values a plain run with the same
seed gets, and rank 0's RNG stream shifted for everything after (the losses of a LoRA run drifted
from step 1). Adapters are small: here they stay on the host with their drawn values, in the
dtype PEFT casts them to, as a plain run has them; `load_into_sharded` sends rank 0's (equal to
every rank's under the same seed).

How: while PEFT injects adapters into a model that holds meta parameters (`BaseTuner.inject_adapter`,
behind `get_peft_model`, `add_adapter` and `load_adapter` of every tuner type), a torch function
mode turns a move of a real tensor to `meta` into a no-op (a dtype cast still happens). One
interception point for all tuners, instead of each tuner's own move.

DoRA's magnitude (a norm of the base weight's rows) is computed by each rank from its own rows
after the load (`dora.py`). What needs whole base weights cannot be had on meta: `modules_to_save`
copies, and DoRA on embeddings, convolutions or `fan_in_fan_out` layers. For such an adapter rank
0 first reads the base model whole from the checkpoint files (the copy a plain load holds, under
either strategy), so PEFT computes it from real weights there; the other ranks compute it on
meta and receive rank 0's at prepare.
Inits PEFT computes from the base weights before it places the adapter (PiSSA, OLoRA, LoftQ,
CorDA, ...) fail inside PEFT on a meta base: every rank refuses them at `get_peft_model`, naming
the init and what works.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fsdp_offload_cfg._logging import get_logger
from fsdp_offload_cfg.loading import dora, pending
from fsdp_offload_cfg.loading.pending import plain_meta

logger = get_logger("fsdp_offload_cfg.loading")

_INITS_DRAWN_ALONE = (True, "gaussian")  # LoRA inits that need no base weight
# set while adapters go on a model that stays on meta and is never loaded (the meta twin an
# activation budget plans from): PEFT places them as it does, on meta, nothing kept on the host
_ALL_ON_META: ContextVar[bool] = ContextVar("fsdp_offload_cfg_adapters_all_on_meta", default=False)


@contextmanager
def adapters_on_meta() -> Iterator[None]:
    """PEFT's own placement for the adapters injected meanwhile, on a model nothing will load:
    a twin whose adapters were kept on the host beside its meta base (a DoRA layer then mixed
    devices in its forward: "Tensor on device cpu is not on the expected device meta")."""
    token = _ALL_ON_META.set(True)
    try:
        yield
    finally:
        _ALL_ON_META.reset(token)


class _KeepOffMeta(TorchFunctionMode):
    """`Tensor.to(meta, ...)` of a real tensor keeps it where it is (cast to the asked dtype)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to and args and not args[0].is_meta:
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if device is not None and device.type == "meta":
                return args[0].to(dtype=dtype) if dtype is not None else args[0]
        return func(*args, **kwargs)


def build_inject_adapter(original: Callable[..., Any], cfg: Any) -> Callable[..., Any]:
    """PEFT's `BaseTuner.inject_adapter`, under `_KeepOffMeta` when the model holds meta parameters."""

    @functools.wraps(original)
    def inject_adapter(self: Any, model: nn.Module, adapter_name: str, *args: Any, **kwargs: Any) -> Any:
        config = (getattr(self, "peft_config", None) or {}).get(adapter_name)
        if _ALL_ON_META.get() or not any(p.is_meta for p in model.parameters()):
            return original(self, model, adapter_name, *args, **kwargs)
        if _needs_base_weights(self, model, config):
            _refuse_init_computed_before_placement(config, adapter_name)
            _read_whole_on_rank0(model, adapter_name)
            with plain_meta():  # the ranks still on meta compute shapes only: rank 0's values come at prepare
                return original(self, model, adapter_name, *args, **kwargs)
        with _KeepOffMeta(), dora.defer_norms():
            return original(self, model, adapter_name, *args, **kwargs)

    return inject_adapter


def build_load_adapter(original: Callable[..., Any], cfg: Any) -> Callable[..., Any]:
    """PEFT's `PeftModel.load_adapter` (behind `PeftModel.from_pretrained`): it calls `state_dict()`
    of the whole model to match the saved adapter's keys, which on a loader-built model would read
    the base model whole from the files on every rank; only keys and shapes are used there."""
    from fsdp_offload_cfg.loading.guard import state_dict_keys_only

    @functools.wraps(original)
    def load_adapter(self: Any, *args: Any, **kwargs: Any) -> Any:
        with state_dict_keys_only():
            return original(self, *args, **kwargs)

    return load_adapter


def _needs_base_weights(tuner: Any, model: nn.Module, config: Any) -> bool:
    """A LoRA init computed from the base weight, `modules_to_save` (trainable copies of base
    modules), or DoRA on a layer whose magnitude cannot be computed from each rank's own rows
    after the load (`dora.py`): the adapter's values come from whole base weights."""
    return (bool(getattr(config, "modules_to_save", None))
            or getattr(config, "init_lora_weights", True) not in _INITS_DRAWN_ALONE
            or (bool(getattr(config, "use_dora", False)) and not _dora_rows_line_up(tuner, model, config)))


def _dora_rows_line_up(tuner: Any, model: nn.Module, config: Any) -> bool:
    """Every layer the DoRA config targets is a Linear one (not `fan_in_fan_out`, not an embedding
    or a convolution): its magnitude rows are its base weight's rows."""
    fan_in_fan_out = bool(getattr(config, "fan_in_fan_out", False))
    if getattr(config, "target_modules", None) == "all-linear":  # PEFT's shorthand: Linear and GPT-2's Conv1D
        return not fan_in_fan_out and not any(type(m).__name__ == "Conv1D" for m in model.modules())
    targeted = getattr(tuner, "_check_target_module_exists", None)
    if targeted is None:
        return False
    for key, module in model.named_modules():
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        if key and targeted(config, key) and not dora.deferrable(base, fan_in_fan_out):
            return False
    return True


def _refuse_init_computed_before_placement(config: Any, adapter_name: str) -> None:
    """PiSSA, OLoRA, LoftQ, CorDA, ... compute the adapter from the base weights *before* PEFT
    places it (DoRA's magnitude comes after, on meta where the base is): on a rank whose base is on
    meta that fails inside PEFT. Every rank refuses alike, at `get_peft_model`, before any collective."""
    import torch.distributed as dist

    from fsdp_offload_cfg.ranks import distributed_ready

    init = getattr(config, "init_lora_weights", True)
    if isinstance(init, str) and init not in _INITS_DRAWN_ALONE and distributed_ready():
        raise NotImplementedError(
            f"PEFT adapter {adapter_name!r}: init_lora_weights={init!r} computes the adapter from the base "
            f"weights, which rank {dist.get_rank()} and the others do not hold before prepare under the loader's "
            "meta loading. For this run set fsdp_cpu_ram_efficient_loading: false (every rank loads the model "
            "whole), or initialise such adapters after prepare."
        )


def _read_whole_on_rank0(model: nn.Module, adapter_name: str) -> None:
    """Rank 0 reads the base model whole from the checkpoint files (the copy a plain load holds)
    so that PEFT computes the adapter from real weights there; `load_into_sharded` sends rank 0's
    model then. The other ranks compute it on meta, as PEFT does, and receive it."""
    import torch.distributed as dist

    from fsdp_offload_cfg.loading.checkpoint import record_of
    from fsdp_offload_cfg.ranks import distributed_ready

    if not distributed_ready() or dist.get_rank() != 0 or record_of(model) is None:
        return
    nbytes = pending.materialize_all(model)
    if nbytes:
        logger.info("adapter %r is computed from the base weights (DoRA, its init, or modules_to_save): rank 0 "
                    "read the base model whole from the files (%.2f GiB) and sends it at prepare", adapter_name,
                    nbytes / 2**30)  # fmt: skip
