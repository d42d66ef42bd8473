"""The loss heads TRL runs in place of the model's own, for the probe (`probe.measure_activations`).

Why: the probe runs the model's forward with labels, whose head is the output layer over every
position and a cross-entropy over the full logits (batch x sequence x vocabulary, upcast to
float32): at long sequences the largest activation of all (a 3B Llama at 8k tokens: 7.8 GiB in
the head's backward). TRL (1.15 on; this package takes 1.16) never makes those logits:

- `trl sft`, `dpo`, `kto`, `grpo`, `rloo` patch the model with a fused LM head
  (`add_fused_lm_head`): the backbone runs, the hidden states of the labelled positions are
  selected, and `ChunkedLogProbFunction` (`trl/kernels/chunked_logprob.py`) projects them
  through the output layer one tile at a time, keeping each token's log-probability;
- `trl distillation` runs the student's backbone, keeps the hidden states of the last
  `max_completion_length` positions, and `ChunkedDivergenceFunction`
  (`trl/kernels/chunked_divergence.py`) projects them, and the teacher's, through each model's
  output layer one tile at a time.

What each holds instead, read from TRL's code (the CUDA path, where only the valid positions
are projected; N: those of the micro-batch, every one counted as valid):

- saved for backward: the selected hidden states (a copy, N x H in the compute dtype) and the
  selection's boolean mask; the fused head also the N targets (int64) and two float32
  statistics a token; the divergence the teacher's states (N x H_teacher in the teacher's
  dtype) and three float32 statistics a token;
- in the backward, beside those: float32 accumulators of the hidden states' gradient (N x H)
  and, where the output layer trains, of its weight's (vocabulary x H), the tiles (the fused
  head: one of min(N, 4096) x 32768 in the compute dtype; the divergence: two such in float32,
  and a tile's gradient cast to the compute dtype, two while one round casts the next), each
  weight chunk cast to the compute dtype where the weight is in another (a float32 teacher
  under autocast), and both gradients cast back to their dtypes as it returns.

A stand-in for the output layer saves and allocates exactly those on `meta`, so the probe's
record of the forward and its measured backward hold them as they hold every other save: the
estimate's head is then TRL's, not a cross-entropy's. Both are checked against TRL's own code
run on meta (`tests/test_heads.py`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

# TRL 1.16's tiles: tokens by vocabulary entries (`chunked_divergence.py`, `chunked_logprob.py`,
# `trainer/utils.py`'s `_CHUNKED_LOGPROB_CHUNK_SIZE`)
TOKEN_CHUNK_SIZE = 4096
VOCAB_CHUNK_SIZE = 32768


@dataclass(frozen=True)
class FusedLogProbs:
    """TRL's fused LM head (`add_fused_lm_head`) over the positions that predict the last
    `completion_tokens` tokens (GRPO's and RLOO's labels: the completion), None: every position
    but the last (all labelled); `autocast`: the dtype mixed precision's autocast computes in
    (None without)."""

    key: ClassVar[str] = "trl_fused_lm_head"
    autocast: torch.dtype | None = None
    completion_tokens: int | None = None


@dataclass(frozen=True)
class ChunkedDistillation:
    """TRL's distillation head: the divergence over the last `completion_tokens` positions
    against a teacher whose hidden states are `teacher_hidden` wide, in `teacher_dtype` (its
    load dtype); `autocast`: the dtype mixed precision's autocast computes in (None without),
    which TRL projects both models' tiles in."""

    key: ClassVar[str] = "trl_chunked_distillation"
    completion_tokens: int
    teacher_hidden: int
    teacher_dtype: torch.dtype
    autocast: torch.dtype | None = None


Head = FusedLogProbs | ChunkedDistillation
# each head's `key` (the JSON's `inputs.loss_head`), in words
HEAD_WORDS = {FusedLogProbs.key: "TRL's fused LM head", ChunkedDistillation.key: "TRL's chunked distillation"}


