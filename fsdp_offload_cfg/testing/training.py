"""The few training steps the distributed tests compare across loader modes: the same tokens on
every run of a rank (a generator seeded by step and rank, never the global one, so a load that
draws random numbers cannot shift the batches), through `accelerator.backward`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def train_steps(accelerator: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, *,
                steps: int = 2, vocab: int = 97, labels: Callable[[torch.Tensor], torch.Tensor] | None = None,
                **forward: Any) -> list[float]:
    """`steps` optimizer steps on batches of 2 x 12 random token ids in [1, vocab) (0 is often the
    pad id), labels the ids unless `labels(ids)` says otherwise; `forward` goes to the model's
    call (`use_cache=False`). Returns each step's loss."""
    losses = []
    for step in range(steps):
        ids = torch.randint(1, vocab, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(input_ids=ids, labels=ids if labels is None else labels(ids), **forward).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
