"""The estimate's stand-in for TRL's distillation head (`estimate/heads.py`) against TRL's own
code: TRL 1.16's `_chunked_divergence_loss` run on `meta` on its CUDA path (only the
completion's positions projected), measured by a tracker of this file's own (every storage a
save or an op makes, held by weak reference), beside the stand-in measured the same way. The
estimate's use of it for `trl distillation` is tested in tests/test_estimate.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_offload_cfg.estimate.heads import ChunkedDistillation, _ChunkedDivergence

BATCH, SEQ, TEACHER_HIDDEN, VOCAB, COMPLETION = 2, 384, 96, 70_000, 256


class _Live(TorchDispatchMode):
    """The most bytes alive at once, of the storages it is shown and those its ops make."""

    def __init__(self, shown: list[torch.Tensor], ignored: set[int]) -> None:
        super().__init__()
        self.ignored = ignored  # the weights' and the input's storages (a slice of the weight is no new memory)
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        for t in shown:
            self.add(t)
        self.peak = self.now()

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage._cdata in self.ignored:
            return
        self.refs.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))

    def now(self) -> int:
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        return sum(n for _, n in self.refs.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.add(t)
        self.peak = max(self.peak, self.now())
        return out


def _measured(loss: Any, outside: list[torch.Tensor], asked: list[torch.Tensor]) -> tuple[int, int]:
    """Bytes `loss()` saves for backward (its own storages, not those of `outside`: the weights,
    the input), and the most its backward to `asked` holds beyond those saves. On meta, every
    selected position counted valid (TRL selects the valid ones with a boolean mask)."""
    from torch.fx.experimental import _config

    from fsdp_offload_cfg.compat.model_init import meta_forward  # transformers' mask checks, made meta-safe

    ignored = {t.untyped_storage()._cdata for t in outside}
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage()._cdata not in ignored:
            saved.setdefault(t.untyped_storage()._cdata, t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), meta_forward(), \
            _config.patch(meta_nonzero_assume_all_nonzero=True):
        result = loss()
    saved_bytes = sum(t.untyped_storage().nbytes() for t in saved.values())
    live = _Live(list(saved.values()), ignored)
    saved.clear()
    with live:
        torch.autograd.grad(result, asked)
    return saved_bytes, live.peak - saved_bytes


def _head_measured(loss_of: Any, weights: list[torch.Tensor], hidden_size: int) -> tuple[int, int]:
    """`_measured` of a head given the last layer's hidden states, completion last."""
    hidden = torch.empty(BATCH, SEQ, hidden_size, device="meta", dtype=torch.bfloat16, requires_grad=True)
    return _measured(lambda: loss_of(hidden[:, -COMPLETION:, :]), [hidden, *weights], [hidden])


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
@pytest.mark.parametrize("hidden_size", [64, 1024])
@pytest.mark.parametrize("trains_head", [True, False])
def test_the_stand_in_holds_what_trls_chunked_divergence_holds(trains_head: bool, hidden_size: int,
                                                                autocast: torch.dtype | None,
                                                                monkeypatch: pytest.MonkeyPatch):
    """Saved bytes and the backward's bytes beyond them, within 1%, with the output layer trained
    (full fine-tune: a float32 sum of its gradient, vocabulary x hidden) and frozen (LoRA); the
    tiles the most of it (hidden 64) or the gradient's sums and casts (1024); a float32 teacher
    without autocast and under bf16 mixed precision's autocast (each of its weight chunks cast for
    its projection: TRL's default, a float32 teacher beside a bf16-trained student)."""
    distillation = pytest.importorskip("trl.trainer.distillation_trainer")
    if not hasattr(distillation, "_chunked_divergence_loss"):
        pytest.skip("this TRL computes its distillation loss otherwise")  # TRL < 1.15; the package needs 1.16
    monkeypatch.setattr(distillation, "_use_triton", lambda device: True)  # the CUDA path's selection
    kernels = pytest.importorskip("trl.kernels.chunked_divergence")
    # on CUDA these write into their buffers and allocate nothing: Triton kernels for the tiles'
    # folds, float32-output matmuls (`out_dtype`) for the projections and the gradient sums; the
    # torch fallbacks TRL runs elsewhere (and so on meta) make float32 copies instead. What CUDA
    # does allocate there is kept: a projection's weight chunk in the tile's dtype
    for in_place in ("_stats_tile", "_jsd_tile", "_backward_tile", "_addmm_fp32"):
        monkeypatch.setattr(kernels, in_place, lambda *args, **kwargs: None)
    monkeypatch.setattr(kernels, "_project", lambda tile, hidden, weight, bias, start, end, dtype:
                        weight[start:end].to(dtype))
    enabled, dtype_of = torch.is_autocast_enabled, torch.get_autocast_dtype  # meta has no autocast of its own
    monkeypatch.setattr(torch, "is_autocast_enabled",
                        lambda *a: autocast is not None if a and a[0] == "meta" else enabled(*a))
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda *a: autocast if a and a[0] == "meta" else dtype_of(*a))
    weight = torch.nn.Parameter(torch.empty(VOCAB, hidden_size, device="meta", dtype=torch.bfloat16),
                                requires_grad=trains_head)
    teacher_weight = torch.empty(VOCAB, TEACHER_HIDDEN, device="meta", dtype=torch.float32)
    mask = torch.ones(BATCH, COMPLETION, dtype=torch.long, device="meta")

    def trls(kept: torch.Tensor) -> torch.Tensor:
        teacher = torch.empty(BATCH, COMPLETION, TEACHER_HIDDEN, device="meta", dtype=torch.float32)
        return distillation._chunked_divergence_loss(kept, teacher, weight, teacher_weight, mask, beta=0.5,
                                                     temperature=1.0)[0]

    head = ChunkedDistillation(COMPLETION, TEACHER_HIDDEN, torch.float32, autocast)

    def ours(kept: torch.Tensor) -> torch.Tensor:  # the probe hands the stand-in every position
        full = torch.cat([kept.new_empty(BATCH, SEQ - COMPLETION, hidden_size), kept], dim=1)
        return _ChunkedDivergence.apply(full, weight, head).sum()

    trl_saved, trl_backward = _head_measured(trls, [weight, teacher_weight], hidden_size)
    our_saved, our_backward = _head_measured(ours, [weight, teacher_weight], hidden_size)
    assert trl_saved > 0 and abs(our_saved - trl_saved) <= trl_saved / 100, (our_saved, trl_saved)
    assert abs(our_backward - trl_backward) <= trl_backward / 100, (our_backward, trl_backward)


