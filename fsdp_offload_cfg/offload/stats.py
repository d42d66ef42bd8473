"""Process-wide counters of the activation offload, shared by every handle.

Why module-level: a training script may enable offload on several models (policy and reference,
say) and wants one number for "how much left the device". Gauges (`resident_bytes`,
`pinned_pool_bytes`) track what is alive now and are never reset; counters are cumulative until
`reset_offload_stats()`, which also restarts the peak from the current resident value.

"Resident" means bytes of saved activations that sit on the compute device: the saved tensors we
kept in place (not offloaded) plus reloaded copies held during backward. Parameters and buffers
are not activations and are never counted. On a CPU-only run this is the proxy for device memory.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from fsdp_offload_cfg._logging import get_logger, is_rank0
from fsdp_offload_cfg.offload.filter import ParamStorages

logger = get_logger("fsdp_offload_cfg.integrations")  # the name the closing line has always had


class ByteGauge:
    """A current/peak pair of byte counts."""

    __slots__ = ("current", "peak")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current

    def sub(self, nbytes: int) -> None:
        self.current -= nbytes


RESIDENT = ByteGauge()
POOL = ByteGauge()
COUNTS: Counter[str] = Counter()  # offloaded_bytes, reloaded_bytes, packed_tensors, ...
KEPT: Counter[str] = Counter()  # reason -> saved tensors kept in place


def offload_stats() -> dict[str, Any]:
    """Snapshot of all counters (bytes unless named *_tensors / *_storages / groups_*)."""
    return {
        "offloaded_bytes": COUNTS["offloaded_bytes"],
        "reloaded_bytes": COUNTS["reloaded_bytes"],
        "offloaded_storages": COUNTS["offloaded_storages"],
        "offloaded_tensors": COUNTS["offloaded_tensors"],
        "packed_tensors": COUNTS["packed_tensors"],
        "groups_entered": COUNTS["groups_entered"],
        "groups_to_offload_entered": COUNTS["groups_to_offload_entered"],
        "resident_bytes": RESIDENT.current,
        "peak_resident_bytes": RESIDENT.peak,
        "pinned_pool_bytes": POOL.current,
        "pinned_pool_peak_bytes": POOL.peak,
        "kept_tensors": dict(KEPT),
        "pool_full_bytes": COUNTS["pool_full_bytes"],  # kept on the device by max_pinned_bytes (each storage once a pass)
    }


def describe_moved(stats: dict[str, Any]) -> tuple[int, str] | None:
    """The end-of-run line about what the offload did (a logging level and the message), or None
    when it never ran. Moving nothing while it was on is worth a warning: the user turned it on for
    memory it is not saving (seen under ms-swift, whose default gradient checkpointing leaves the
    layers nothing to move). So is a pool cap (`max_pinned_bytes`) that left saves on the device:
    the examples set one, and a run that then runs short of device memory should say why. Layers it
    was never to move (the last one, those an activation_memory_budget plan keeps or only
    checkpoints) are no such surprise: a plan that offloads no layer runs it without a word beyond
    the plan's own line."""
    import logging

    from fsdp_offload_cfg._logging import counted
    from fsdp_offload_cfg._sizes import show_size

    past_cap = stats["kept_tensors"].get("pool_full", 0)
    cap = (f"{show_size(stats['pool_full_bytes'])} ({counted(past_cap, 'tensor')}) stayed on the device past the "
           "pinned pool's cap (max_pinned_bytes)")
    if stats["offloaded_bytes"]:
        moved = (f"activation offload moved {show_size(stats['offloaded_bytes'])} to the host "
                 f"({counted(stats['offloaded_tensors'], 'tensor')}) and {show_size(stats['reloaded_bytes'])} back; "
                 f"pinned host pool peaked at {show_size(stats['pinned_pool_peak_bytes'])}")
        return (logging.WARNING, f"{moved}; {cap}") if past_cap else (logging.INFO, moved)
    if not stats["groups_to_offload_entered"]:
        return None
    if past_cap:
        return logging.WARNING, f"activation offload moved nothing: {cap}, which lets nothing in"
    kept = ", ".join(f"{reason} {n}" for reason, n in sorted(stats["kept_tensors"].items())) or "none saved"
    return logging.WARNING, (
        f"activation offload was on for {stats['groups_entered']} layer forwards but moved nothing (tensors kept: "
        f"{kept}). Layers whose forward runs whole under gradient checkpointing (ms-swift's default "
        "gradient_checkpointing, the Trainer's activation_checkpointing, reentrant checkpointing) save nothing it "
        "could move: turn that checkpointing off "
        "to offload instead (`--gradient_checkpointing false` in ms-swift), or checkpoint with "
        "fsdp_activation_checkpointing, with which the offload composes; tensors below min_tensor_bytes stay too.")


