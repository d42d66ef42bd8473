"""Every rank runs the vision tower when any rank does: a batch of text alone on one rank of a
sharded vision-language model.

Under FSDP every forward of a sharded unit is a collective (its parameters are all-gathered),
and so is its backward (its gradients are reduce-scattered). A transformers VLM calls its vision
tower only for a batch with images: when rank 0's batch has an image and rank 1's has text alone,
rank 0 all-gathers the vision layers while rank 1 all-gathers the text layers. The collectives
pair up by order, not by name: on NCCL the job stalls until the watchdog kills it (transformers
#37186, torchtitan #4777, PrimeIntellect prime-rl #1959 and #2515); on gloo rank 0 aborted and
rank 1 trained on through mismatched buffers. It is the common case, not a corner: a dataset
that mixes text-only samples into image ones, or a multi-turn episode cut before its first image.

What the frameworks do (LlamaFactory's collator adds a fake image to a text-only batch, for
ZeRO-3 and FSDP alike) lives in their data pipelines; a plain accelerate loop, the Trainer and
TRL have nothing. Here, at the model's forward:

1. every rank says whether its call has images and videos (one all-gather of two integers, on
   a CPU group: no device sync);
2. if they all agree, nothing more: the forward runs as written;
3. a rank without a modality some other rank has receives the lowest such rank's inputs for it
   and runs the model's own `get_image_features` (`get_video_features`) on them where the
   others run their tower: right after its text embedding (the models embed the text first,
   and the embedding may be a unit of its own; with `inputs_embeds` given, before the forward,
   inside the activation offload all the same).
   With gradients it adds `0 * sum(features)` to its input embeddings, so its backward runs the
   tower's backward where theirs does, with gradients of exactly zero: its loss and its text
   gradients are those of its forward without the stand-in (`x + 0.0` is `x`), and the tower's reduced
   gradient is the others' sum over the world size, as a rank that used no vision parameter
   contributes under data parallelism;
4. a model whose forward takes pixels but that has no `get_image_features` raises on every rank
   in that same forward, naming the ranks: no rank is left waiting.

The stand-in costs one vision forward and backward on the text-only rank and one broadcast of the
source rank's pixel values (through the CPU), in the steps where ranks disagree only; every
forward of a model with text and pixel inputs pays the two-integer all-gather.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_offload_cfg import model_state
from fsdp_offload_cfg._signatures import parameters


@dataclass(frozen=True)
class Modality:
    inputs: str  # the forward's keyword for this modality's pixels
    features: str  # the model's method that runs its tower (and projector) on them
    extra: tuple[str, ...]  # the forward's keywords that go with them (grids, sizes)


MODALITIES = (Modality("pixel_values", "get_image_features", ("image_grid_thw", "image_sizes")),
              Modality("pixel_values_videos", "get_video_features", ("video_grid_thw",)))  # fmt: skip

# the gloo group made beside NCCL, with the world it was made in: one per process group, made at
# the first VLM's prepare (every rank is there); a world made again (destroyed and initialised
# anew) gets its own
_side_group: tuple[Any, Any] = (None, None)


def sync_vision(model: nn.Module) -> nn.Module | None:
    """Hook (once) the outermost module of a sharded `model` whose forward takes both text and
    pixels (`input_ids` and `pixel_values`: the VLM, or the one inside a PEFT wrapper); returns it,
    or None for a model without (a text model, a vision-only model whose every batch has pixels)
    and for a model FSDP does not shard (an evaluation copy, whole on each rank, which a script
    may run on one rank alone: a hook would wait for the others there)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or not _sharded(model):
        return None
    vlm = next((m for m in model.modules() if {"input_ids", "pixel_values"} <= set(_forward_names(m))), None)
    if vlm is None:
        return None
    if model_state.get(vlm, "vision_sync") is None:
        state = _SyncState(_group(), _forward_names(vlm))
        handle = vlm.register_forward_pre_hook(state.before_forward, with_kwargs=True)
        model_state.put(vlm, "vision_sync", (handle, state))
    return vlm


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


def remove(vlm: nn.Module) -> None:
    hooked = model_state.take(vlm, "vision_sync")
    if hooked is not None:
        hooked[0].remove()
        hooked[1].drop_pending()


def _group() -> Any:
    """A process group that takes CPU tensors: the world's where its backend does (gloo), else a
    gloo group beside NCCL, so the flags never wait for the device."""
    global _side_group
    world = dist.group.WORLD
    if "gloo" in str(dist.get_backend()):
        return world
    if _side_group[0] is not world:
        _side_group = (world, dist.new_group(backend="gloo"))
    return _side_group[1]


def _forward_names(module: nn.Module) -> list[str]:
    return list(parameters(module.forward))