class _ChunkedLogProbs(torch.autograd.Function):
    """Stand-in for TRL's fused LM head on `meta` (module docstring): the selection, the saves of
    `ChunkedLogProbFunction`, and its backward's allocations in its loop's order, no arithmetic.
    Returns the per-token log-probabilities, batch x (sequence - 1), float32."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, head: FusedLogProbs) -> torch.Tensor:
        selected = _selected(ctx, hidden, weight, head)
        tokens = selected.shape[0]
        mask = selected.new_empty((hidden.shape[0], hidden.shape[1] - 1), dtype=torch.bool)  # also the scatter's
        targets = selected.new_empty((tokens,), dtype=torch.int64)
        stats = [selected.new_empty((tokens,), dtype=torch.float32) for _ in range(2)]  # log-partition, entropy
        ctx.save_for_backward(selected, mask, targets, *stats)
        return selected.new_empty(mask.shape, dtype=torch.float32)  # scattered back over every position

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        selected = ctx.saved_tensors[0]
        (vocab, width), tokens = ctx.vocab_shape, selected.shape[0]
        dtype = ctx.head.autocast or selected.dtype  # TRL's compute dtype
        sums = _gradient_sums(ctx, selected)
        tile = selected.new_empty((min(tokens, TOKEN_CHUNK_SIZE), VOCAB_CHUNK_SIZE), dtype=dtype)
        chunk = None  # this token chunk's states in the compute dtype
        for start in range(0, tokens, TOKEN_CHUNK_SIZE):
            chunk = selected[start:start + TOKEN_CHUNK_SIZE].to(dtype)  # a copy where the dtypes differ
            for first in range(0, vocab, VOCAB_CHUNK_SIZE):
                _transient(selected, (min(VOCAB_CHUNK_SIZE, vocab - first), width), dtype, ctx.weight_dtype != dtype)
        returned = _cast_back(ctx, selected, *sums)
        del sums, tile, chunk  # TRL returns the casts; the rest goes with it
        return _scattered(ctx, *returned)


class _ChunkedDivergence(torch.autograd.Function):
    """Stand-in for TRL's `ChunkedDivergenceFunction` on `meta` (module docstring): its saves,
    and its backward's allocations in the order its loop makes and drops them, no arithmetic.
    Returns the per-token divergence."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, head: ChunkedDistillation) -> torch.Tensor:
        student = _selected(ctx, hidden, weight, head)
        tokens = student.shape[0]
        positions = student.new_empty((tokens,), dtype=torch.bool)  # the selection's mask, for its backward
        teacher = student.new_empty((tokens, head.teacher_hidden), dtype=head.teacher_dtype)
        stats = [student.new_empty((tokens,), dtype=torch.float32) for _ in range(3)]  # log-partitions, aux
        ctx.save_for_backward(student, positions, teacher, *stats)
        return student.new_empty((tokens,), dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        student, _, teacher = ctx.saved_tensors[:3]
        head, (vocab, width) = ctx.head, ctx.vocab_shape
        tokens = student.shape[0]
        s_dtype, t_dtype = head.autocast or student.dtype, head.autocast or teacher.dtype  # TRL's `_compute_dtype`
        sums = _gradient_sums(ctx, student)
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
        returned = _cast_back(ctx, student, *sums)
        del sums, tiles, tile_gradient, h_s, h_t  # TRL returns the casts; the rest goes with it
        return _scattered(ctx, *returned)


def _selected(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, head: Head) -> torch.Tensor:
    """The scored positions' hidden states, a copy (TRL's boolean selection), batch x positions
    rows: every position but the last (it predicts no token), or the last `completion_tokens`
    of those; and what the backward needs to know of the call, kept on `ctx`."""
    kept = hidden[:, :-1, :]
    if head.completion_tokens is not None:
        kept = kept[:, -head.completion_tokens:, :]
    ctx.head, ctx.hidden_shape, ctx.vocab_shape = head, hidden.shape, weight.shape
    ctx.weight_dtype, ctx.weight_trains = weight.dtype, weight.requires_grad
    return kept.reshape(-1, kept.shape[-1]).clone()


def _gradient_sums(ctx: Any, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TRL's float32 accumulators of the states' gradient and, where the output layer trains, of
    its weight's (vocabulary x hidden)."""
    weight_sum = states.new_empty(ctx.vocab_shape, dtype=torch.float32) if ctx.weight_trains else None
    return states.new_empty(states.shape, dtype=torch.float32), weight_sum


def _cast_back(ctx: Any, states: torch.Tensor, states_sum: torch.Tensor,
               weight_sum: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Both sums cast to their tensors' dtypes, as TRL's backward returns them (while everything
    its loop made is still held)."""
    return states_sum.to(states.dtype), weight_sum.to(ctx.weight_dtype) if weight_sum is not None else None


def _scattered(ctx: Any, grad_states: torch.Tensor, grad_weight: torch.Tensor | None) -> tuple:
    """The backward's result: the selection's backward scatters the states' gradient into the
    hidden states' shape."""
    return grad_states.new_zeros(ctx.hidden_shape), grad_weight, None


def _transient(like: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype, made: bool) -> None:
    """A tensor that lives for one op (a weight chunk cast for a matmul), where it is `made`."""
    if made:
        like.new_empty(shape, dtype=dtype)


def is_trl_fused_forward(forward: Any) -> bool:
    """Whether `forward` (a model's instance `forward`) is the one TRL's `add_fused_lm_head` sets,
    as its trainers do before training (so the activation budget, planning at the first step,
    finds it): made from its `_fused_forward`, which `functools.wraps` names as the model's own;
    its code keeps TRL's name and file."""
    code = getattr(getattr(forward, "__func__", forward), "__code__", None)
    return code is not None and code.co_name == "_fused_forward" and "trl" in code.co_filename.split(os.sep)


@contextmanager
def head_replaced(model: nn.Module, head: Head | None) -> Iterator[None]:
    """While the block runs, the model's output layer is `head`'s stand-in (nothing changes for
    None). The forward must run without labels: the model's output `logits` are then the
    per-token log-probabilities or divergence, whose sum stands for the loss TRL takes the
    backward of."""
    layer = model.get_output_embeddings() if head is not None else None
    if layer is None:
        yield
        return
    stand_in = _ChunkedLogProbs if isinstance(head, FusedLogProbs) else _ChunkedDivergence

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return stand_in.apply(hidden, layer.weight, head)

    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward  # the class's own forward again