def reset_offload_stats() -> None:
    """Zero the cumulative counters; the peak restarts from what is resident now."""
    COUNTS.clear()
    KEPT.clear()
    RESIDENT.peak = RESIDENT.current


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the whole storage behind `t` (what stays alive while any view of it is saved)."""
    return t.untyped_storage().nbytes()


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Counted:
    """One kept storage in a meter; subtracts itself when the last saved view dies."""

    __slots__ = ("__weakref__", "gauge", "nbytes")

    def __init__(self, gauge: ByteGauge, nbytes: int) -> None:
        self.gauge, self.nbytes = gauge, nbytes
        gauge.add(nbytes)

    def __del__(self) -> None:
        self.gauge.sub(self.nbytes)


class SavedBytesMeter(saved_tensors_hooks):
    """Measure saved-activation bytes left in place by a forward (the CPU stand-in for device memory).

    Used for the baselines the offload is compared against: with no `inner` hooks it counts every
    saved tensor (no offload); with `inner` (e.g. `torch.autograd.graph.save_on_cpu`) it counts
    only what `inner`'s pack left sharing storage with the original. Parameters and buffers of
    `model` are excluded, as in `offload_stats()["resident_bytes"]`. Storages are counted once.
    """

    def __init__(self, model: nn.Module, inner: saved_tensors_hooks | None = None) -> None:
        self.gauge = ByteGauge()
        self._model = model
        self._params = ParamStorages()
        inner_pack: Callable[[torch.Tensor], Any] = inner.pack_hook if inner else (lambda t: t.detach())
        inner_unpack: Callable[[Any], torch.Tensor] = inner.unpack_hook if inner else (lambda p: p)
        # a kept storage stays alive while counted, so its address cannot be reused meanwhile
        self._counted: weakref.WeakValueDictionary[int, _Counted] = weakref.WeakValueDictionary()

        def pack(t: torch.Tensor) -> Any:
            packed = inner_pack(t)
            try:
                ptr = storage_ptr(t)
                same = isinstance(packed, torch.Tensor) and storage_ptr(packed) == ptr
            except (RuntimeError, NotImplementedError):  # tensor subclass without a plain storage
                return (None, packed)
            if not same or ptr in self._params or isinstance(t, nn.Parameter):
                return (None, packed)
            counted = self._counted.get(ptr)
            if counted is None:
                counted = self._counted[ptr] = _Counted(self.gauge, storage_bytes(t))
            return (counted, packed)

        def unpack(p: Any) -> torch.Tensor:
            return inner_unpack(p[1])

        super().__init__(pack, unpack)

    def __enter__(self) -> SavedBytesMeter:
        self._params = ParamStorages(self._model)
        super().__enter__()
        return self

    @property
    def peak_bytes(self) -> int:
        return self.gauge.peak

    @property
    def current_bytes(self) -> int:
        return self.gauge.current


@functools.cache
def summarize_offload_at_exit() -> None:
    """Once per process: rank 0 says at exit what the activation offload moved (registered by the
    first model the integrations or the budget enable it on)."""
    import atexit

    def summary() -> None:
        line = describe_moved(offload_stats())
        if is_rank0() and line is not None and not getattr(sys.stderr, "closed", False):
            logger.log(*line)

    atexit.register(summary)
