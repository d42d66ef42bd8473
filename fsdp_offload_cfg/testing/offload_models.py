"""Shared builders for the activation offload tests (no tests here).

Importable by name, so that the gloo ranks `testing.dist` starts can use them too.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn


def settle_offload_stats() -> None:
    """Restart the offload counters from a settled process, for tests that assert absolute figures.

    A test that fails mid-step leaves its exception with pytest: in `sys.last_value` (for a
    post-mortem, until the next test's call phase, after its fixtures ran), and in a reference cycle
    (traceback, frames, their locals). The activations its forward saved stay alive, and counted
    resident, until both let go. Unsettled, one failure made every later test that asserts
    `resident_bytes == 0` fail too (seen: a failed compile test took three memory tests with it).
    The offload itself leaves no cycle: a failed step's activations go when its exception does.
    A collection costs ~0.2 s, so it runs only when something is resident."""
    from fsdp_offload_cfg.offload.stats import offload_stats, reset_offload_stats

    if offload_stats()["resident_bytes"]:
        for name in ("last_exc", "last_type", "last_value", "last_traceback"):
            sys.__dict__.pop(name, None)  # what pytest would drop at the next call phase
        gc.collect()
    reset_offload_stats()


def tiny_llama(layers: int = 4, hidden: int = 64, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """A transformers Llama small enough for 2 shared cores; eager attention for determinism."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
        use_cache=False,  # a cache would grow again during checkpoint recomputation
    )
    return LlamaForCausalLM(cfg).to(dtype)


def batch(seed: int = 1, bsz: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 128, (bsz, seq), generator=torch.Generator().manual_seed(seed))


def llama_step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach()


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


class Probe(torch.autograd.Function):
    """Saves the given tensors; backward hands what autograd restored to `Probe.sink`."""

    sink: ClassVar[list[list[torch.Tensor]]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *saved: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*saved)
        ctx.n = len(saved)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        Probe.sink.append(list(ctx.saved_tensors))
        return (g,) + (None,) * ctx.n


class Block(nn.Module):
    """One group: a linear + tanh residual, plus whatever `extra(self, x)` wants saved via Probe."""

    def __init__(self, d: int = 32, extra: Callable[[nn.Module, torch.Tensor], list[torch.Tensor]] | None = None,
                 fail: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.extra = extra
        self.fail = fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x)) + x
        if self.extra is not None:
            y = Probe.apply(y, *self.extra(self, y))
        if self.fail:
            raise RuntimeError("boom mid-forward")
        return y


class Net(nn.Module):
    def __init__(self, n: int = 4, d: int = 32, extra: Any = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(Block(d, extra) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).pow(2).sum()
