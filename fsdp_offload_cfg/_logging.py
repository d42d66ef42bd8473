"""The package logger: visible by default (INFO to stderr), one place to silence it.

Loading a 70B model takes minutes; users must see progress without configuring logging.
`FSDP_OFFLOAD_CFG_LOG_LEVEL=WARNING` quiets it; attaching handlers upstream is respected.
"""

from __future__ import annotations

import logging
import os
import sys

_ROOT = "fsdp_offload_cfg"


def get_logger(name: str = _ROOT) -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not getattr(root, "_fsdp_offload_cfg_configured", False):
        root.setLevel(os.environ.get("FSDP_OFFLOAD_CFG_LOG_LEVEL", "INFO").upper())
        if not root.handlers:
            handler = logging.StreamHandler(sys.stderr)
            rank = os.environ.get("RANK", "0")
            handler.setFormatter(logging.Formatter(f"[fsdp_offload_cfg rank {rank}] %(message)s"))
            root.addHandler(handler)
            root.propagate = False
        root._fsdp_offload_cfg_configured = True  # type: ignore[attr-defined]
    return logging.getLogger(name)


def is_rank0() -> bool:
    """Global rank 0, by process group if up, else by the launcher's environment."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"
