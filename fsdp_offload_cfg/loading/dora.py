"""DoRA's magnitude on a loader-built model: each rank computes its own rows from its own rows of
the base weight once they are loaded, with PEFT's own arithmetic, bit-equal to a plain load.

Why: DoRA's magnitude vector is the per-output-row L2 norm of `W + scaling * B @ A` (PEFT's
`DoraLinearLayer.update_layer`, at `get_peft_model`). On a loader-built model `W` is on meta then.
FSDP2 shards `W` ([out, in]), `B` ([out, r]) and the magnitude ([out]) alike along dim 0, the
output rows, so after the load each rank holds exactly the rows of `W` and `B` its magnitude
rows need: computing there reads nothing more and holds nothing more than the rank's shard. The
alternative this replaces (rank 0 read the whole base model before `get_peft_model` so that PEFT
could compute it) put a full copy of the model on rank 0, the very peak the loader exists to avoid.

How:
  - `defer_norms()`, around PEFT's injection on a model with meta weights: `update_layer` of a
    DoRA Linear layer whose base weight is on meta runs PEFT's code on meta stand-ins (so the
    magnitude parameter gets PEFT's shape and dtype) and records what the norm needs later
    (`PendingNorm`, on the DoRA layer; it holds no base weight);
  - `load_into_sharded` leaves the recorded magnitudes out of what rank 0 sends, and after every
    other tensor is in place calls `fill_pending`, which runs PEFT's `update_layer` again on a
    stand-in base layer holding this rank's rows of `W`, with this rank's rows of `B`;
  - a magnitude that a state dict provides (a saved DoRA adapter loaded with
    `PeftModel.from_pretrained` or `load_adapter`) is taken from it and no longer computed: a
    load-state-dict pre-hook makes it a real tensor with the loaded values.
DoRA layers whose magnitude rows do not line up with the base weight's rows (embeddings,
convolutions, `fan_in_fan_out` layers such as GPT-2's `Conv1D`) cannot be computed that way: PEFT
injection on such a model keeps the fallback, rank 0 reads the base model whole (`adapters.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_offload_cfg import model_state
from fsdp_offload_cfg.loading.pending import plain_meta
from fsdp_offload_cfg.loading.spec import canonical_name, unwrapped


@dataclass(frozen=True)
class PendingNorm:
    """What PEFT's norm needs besides the base rows, as `update_layer` received it."""

    base_dtype: torch.dtype  # W's dtype at `get_peft_model` (accelerate may upcast it before the load)
    a: torch.Tensor  # lora_A [r, in] as PEFT drew it on the host (small); B's rows come from the loaded shard
    scaling: float


def deferrable(module: nn.Module, fan_in_fan_out: bool) -> bool:
    """A DoRA layer on this base module can be computed from its own rows after the load."""
    return isinstance(module, nn.Linear) and not fan_in_fan_out


@contextlib.contextmanager
def defer_norms() -> Iterator[None]:
    """PEFT's `DoraLinearLayer.update_layer` defers the norm of every layer whose base is on meta."""
    from peft.tuners.lora.dora import DoraLinearLayer

    original = DoraLinearLayer.__dict__["update_layer"]

    def update_layer(self: Any, *, base_layer: nn.Module, lora_A: torch.Tensor, lora_B: torch.Tensor,  # noqa: N803 - PEFT's keywords
                     scaling: float, place_on_cpu: bool = False) -> None:
        weight = getattr(base_layer, "weight", None)
        if weight is None or not weight.is_meta:
            return original(self, base_layer=base_layer, lora_A=lora_A, lora_B=lora_B, scaling=scaling,
                            place_on_cpu=place_on_cpu)
        if type(self) is not DoraLinearLayer or not deferrable(base_layer, self.fan_in_fan_out):
            raise NotImplementedError(
                f"DoRA on a {type(base_layer).__name__} layer (fan_in_fan_out={self.fan_in_fan_out}) computes its "
                "magnitude from the whole base weight, which is on meta under the loader's meta loading: target only "
                "Linear layers with DoRA, or set fsdp_cpu_ram_efficient_loading: false for this run.")
        pending = PendingNorm(weight.dtype, lora_A.detach(), scaling)
        with plain_meta():  # PEFT's arithmetic on the meta base weight: shapes only, nothing read
            original(self, base_layer=base_layer, lora_A=torch.empty_like(lora_A, device="meta"),
                     lora_B=torch.empty_like(lora_B, device="meta"), scaling=scaling)
        model_state.put(self, "dora_pending", pending)
        self._register_load_state_dict_pre_hook(_take_loaded_magnitude, with_module=True)

    DoraLinearLayer.update_layer = update_layer
    try:
        yield
    finally:
        DoraLinearLayer.update_layer = original


