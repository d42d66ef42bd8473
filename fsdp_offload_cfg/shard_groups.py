"""The `fully_shard` groups of a prepare: each tie in one group (`tie_groups`), one original
dtype per group (`dtype_groups`).

`fsdp2_groups(model)` swaps `torch.distributed.fsdp.fully_shard` for the duration of a prepare
call. accelerate's `fsdp2_prepare_model` and TRL's `prepare_fsdp` import it by name inside the
call, so the swap reaches them, and their own arguments are reused for the groups it adds. Each
call's unit first takes in the other holders of the ties it touches, then gives its odd-dtype
sub-modules their own groups, then is sharded. A model with neither is sharded exactly as asked.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from fsdp_offload_cfg._logging import get_logger, is_rank0
from fsdp_offload_cfg.dtype_groups import odd_dtype_modules
from fsdp_offload_cfg.tie_groups import with_tied_holders

logger = get_logger("fsdp_offload_cfg.shard_groups")

_SWAP_MODULE, _SWAP_ATTR = "torch.distributed.fsdp", "fully_shard"


class _Log:
    """What the swap changed during one prepare, for rank 0's one line at its end."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names: dict[int, str] = {}
        self.split: list[str] = []  # modules given their own group for their dtype
        self.joined: list[str] = []  # modules a unit took in for a tie

    def name(self, module: nn.Module) -> str:
        if not self.names:
            self.names.update({id(m): n for n, m in self.model.named_modules()})
        return self.names.get(id(module), type(module).__name__)

    def report(self) -> None:
        if not is_rank0():
            return
        for what, names in (("modules whose trainable parameters differ in dtype from their unit got their own "
                             "group", self.split),
                            ("modules holding a parameter tied to one of their unit's joined that unit", self.joined)):
            if names:
                shown = ", ".join(names[:8]) + (f", ... ({len(names) - 8} more)" if len(names) > 8 else "")
                logger.info("fully_shard: %d %s: %s", len(names), what, shown)


def grouped(fully_shard: Callable[..., Any], log: _Log) -> Callable[..., Any]:
    """`fully_shard` that keeps each tie in the unit, then gives each odd-dtype sub-module of the
    unit its own group, with the same arguments."""

    @functools.wraps(fully_shard)
    def shard(module: nn.Module | list[nn.Module], *args: Any, **kwargs: Any) -> Any:
        asked = list(module) if isinstance(module, (list, tuple)) else [module]
        unit = with_tied_holders(asked, log.model)
        log.joined += [log.name(m) for m in unit if not any(m is a for a in asked)]
        ignored = {id(p) for p in kwargs.get("ignored_params") or ()}
        odd = odd_dtype_modules(unit, ignored)
        for sub in odd:
            fully_shard(sub, *args, **kwargs)
            log.split.append(log.name(sub))
        unit = [m for m in unit if not any(m is o for o in odd)]
        if not unit:  # every listed module went its own way, or an earlier group holds it already
            return None
        unchanged = len(unit) == 1 and unit[0] is module
        return fully_shard(module if unchanged else unit, *args, **kwargs)

    return shard


@contextmanager
def fsdp2_groups(model: nn.Module) -> Iterator[None]:
    """While the block runs, every `fully_shard` call made through `torch.distributed.fsdp` keeps
    ties in one group and one dtype per group (see the module docstring). Logs once, on rank 0,
    which modules it moved."""
    owner = importlib.import_module(_SWAP_MODULE)
    original = getattr(owner, _SWAP_ATTR)
    if getattr(original, "_fsdp_offload_cfg_grouped", False):  # nested prepare: already swapped
        yield
        return
    log = _Log(model)
    swapped = grouped(original, log)
    swapped._fsdp_offload_cfg_grouped = True  # type: ignore[attr-defined]
    setattr(owner, _SWAP_ATTR, swapped)
    try:
        yield
    finally:
        setattr(owner, _SWAP_ATTR, original)
    log.report()


def swap_target() -> tuple[str, str]:
    """(module, attribute) `fsdp2_groups` swaps: checked to exist before `patch()` applies."""
    return _SWAP_MODULE, _SWAP_ATTR
