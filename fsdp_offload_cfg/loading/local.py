"""`local_loading()`: the stock `from_pretrained` / `from_config` for the loads inside the block.

Why it exists: under the loader, rank 0 reads and the other ranks build on `meta` until
`prepare` fills them. A model that is never prepared (a frozen teacher, an eval copy, a model
exported on the main process only) needs a full copy on the ranks that load it. Inside the block
the loader steps aside, and so does transformers' own FSDP gate (`FSDP_CPU_RAM_EFFICIENT_LOADING`,
which would otherwise put non-local-rank-0 parameters on meta too): each calling rank reads the
whole checkpoint itself, as it would without the plugin. The block needs no collective, so any
subset of ranks may enter it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# Loads can come from any thread, and the environment variable is process-wide anyway: count
# open blocks per process, under a lock, and restore the variable when the last one closes.
_lock = threading.Lock()
_user_depth = 0  # open `local_loading()` blocks: the loader steps aside
_gate_depth = 0  # open blocks of either kind: the variable reads "false" for transformers
_saved_env: str | None = None  # the variable's value before the first open block: the user's switch
_GATE = "FSDP_CPU_RAM_EFFICIENT_LOADING"  # accelerate's switch, which transformers' gate reads
_TRUE = ("y", "yes", "t", "true", "on", "1")  # accelerate's `str_to_bool`
# Said wherever a load only some ranks make meets the loader (a guard, a wait, a read before prepare).
LOCAL_LOADING_HINT = (
    "If only some ranks load this model (an eval copy, a teacher or reference model that is never passed "
    "to prepare), load it inside `with fsdp_offload_cfg.local_loading():` for a full copy on the ranks "
    "that call it."
)


def rank0_loading_wanted() -> bool:
    """Should a load starting now go through the loader (the config having asked for it)?

    Not inside `local_loading()`. Otherwise accelerate's documented run-time switch decides:
    `disable_/enable_fsdp_ram_efficient_loading()` set `FSDP_CPU_RAM_EFFICIENT_LOADING` (unset:
    the config decides). While `transformers_fsdp_gate_off` holds the variable at "false" for
    transformers' sake, the value it saved is the user's switch.
    """
    with _lock:
        if _user_depth > 0:
            return False
        value = _saved_env if _gate_depth > 0 else os.environ.get(_GATE)
    return value is None or value.strip().lower() in _TRUE


@contextmanager
def transformers_fsdp_gate_off() -> Iterator[None]:
    """transformers loads as on a single process: no rank treats itself as "not local rank 0".

    Used by `local_loading()` and by the sharded loader's meta load, where every rank must come
    out of `from_pretrained` like rank 0 (transformers 4.57 keeps missing keys on meta elsewhere,
    5.9-5.22 fill every tensor with `zeros_like` there: transformers #45649).
    """
    global _gate_depth, _saved_env
    with _lock:
        if _gate_depth == 0:
            _saved_env = os.environ.get(_GATE)
            os.environ[_GATE] = "false"
        _gate_depth += 1
    try:
        yield
    finally:
        with _lock:
            _gate_depth -= 1
            if _gate_depth == 0:
                if _saved_env is None:
                    os.environ.pop(_GATE, None)
                else:
                    os.environ[_GATE] = _saved_env


@contextmanager
def local_loading() -> Iterator[None]:
    """Load full models on the calling rank(s) only, exactly as stock transformers would.

    Example (a teacher that is never prepared, or a copy only the main process uses)::

        with fsdp_offload_cfg.local_loading():
            teacher = AutoModelForCausalLM.from_pretrained(path)
    """
    global _user_depth
    with _lock:
        _user_depth += 1
    try:
        with transformers_fsdp_gate_off():
            yield
    finally:
        with _lock:
            _user_depth -= 1
