"""`resize_token_embeddings` on a loader-built model: the shape on every rank, the values from rank 0.

Why: frameworks add tokens between `from_pretrained` and `prepare` (TRL's `setup_chat_format` and
`clone_chat_template`, LlamaFactory's `resize_vocab`, the everyday
`model.resize_token_embeddings(len(tokenizer))`). transformers initialises the new rows from the
mean and covariance of the old ones, reading their values, which a rank on `meta` does not hold:
every rank other than 0 died there ("Tensor.item() cannot be called on meta tensors").

The rule (docs/loading.md, "Between from_pretrained and prepare"): an op that only changes shapes
replays on the meta ranks; values come from the rank that holds them. Here:
  1. rank 0 resizes for real. Under "sharded" it holds no weights yet, so it first reads the old
     input (and untied output) embedding from the checkpoint files: the few tensors the op needs;
  2. the other ranks resize on meta (the same shapes, no values: new rows are not initialised) and
     take rank 0's RNG state afterwards, as they take it after a load: a plain run draws the same
     new rows on every rank from the same seed, so every rank continues with the same RNG stream;
  3. the resized tensors leave the checkpoint record (their shape no longer matches the file):
     `load_into_sharded` sends them from rank 0 with the rest of what rank 0 alone holds.
Like a load, the call makes no collective (rank 0 posts through the store: `Rank0Mailbox`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_offload_cfg import model_state
from fsdp_offload_cfg.loading.checkpoint import FileTensor, record_of
from fsdp_offload_cfg.loading.local import LOCAL_LOADING_HINT
from fsdp_offload_cfg.loading.mailbox import Rank0Mailbox
from fsdp_offload_cfg.loading.meta import is_rank0_source
from fsdp_offload_cfg.loading.pending import read_in_place
from fsdp_offload_cfg.ranks import attempt, describe_error, distributed_ready


def build_resize_token_embeddings(original: Callable[..., Any], cfg: Any) -> Callable[..., Any]:
    """`PreTrainedModel.resize_token_embeddings` as the module docstring says, for loader-built
    models in a multi-rank run; the original everywhere else."""

    @functools.wraps(original)
    def resize_token_embeddings(self: nn.Module, new_num_tokens: int | None = None,
                                pad_to_multiple_of: int | None = None, mean_resizing: bool = True) -> Any:
        if not (is_rank0_source(self) and distributed_ready()) or (new_num_tokens, pad_to_multiple_of) == (None, None):
            return original(self, new_num_tokens, pad_to_multiple_of, mean_resizing)
        in_files = _take_from_record(self, _embedding_tensors(self))  # resized, they no longer match the files
        mailbox = Rank0Mailbox(_key(self, new_num_tokens, pad_to_multiple_of, mean_resizing),
                               f"resize the token embeddings to {new_num_tokens}")
        if dist.get_rank() == 0:
            mailbox.start()

            def on_rank0() -> Any:
                _read_from_checkpoint(in_files)
                return original(self, new_num_tokens, pad_to_multiple_of, mean_resizing)

            result, error = attempt(on_rank0)
            error = mailbox.post((describe_error(error) if error else None, torch.get_rng_state())) or error
            if error is not None:
                raise error
        else:
            message, rng_state = mailbox.receive(f"Resize on every rank. {LOCAL_LOADING_HINT}")
            if message is not None:
                raise RuntimeError(f"rank 0 failed to resize the token embeddings: {message}")
            result = original(self, new_num_tokens, pad_to_multiple_of, False)  # shapes only: new rows on meta
            torch.set_rng_state(rng_state)
        return result

    return resize_token_embeddings


def _embedding_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The input embedding weight, and the output embedding's weight and bias when they exist."""
    tensors = []
    for module in (model.get_input_embeddings(), getattr(model, "get_output_embeddings", lambda: None)()):
        for name in ("weight", "bias"):
            t = getattr(module, name, None) if module is not None else None
            if isinstance(t, torch.Tensor) and not any(t is s for s in tensors):
                tensors.append(t)
    return tensors


def _key(model: nn.Module, *arguments: Any) -> str:
    """The same on every rank for the same resize of the same load (pairs it like a load)."""
    call = model_state.found(model, "load_call")
    text = json.dumps([getattr(call, "digest", None), type(model).__qualname__, *arguments])
    return "resize:" + hashlib.sha1(text.encode()).hexdigest()


def _take_from_record(model: nn.Module, tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, FileTensor]]:
    """Remove `tensors` from the model's checkpoint record; the file tensor behind each that had one."""
    record = record_of(model)
    if record is None:
        return []
    taken = [(t, where) for t in tensors if (where := record.lookup(t)) is not None]
    for t, _ in taken:
        record.forget(t)
    return taken


def _read_from_checkpoint(in_files: list[tuple[torch.Tensor, FileTensor]]) -> None:
    """Rank 0 under "sharded": the values of the tensors the resize reads, from the files, in
    place (`pending.read_in_place`: a tied head keeps sharing the embedding)."""
    for t, where in in_files:
        if t.is_meta:
            read_in_place(t, where)