def _take_loaded_magnitude(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """A saved adapter provides the magnitude: it becomes a real tensor holding those values (the
    default load into a meta parameter would drop them), and it is no longer computed."""
    value = state_dict.get(prefix + "weight")
    if value is None or model_state.get(module, "dora_pending") is None or not module.weight.is_meta:
        return
    module.weight = nn.Parameter(value.detach().to(module.weight.dtype).clone(),
                                 requires_grad=module.weight.requires_grad)
    model_state.take(module, "dora_pending")


def pending_names(model: nn.Module) -> list[str]:
    """Names of the magnitudes still to compute (on meta, with a record), sorted; canonical, as
    the spec names them (an activation budget wraps each layer in a checkpoint wrapper before the
    load: with the wrapper's segment in them, the names matched no tensor of rank 0's spec, which
    then wanted the magnitudes from rank 0, where they are on meta)."""
    return sorted(canonical_name(f"{path}.weight") for path, m in model.named_modules()
                  if model_state.get(m, "dora_pending") is not None and m.weight.is_meta)


@torch.no_grad()
def fill_pending(model: nn.Module, names: list[str], rank: int, world_size: int) -> None:
    """Compute each magnitude in `names` from this rank's rows of its base weight and of `B`
    (every tensor but these is loaded by now); whole tensors where the model is not sharded."""
    if not names:
        return
    from peft.tuners.lora.dora import DoraLinearLayer

    for name in names:
        path = name.rpartition(".")[0]
        dora = unwrapped(model.get_submodule(path))
        pending = model_state.get(dora, "dora_pending")
        if pending is None:
            raise RuntimeError(f"{name}: rank 0 computes this DoRA magnitude after the load, this rank has no "
                               "record of how (its get_peft_model differed from rank 0's)")
        layer = unwrapped(model.get_submodule(path.rsplit(".", 2)[0]))  # <layer>.lora_magnitude_vector.<adapter>
        adapter = path.rpartition(".")[2]
        rows = _own_rows(dora.weight, rank, world_size)
        weight = _local(layer.get_base_layer().weight)
        b_rows = _local(layer.lora_B[adapter].weight)
        if weight.shape[0] != rows.stop - rows.start or b_rows.shape[0] != weight.shape[0]:
            raise RuntimeError(f"{name}: this rank's base rows {tuple(weight.shape)} and B rows {tuple(b_rows.shape)} "
                               f"do not line up with its magnitude rows {rows.start}:{rows.stop}")
        stand_in = nn.Module()
        stand_in.weight = nn.Parameter(weight.to(pending.base_dtype), requires_grad=False)
        computed = DoraLinearLayer(fan_in_fan_out=False)
        DoraLinearLayer.__dict__["update_layer"](
            computed, base_layer=stand_in, lora_A=pending.a.to(b_rows.device), lora_B=b_rows.to(pending.a.dtype),
            scaling=pending.scaling)
        if dora.weight.is_meta:  # a whole model filled before prepare (`guard._fill_from_files`)
            dora.weight = nn.Parameter(computed.weight.to(dora.weight.dtype), requires_grad=dora.weight.requires_grad)
        else:
            _local(dora.weight).copy_(computed.weight)
        model_state.take(dora, "dora_pending")


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor  # here: a launcher that imports this never loads (loading/layout.py)

    return t.to_local() if isinstance(t, DTensor) else t


def _own_rows(t: torch.Tensor, rank: int, world_size: int) -> slice:
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return slice(0, t.shape[0])
    from fsdp_offload_cfg.loading.layout import dtensor_regions

    return dtensor_regions(t, world_size)[rank][0]
