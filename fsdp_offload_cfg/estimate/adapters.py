"""LoRA adapters on the estimate's meta model (`--lora-rank`): a fine-tune that trains adapters
over a frozen base, as ms-swift's and LlamaFactory's default runs do.

What changes against full fine-tuning: gradients and optimizer state exist for the adapters
alone; the frozen base stays in the dtype it was loaded in (accelerate since 1.14 upcasts to
float32 only the parameters that train; 1.10-1.12 upcast all: `compat.master_weights`); and the
activations differ, since a frozen linear layer saves no input for its weight's gradient while
each adapter saves its own (with dropout, a dropped copy of the input and its mask per adapter).

Why PEFT's own `get_peft_model` on the meta skeleton rather than a count: the adapters' shapes,
their dtype (float32 over a low-precision base, PEFT's `autocast_adapter_dtype`) and the layers
`all-linear` picks (every linear layer but the output head) are then PEFT's, and the probe's
forward and backward run through them as the run's do. A run's activation budget plans from
a meta twin of its model the same way: `adapters_like` gives the twin the run's own adapters.
No torch at import: `check_lora` runs with the other input checks, before torch's import.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsdp_offload_cfg.config.trainer_file import ALL_LINEAR, EMBEDDINGS, PEFT_DEFAULT
from fsdp_offload_cfg.estimate.inputs import EstimateError

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class Lora:
    rank: int
    # PEFT's `all-linear`, `peft-default` (no target_modules: PEFT's default for the model's type,
    # as TRL's `use_peft` leaves it), or module names separated by commas
    targets: str = ALL_LINEAR
    dropout: float = 0.0  # PEFT's default; ms-swift's is 0.05, TRL's 0.05
    # PEFT's `use_dora`: each adapted layer also saves its base output and its adapter's output
    # (what the learned magnitude scales): about twice LoRA's activations
    dora: bool = False
    # PEFT's `modules_to_save`, names joined by commas: modules trained whole beside the adapters
    # (a copy of each, the original kept frozen), as runs that add tokens train `embed_tokens` and
    # `lm_head`; their gradients and optimizer state are a full fine-tune's for those modules.
    # EMBEDDINGS stands for the model's input and output embeddings, whatever their names
    modules_to_save: str = ""
    # how the targets and the modules to save were given, for an error naming one the model lacks:
    # the flags, or the key of the run's file ("sft.yaml: lora_target:")
    said: tuple[str, str] = ("--lora-targets", "--lora-modules-to-save")

    def target_modules(self) -> str | list[str] | None:
        if self.targets in (ALL_LINEAR, PEFT_DEFAULT):
            return None if self.targets == PEFT_DEFAULT else ALL_LINEAR
        return [name.strip() for name in self.targets.split(",") if name.strip()]

    def saved_modules(self) -> list[str] | None:
        return [name.strip() for name in self.modules_to_save.split(",") if name.strip()] or None

    def describe(self) -> str:
        on = "PEFT's default modules for the model's type" if self.targets == PEFT_DEFAULT else self.targets
        kind = "DoRA" if self.dora else "LoRA"
        saved = [("the input and output embeddings" if name == EMBEDDINGS else name) for name in self.saved_modules() or ()]
        return (f"{kind} rank {self.rank} on {on}" + (f", dropout {self.dropout:g}" if self.dropout else "")
                + (f", {', '.join(saved)} trained whole (modules_to_save)" if saved else ""))


def check_lora(lora: Lora) -> None:
    """The flags, and PEFT being there, said before the model is read."""
    if lora.rank < 1:
        raise EstimateError(f"--lora-rank must be >= 1, got {lora.rank}")
    if not 0.0 <= lora.dropout < 1.0:
        raise EstimateError(f"--lora-dropout must be in [0, 1), got {lora.dropout:g}")
    if lora.targets != PEFT_DEFAULT and not lora.target_modules():
        raise EstimateError(f"--lora-targets: no module name in {lora.targets!r}; give names such as q_proj,v_proj, "
                            f"or {ALL_LINEAR}")
    if importlib.util.find_spec("peft") is None:
        raise EstimateError("--lora-rank places the adapters with PEFT, which is not installed here: pip install peft")


def with_lora(model: nn.Module, lora: Lora) -> nn.Module:
    """`model` wrapped by PEFT with `lora`'s adapters (on meta, as the model is), in the dtype
    PEFT keeps them in (float32): what the states count (`gathered_in` for the forward)."""
    from peft import LoraConfig

    saved = lora.saved_modules()
    if saved and EMBEDDINGS in saved:
        saved = [name for name in saved if name != EMBEDDINGS] + _embedding_names(model)
        lora = dataclasses.replace(lora, modules_to_save=",".join(saved))
    config = LoraConfig(r=lora.rank, target_modules=lora.target_modules(), lora_dropout=lora.dropout,
                        use_dora=lora.dora, modules_to_save=saved)
    try:
        placed = _placed(model, config)
    except ValueError as error:  # PEFT: "Target modules {...} not found in the base model"
        raise EstimateError(f"{lora.said[0]} {lora.targets}: {error}") from None
    _check_saved_modules(placed, lora)
    return placed


def _embedding_names(model: nn.Module) -> list[str]:
    """The last names of the model's input and output embeddings, as LlamaFactory gives PEFT them."""
    embeddings = [model.get_input_embeddings(), model.get_output_embeddings()]
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if any(m is e for e in embeddings if e is not None)})


