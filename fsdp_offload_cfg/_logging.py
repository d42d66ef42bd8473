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
    root = _own_logger(_ROOT)
    if not getattr(root, "_fsdp_offload_cfg_configured", False):
        root.setLevel(os.environ.get("FSDP_OFFLOAD_CFG_LOG_LEVEL", "INFO").upper())
        if not root.handlers:
            handler = _StderrHandler()
            rank = os.environ.get("RANK", "0")
            handler.setFormatter(logging.Formatter(f"[fsdp_offload_cfg rank {rank}] %(message)s"))
            root.addHandler(handler)
            root.propagate = False
        root._fsdp_offload_cfg_configured = True  # type: ignore[attr-defined]
    return _own_logger(name)


class _StderrHandler(logging.StreamHandler):
    """Writes to `sys.stderr` as it is at each record, not as it was when the package was
    imported: test runners and frameworks swap it (pytest's capture, closed by the time the exit
    summary logs; axolotl's tee into its debug.log). As `logging.lastResort` does."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr


def counted(n: int, noun: str) -> str:
    """"1 file", "2 files": the counts in log lines a user reads (a small model is one file)."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _own_logger(name: str) -> logging.Logger:
    """`logging.getLogger(name)`, without the filters a framework's logger class puts on every
    logger created after it is installed: axolotl's `AxolotlLogger` drops every INFO line of other
    packages, ours included (the line saying the plugin is on, loading progress, the offload's
    summary). Only at creation: filters a user adds later stay."""
    existing = logging.Logger.manager.loggerDict.get(name)
    logger = logging.getLogger(name)
    if (existing is None or isinstance(existing, logging.PlaceHolder)) and type(logger) is not logging.Logger:
        logger.filters.clear()
    return logger


def is_rank0() -> bool:
    """Global rank 0, by process group if up, else by the launcher's environment."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"