class _SyncState:
    """What one hooked model keeps between the pre-hook and its embedding layer's call."""

    def __init__(self, group: Any, names: list[str]) -> None:
        self.group = group
        self.names = names  # the forward's parameters, to find pixels passed by position
        self.pending: Any = None  # the one-shot embedding hook of this forward's stand-in, until it runs

    def drop_pending(self) -> None:
        if self.pending is not None:
            self.pending.remove()
            self.pending = None

    def before_forward(self, vlm: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.drop_pending()  # a forward that raised before its embeddings left its hook behind
        call = {**dict(zip(self.names, args)), **kwargs}
        everyone = _all_gather_flags([_has(call.get(m.inputs)) for m in MODALITIES], self.group)
        split = [(m, [r[i] for r in everyone]) for i, m in enumerate(MODALITIES) if len({r[i] for r in everyone}) > 1]
        if not split:
            return None
        _refuse_without_api(vlm, split)
        rank = dist.get_rank()  # the group spans the world in rank order: group ranks are global ranks
        sent = [(m, _broadcast_inputs(call, m, has.index(True), self.group)) for m, has in split]
        towers = [(m, inputs) for (m, inputs), (_, has) in zip(sent, split) if not has[rank]]
        if not towers:
            return None
        if kwargs.get("inputs_embeds") is not None:  # no embedding call: the towers come first
            zero = _run_towers_before_forward(vlm, towers)
            embeds = kwargs["inputs_embeds"]
            return args, {**kwargs, "inputs_embeds": embeds if zero is None else embeds + zero.to(embeds.dtype)}
        self.pending = vlm.get_input_embeddings().register_forward_hook(self._towers_after_embedding(vlm, towers))
        return None

    def _towers_after_embedding(self, vlm: nn.Module, towers: list[tuple[Modality, dict[str, Any]]]) -> Any:
        """The models embed the text first, then run the tower: the stand-in runs there too, so
        that its collectives come in the others' order (the embedding may be a unit of its own)."""

        def run(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
            self.drop_pending()
            zero = _run_towers(vlm, towers)
            return output if zero is None else output + zero.to(output.dtype)

        return run


def _broadcast_inputs(call: dict[str, Any], modality: Modality, source: int, group: Any) -> dict[str, Any]:
    """Every rank joins the broadcast of `source`'s inputs for `modality` (on the CPU)."""
    payload = [_vision_inputs(call, modality) if dist.get_rank() == source else None]
    dist.broadcast_object_list(payload, src=source, group=group)
    return payload[0]


def _run_towers(vlm: nn.Module, towers: list[tuple[Modality, dict[str, Any]]]) -> torch.Tensor | None:
    """Each tower on the inputs sent for it; `0 * sum(features)`, or None with no gradient to
    carry (no grad mode, or a frozen tower and projector)."""
    carried = [t.float().sum() for modality, inputs in towers for t in _tensors(_run_tower(vlm, modality, inputs))
               if t.is_floating_point() and t.requires_grad]  # fmt: skip
    if not torch.is_grad_enabled() or not carried:
        return None
    return sum(carried[1:], carried[0]) * 0.0


def _run_towers_before_forward(vlm: nn.Module, towers: list[tuple[Modality, dict[str, Any]]]) -> torch.Tensor | None:
    """`_run_towers` from the forward's pre-hook. Where the VLM is the activation offload's root, its
    forward (the one the offload wraps) has not begun, so the towers run as a pass of the offload of
    their own: their layers' activations move as the other ranks' do inside their forward, rather
    than stay on the device (and the offload warn of a layer run outside it). Under an outer root
    (a PEFT wrapper) the pre-hook runs inside that root's pass already."""
    handle = model_state.get(vlm, "offload")
    if handle is None:
        return _run_towers(vlm, towers)
    return handle.run_as_forward(_run_towers, vlm, towers)


def _has(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() > 0


def _all_gather_flags(present: list[bool], group: Any) -> list[list[bool]]:
    mine = torch.tensor([int(p) for p in present], dtype=torch.int32)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [[bool(v) for v in t.tolist()] for t in out]


def _refuse_without_api(vlm: nn.Module, split: list[tuple[Modality, list[bool]]]) -> None:
    """Every rank has the same flags and the same model: all raise here, or none does."""
    for modality, flags in split:
        if not callable(getattr(vlm, modality.features, None)):
            with_ = [r for r, f in enumerate(flags) if f]
            without = [r for r, f in enumerate(flags) if not f]
            raise RuntimeError(
                f"{type(vlm).__name__}: ranks {with_} have {modality.inputs} in this forward and ranks {without} "
                f"do not; under FSDP the ranks without would skip the vision tower's collectives that the others "
                f"wait in. This model has no {modality.features} to run on a stand-in: give every rank's batch "
                f"{modality.inputs} or none (group samples by modality, or add a placeholder one to text-only batches)")


def _vision_inputs(call: dict[str, Any], modality: Modality) -> dict[str, Any]:
    """The source rank's inputs for `modality`, on the CPU for the broadcast."""
    keys = (modality.inputs, *modality.extra)
    return {k: call[k].detach().cpu() if isinstance(call[k], torch.Tensor) else call[k]
            for k in keys if call.get(k) is not None}  # fmt: skip


def _run_tower(vlm: nn.Module, modality: Modality, inputs: dict[str, Any]) -> Any:
    """The model's own feature method on `inputs`, on the model's device (in the dtype the source
    rank's batch had, which its own forward took)."""
    method = getattr(vlm, modality.features)
    device = next(vlm.parameters()).device
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    accepted = parameters(method)
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        moved = {k: v for k, v in moved.items() if k in accepted}
    return method(**moved)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The features a feature method's result hands the model: a tensor, a tuple or list of them
    (transformers 4.x), or a ModelOutput's `pooler_output` (5.x's forwards read that field alone:
    its other fields hold tower layers the model may not use, such as Llava's last layer under
    `vision_feature_layer: -2`, and a backward through them is a reduce-scatter no other rank makes)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if hasattr(value, "pooler_output"):
        return _tensors(value.pooler_output)
    if isinstance(value, dict):  # another ModelOutput: the models read its first field
        return _tensors(next(iter(value.values()), None))
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []
