"""The loss head a trainer runs in place of the model's own, for the probe (`probe.measure_activations`).

Why: the probe runs the model's forward with labels, whose head is the output layer over every
position and a cross-entropy over the full logits (batch x sequence x vocabulary, upcast to
float32): at long sequences the largest activation of all (a 3B Llama at 8k tokens: 7.8 GiB in
the head's backward). TRL's distillation (`trl distillation`, `DistillationTrainer` of TRL 1.16)
never makes those logits. It runs the student's backbone, keeps the hidden states of the last
`max_completion_length` positions, and its `ChunkedDivergenceFunction`
(`trl/kernels/chunked_divergence.py`) projects them, and the teacher's, through each model's
output layer one tile at a time. What that holds instead, read from TRL's code (the CUDA path,
where only the completion's positions are projected):

- saved for backward: the student's selected hidden states (a copy, N x H in the compute dtype)
  and their positions (the selection's boolean mask), the teacher's (N x H_teacher in the
  teacher's dtype) and three float32 statistics a token;
- in its backward, beside those: float32 accumulators of the hidden states' gradient (N x H)
  and, where the output layer trains, of its weight's (vocabulary x H), two float32 tiles of
  min(N, 4096) x 32768 logits, a tile's gradient cast to the compute dtype (two while one round
  casts the next; the last round's, a partial tile where the vocabulary ends, as it returns),
  and both gradients cast back to their dtypes as it returns.

(N: the completion's tokens of the micro-batch, every one counted as valid.) A stand-in for the
output layer saves and allocates exactly those on `meta`, so the probe's record of the forward
and its measured backward hold them as they hold every other save: the estimate's head is then
TRL's, not a cross-entropy's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# TRL 1.16's tile of the chunked divergence: tokens by vocabulary entries (`chunked_divergence.py`)
TOKEN_CHUNK_SIZE = 4096
VOCAB_CHUNK_SIZE = 32768


@dataclass(frozen=True)
class ChunkedDistillation:
    """TRL's distillation head: the divergence over the last `completion_tokens` positions
    against a teacher whose hidden states are `teacher_hidden` wide, in `teacher_dtype` (its
    load dtype); `autocast`: the dtype mixed precision's autocast computes in (None without),
    which TRL projects both models' tiles in."""

    completion_tokens: int
    teacher_hidden: int
    teacher_dtype: torch.dtype
    autocast: torch.dtype | None = None


class _ChunkedDivergence(torch.autograd.Function):
    """Stand-in for TRL's `ChunkedDivergenceFunction` on `meta` (module docstring): its saves,
    and its backward's allocations in the order its loop makes and drops them, no arithmetic.
    Returns the per-token divergence."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, head: ChunkedDistillation) -> torch.Tensor:
        kept = hidden[:, -head.completion_tokens:, :]
        student = kept.reshape(-1, kept.shape[-1]).clone()  # the valid positions, selected: a copy
        tokens = student.shape[0]
        positions = student.new_empty((tokens,), dtype=torch.bool)  # the selection's mask, for its backward
        teacher = student.new_empty((tokens, head.teacher_hidden), dtype=head.teacher_dtype)
        stats = [student.new_empty((tokens,), dtype=torch.float32) for _ in range(3)]  # log-partitions, aux
        ctx.save_for_backward(student, positions, teacher, *stats)
        ctx.head, ctx.hidden_shape, ctx.vocab_shape = head, hidden.shape, weight.shape
        ctx.weight_dtype, ctx.weight_trains = weight.dtype, weight.requires_grad
        return student.new_empty(kept.shape[:2], dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        student, _, teacher = ctx.saved_tensors[:3]
        head, (vocab, width) = ctx.head, ctx.vocab_shape
        tokens = student.shape[0]
        s_dtype, t_dtype = head.autocast or student.dtype, head.autocast or teacher.dtype  # TRL's `_compute_dtype`
        hidden_sum = student.new_empty(student.shape, dtype=torch.float32)
        weight_sum = student.new_empty(ctx.vocab_shape, dtype=torch.float32) if ctx.weight_trains else None
        rows = min(tokens, TOKEN_CHUNK_SIZE)
        tiles = [student.new_empty((rows, VOCAB_CHUNK_SIZE), dtype=torch.float32) for _ in range(2)]
        tile_gradient = None  # each round's replaces the last's only once made: two are held meanwhile
        for start in range(0, tokens, TOKEN_CHUNK_SIZE):
            n = min(TOKEN_CHUNK_SIZE, tokens - start)
            h_s, h_t = student[start:start + n].to(s_dtype), teacher[start:start + n].to(t_dtype)  # copies if cast
            for first in range(0, vocab, VOCAB_CHUNK_SIZE):
                chunk = min(VOCAB_CHUNK_SIZE, vocab - first)
                # each projection casts its weight chunk where the weight is not in the tile's dtype
                _transient(student, (chunk, width), s_dtype, ctx.weight_dtype != s_dtype)
                _transient(student, (chunk, head.teacher_hidden), t_dtype, head.teacher_dtype != t_dtype)
                tile_gradient = student.new_empty((n, chunk), dtype=s_dtype)
        grad_student = hidden_sum.to(student.dtype)
        grad_weight = weight_sum.to(ctx.weight_dtype) if weight_sum is not None else None
        del hidden_sum, weight_sum, tiles, tile_gradient, h_s, h_t  # TRL returns the casts; the rest goes with it
        grad_hidden = grad_student.new_zeros(ctx.hidden_shape)  # the selection's backward scatters into it
        return grad_hidden, grad_weight, None


def _transient(like: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype, made: bool) -> None:
    """A tensor that lives for one op (a weight chunk cast for a matmul), where it is `made`."""
    if made:
        like.new_empty(shape, dtype=dtype)


@contextmanager
def head_replaced(model: nn.Module, head: ChunkedDistillation | None) -> Iterator[None]:
    """While the block runs, the model's output layer is `head`'s stand-in (nothing changes for
    None). The forward must run without labels: the model's output `logits` are then the
    per-token divergence, whose sum is the loss TRL takes the backward of."""
    layer = model.get_output_embeddings() if head is not None else None
    if layer is None:
        yield
        return

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return _ChunkedDivergence.apply(hidden, layer.weight, head)

    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward  # the class's own forward again
