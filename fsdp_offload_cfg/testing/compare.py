"""Tensors compared bit for bit across processes: a digest is small to send back from a rank and
equal only where dtype, shape and every byte are."""

from __future__ import annotations

import hashlib

import torch


def digest(t: torch.Tensor) -> str:
    """`dtype:shape:sha1` of the tensor's bytes (a DTensor's local part: gather it first)."""
    t = t.detach().cpu().contiguous()
    return f"{t.dtype}:{tuple(t.shape)}:" + hashlib.sha1(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """`digest` of every tensor of a state dict."""
    return {name: digest(t) for name, t in state.items()}
