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
_depth = 0
_saved_env: str | None = None
_GATE = "FSDP_CPU_RAM_EFFICIENT_LOADING"


def local_loading_active() -> bool:
    """True inside a `local_loading()` block (the loader patches then call the originals)."""
    return _depth > 0


@contextmanager
def local_loading() -> Iterator[None]:
    """Load full models on the calling rank(s) only, exactly as stock transformers would.

    Example (a teacher that is never prepared, or a copy only the main process uses)::

        with fsdp_offload_cfg.local_loading():
            teacher = AutoModelForCausalLM.from_pretrained(path)
    """
    global _depth, _saved_env
    with _lock:
        if _depth == 0:
            _saved_env = os.environ.get(_GATE)
            os.environ[_GATE] = "false"
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if _saved_env is None:
                    os.environ.pop(_GATE, None)
                else:
                    os.environ[_GATE] = _saved_env