def _model_measured(model: torch.nn.Module, loss_of: Any) -> tuple[int, int]:
    """`_measured` of a whole model's forward, its backward to the embedding."""
    trained = [p for p in model.parameters() if p.requires_grad][:1]
    return _measured(lambda: loss_of(model), list(model.parameters()), trained)


@pytest.mark.parametrize("hidden_size", [64, 1024])
@pytest.mark.parametrize("trains_head", [True, False])
def test_the_stand_in_holds_what_trls_fused_lm_head_holds(trains_head: bool, hidden_size: int,
                                                         monkeypatch: pytest.MonkeyPatch):
    """TRL's `add_fused_lm_head` (what `trl sft`, `dpo`, `kto`, `grpo`, `rloo` train through) on a
    one-layer Llama on meta against the same model with the stand-in for its output layer: saved
    bytes and the backward's bytes beyond them within 1%, the output layer trained and frozen."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp_offload_cfg.estimate.heads import FusedLogProbs, head_replaced

    utils = pytest.importorskip("trl.trainer.utils")
    if not hasattr(utils, "add_fused_lm_head"):
        pytest.skip("this TRL computes the logits whole")  # TRL < 1.15; the package needs 1.16
    kernels = pytest.importorskip("trl.kernels.chunked_logprob")
    monkeypatch.setattr(utils, "_use_triton", lambda device: True)  # the CUDA path's selection
    for in_place in ("_forward_tile", "_backward_tile", "_addmm_fp32"):  # Triton kernels / out_dtype matmuls on CUDA
        monkeypatch.setattr(kernels, in_place, lambda *args, **kwargs: None)
    enabled = torch.is_autocast_enabled  # meta has no autocast of its own: none here
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: False if a and a[0] == "meta" else enabled(*a))
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                         tie_word_embeddings=False)

    def model() -> torch.nn.Module:
        with torch.device("meta"):
            built = LlamaForCausalLM(config).to(torch.bfloat16)
        built.lm_head.weight.requires_grad_(trains_head)
        return built

    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    trls = model()
    utils.add_fused_lm_head(trls, outputs=("log_probs", "entropy", "is_top1"))  # `trl sft`'s
    trl_saved, trl_backward = _model_measured(
        trls, lambda m: -m(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.sum())
    ours = model()
    with head_replaced(ours, FusedLogProbs()):
        our_saved, our_backward = _model_measured(ours, lambda m: -m(input_ids=ids).logits.sum())
    assert abs(our_saved - trl_saved) <= trl_saved / 100, (our_saved, trl_saved)
    assert abs(our_backward - trl_backward) <= trl_backward / 100, (our_backward, trl_backward)