def saved_module_names(model: nn.Module) -> list[str]:
    """The last names of the modules PEFT trains whole in `model` (its `ModulesToSaveWrapper`s)."""
    from peft.utils import ModulesToSaveWrapper

    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, ModulesToSaveWrapper)})


def _check_saved_modules(model: nn.Module, lora: Lora) -> None:
    """A name of --lora-modules-to-save that no module has: PEFT says nothing and trains nothing
    more, so the estimate would quietly be the LoRA's alone."""
    wrapped = set(saved_module_names(model))
    missing = [name for name in lora.saved_modules() or () if name.rsplit(".", 1)[-1] not in wrapped]
    if missing:
        raise EstimateError(f"{lora.said[1]} {lora.modules_to_save}: the model has no module named "
                            f"{', '.join(missing)}")


def adapters_like(trained: nn.Module, twin: nn.Module) -> nn.Module:
    """`twin` (the run's meta twin, which an activation budget plans from) with the LoRA or DoRA
    adapters `trained` has, from its active adapter's config: a LoRA run then plans what it saves,
    not what a full fine-tune would. `twin` itself where `trained` has none, or has another PEFT
    type. DoRA's weight norm runs a graph over a whole weight that its forward drops (the norm is
    detached): the probe forgets the saves of a graph gone by the forward's end (`probe.release`),
    so it counts what DoRA keeps. The adapters' init is PEFT's default: values are never read on
    meta, and an init from the base weights (PiSSA's SVD, LoftQ) cannot run there."""
    wrapper = next((m for m in trained.modules() if isinstance(getattr(m, "peft_config", None), dict)
                    and hasattr(m, "active_adapter")), None)
    if wrapper is None:
        return twin
    active = wrapper.active_adapter
    config = copy.deepcopy(wrapper.peft_config[active[0] if isinstance(active, list) else active])
    if getattr(config.peft_type, "value", config.peft_type) != "LORA":
        return twin
    config.init_lora_weights = True
    return _placed(twin, config)


@contextmanager
def gathered_in(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """A PEFT model's adapters in `dtype` for the probe's forward, and back in their own after.
    Under mixed precision (`dtype`: its compute dtype) FSDP2 gathers the float32 adapters in that
    dtype, and a forward over float32 adapters would cast each adapter's input to float32, which
    the run does not do; what is stored stays float32 whatever accelerate upcasts (1.13 upcasts
    nothing), so the states count them after, as they are. No-op without adapters or `dtype`."""
    adapters = [] if dtype is None or not hasattr(model, "peft_config") else [
        (p, p.data) for p in model.parameters() if p.requires_grad and p.is_floating_point() and p.dtype != dtype]
    for p, data in adapters:
        p.data = data.to(dtype)
    try:
        yield
    finally:
        for p, data in adapters:
            p.data = data


def _placed(model: nn.Module, config: Any) -> nn.Module:
    """PEFT's `get_peft_model` on the meta model, as PEFT places adapters (under `patch()` with
    meta loading, the loader's placement keeps new adapters on the host: not for a twin)."""
    from peft import get_peft_model

    from fsdp_offload_cfg.loading.adapters import adapters_on_meta

    with warnings.catch_warnings():  # PEFT reads transformers 5's deprecated `is_gradient_checkpointing`
        warnings.simplefilter("ignore", FutureWarning)
        # tied embeddings under modules_to_save: PEFT warns the run itself; the estimate's copy says nothing
        warnings.filterwarnings("ignore", message="Model has `tie_word_embeddings=True`")
        with adapters_on_meta():
            return get_peft_model(model, config)

