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

What needs the base weights cannot be had on meta: DoRA's magnitude (a norm of the base rows)
and inits computed from them (PiSSA, OLoRA, LoftQ, ...). Such adapters are injected as PEFT does
it: on meta wherever the base is, real on rank 0 under "broadcast" (which sends them at prepare);
under "sharded" no rank holds them and prepare says so, naming the adapter and the strategy that
works (`meta_adapter_problem`), before any data moves.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_INITS_DRAWN_ALONE = (True, "gaussian")  # LoRA inits that need no base weight


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
        if not any(p.is_meta for p in model.parameters()) or _needs_base_weights(config):
            return original(self, model, adapter_name, *args, **kwargs)
        with _KeepOffMeta():
            return original(self, model, adapter_name, *args, **kwargs)

    return inject_adapter


def _needs_base_weights(config: Any) -> bool:
    """DoRA, or a LoRA init computed from the base weight: on a meta base such an adapter is
    computed on meta as PEFT does (rank 0 holds the real one under "broadcast")."""
    return bool(getattr(config, "use_dora", False)) or getattr(config, "init_lora_weights", True) not in _INITS_DRAWN_ALONE


def meta_adapter_problem(model: nn.Module, names: Iterable[str]) -> str | None:
    """Why adapter tensors among `names` (on meta on rank 0) have no values anywhere, naming the
    adapter, its init and what to use instead; None when none of `names` is an adapter's."""
    lora = sys.modules.get("peft.tuners.lora")
    names = set(names)
    if lora is None or not names:
        return None
    configs = getattr(model, "peft_config", None) or {}
    problems = []
    for adapter, config in sorted(configs.items()):
        own = sorted(n for n in names if f".{adapter}." in f".{n}." or n.endswith(f".{adapter}"))
        if not own:
            continue
        init = getattr(config, "init_lora_weights", True)
        need = []
        copies = sorted({n.split(".modules_to_save.")[0].rsplit(".", 1)[-1] for n in own if ".modules_to_save." in n})
        if copies:
            need.append(f"modules_to_save={copies} (trainable copies of base weights)")
        if getattr(config, "use_dora", False):
            need.append("use_dora=True (its magnitude is a norm of the base weight)")
        if init not in _INITS_DRAWN_ALONE:
            need.append(f"init_lora_weights={init!r} (computed from the base weight)")
        what = " and ".join(need) or "its values"
        problems.append(f"adapter {adapter!r} needs {what}, which no rank holds before prepare under "
                        f"load_strategy 'sharded' ({', '.join(own[:3])}{', ...' if len(own) > 3 else ''})")
    if not problems:
        return None
    return "; ".join(problems) + ". Use load_strategy: broadcast (rank 0 holds the base weights) for such adapters."
