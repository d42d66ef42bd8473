"""Measure what one forward saves for backward: run it on `meta` under saved-tensor hooks.

Why measure instead of a formula (`34*T*h` per layer): what a layer saves depends on its code
(MLA attention, MoE routing, gated MLPs, vision towers, dtype casts, the loss upcast) and on the
transformers version. Autograd tells us exactly, for free on `meta`: every tensor autograd keeps
goes through the pack hook, with its dtype, shape and storage. Storages are counted once
(`x` and `x.t()`), parameters never (the weights live on the device anyway).

What `meta` alone would get wrong, and how:
- Attention. `scaled_dot_product_attention` on `meta` takes the math path and saves the T x T
  probabilities; a GPU runs a fused kernel (flash, memory-efficient, cuDNN) that saves q, k, v,
  the output and a float32 log-sum-exp. During the probe the function is swapped for a stand-in
  that saves exactly those. For a CPU target the backend torch would pick is asked of torch
  itself (`torch._fused_sdp_choice` on tiny real tensors), and the math path is kept when that
  is what the CPU would run.
- Storage identity. Every `meta` storage has address 0, so storages are told apart by their
  StorageImpl (`untyped_storage()._cdata`), alive for as long as autograd holds the tensor.

Backward's working set. A layer's backward holds more than its saves: the gradients of its
intermediates (a gated MLP's three), produced before the saves they replace are freed. The
replay counts a group's saves whole while its backward runs, so what it misses is the excess of
the live bytes over that count, at the group's worst moment. A backward on `meta` measures it:
every storage (saved, or made by a backward op) is held by a weak reference, and after each op
the live bytes are summed. The backward asks only for the gradient of the first group's input,
so no weight gradient is made (the estimate counts those with the parameters: `states`).

A layer's forward, and a checkpointed layer's recompute. A layer's worst moment can be in its
forward, above its saves plus backward's working set: temporaries that live inside it (DoRA's
norm: an identity of the input size and weight-sized products), beside every save of the layers
before it; backward runs a checkpointed layer's forward again, beside the gradients flowing into
it. The probe's forward measures the most each layer's forward holds at once (`forward_peak`:
what the layer makes, a save while autograd's graph holds it, a temporary while it lives) and
what it is given (`entry`); the meta backward, what flows into each group (`backward_entry`).
Python's cycle collector is off during the forward, so that a storage a cycle holds is freed at
the same point on every probe, and nothing else holds what the model lets go: no
`FlopCounterMode` (`_ForwardWatch`).

The groups are found and numbered exactly as the activation offload numbers them
(`offload.groups`), and each saved storage is assigned to a group by the offload's own rule
(a tensor saved between groups belongs to the next one; after the last, to none), so the
offload's device/host split can be replayed on the record (`offload_model.py`).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge, saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from fsdp_offload_cfg.compat.model_init import meta_forward
from fsdp_offload_cfg.compat.model_output import output_cache
from fsdp_offload_cfg.estimate.heads import Head, head_replaced
from fsdp_offload_cfg.offload.filter import _is_param_like
from fsdp_offload_cfg.offload.groups import find_units, lift_to_boundaries


@dataclass
class SavedStorage:
    """One storage autograd keeps for backward (or a group takes as input)."""

    key: int  # StorageImpl address (`_storage_key`): one record per storage
    nbytes: int
    group: int  # offload frame: index of the group it belongs to; len(groups) = after the last group
    floating: bool
    inside: bool  # saved while a group's forward ran (False: embedding, head, loss, between groups)


@dataclass
class ActivationProfile:
    """What one forward of one rank's batch saves, storage by storage, in the order first saved."""

    groups: list[str]  # qualified names of the groups (decoder layers, vision layers), forward order
    saved: list[SavedStorage] = field(default_factory=list)
    # the activation storages passed into the groups, each numbered with the first group taking
    # it: what a checkpointed layer keeps instead of its inside saves
    inputs: dict[int, SavedStorage] = field(default_factory=dict)
    trained: set[int] = field(default_factory=set)  # id() of the parameters the loss reaches (get a gradient)
    # storages the forward's output keeps alive though nothing saves them: the KV cache of a model
    # run with use_cache. Under checkpointing each layer's frame keeps its kwargs, the cache among
    # them, until backward, so every layer's keys and values stay (measured with the allocator).
    held: dict[int, SavedStorage] = field(default_factory=dict)
    # forward FLOPs of each group (matmuls, convolutions and attention, by torch's own formulas:
    # `_ForwardWatch`): what checkpointing recomputes and what an offload's copy can hide under
    flops: list[int] = field(default_factory=list)
    # per offload frame (each group, then the head after the last): what its backward holds
    # beyond the saves of it and the frames before it, at its worst moment (the gradients of its
    # intermediates; the logits' gradient in the head); empty where the meta backward failed
    backward_extra: list[int] = field(default_factory=list)
    # per group, the most its forward holds at once of what it makes (its saves and its
    # temporaries, each while alive): a checkpointed group's recompute in backward holds that on
    # top of what is kept (DoRA's norm: an identity of the input size and weight-sized
    # temporaries, more than the layer's saves where sequences are short)
    forward_peak: list[int] = field(default_factory=list)
    # per offload frame, what backward holds beyond the same saves as `backward_extra` when the
    # frame's backward begins (the gradients flowing into it): beside a checkpointed group's
    # recompute, which runs then
    backward_entry: list[int] = field(default_factory=list)
    # per group, the activation storages its forward is given (storage key -> bytes: the hidden
    # state, the position embeddings, the mask), alive beside what it makes: with the saves of the
    # groups before it and `forward_peak`, the group's worst moment in forward (`activations`)
    entry: list[dict[int, int]] = field(default_factory=list)
    backward_error: str | None = None  # why the backward was not measured, for the assumptions
    # the forward's outputs beside the loss that nothing saves (the logits): a loop that keeps
    # `outputs = model(...)` through `backward(outputs.loss)`, as accelerate's examples do, holds
    # them at backward's peak; the Trainer drops them. Only `auto`'s room counts them (a 3B
    # Llama at 32k tokens: 7.8 GiB of bf16 logits that a plan without them ran out of memory by)
    output_bytes: int = 0

    def bytes_per_group(self) -> list[int]:
        """Saved bytes by offload frame: one entry per group, then the part after the last group."""
        out = [0] * (len(self.groups) + 1)
        for s in self.saved:
            out[s.group] += s.nbytes
        return out

    def head_backward_bytes(self) -> int:
        """What the head's backward (final norm, output layer, loss) holds beyond every save, as
        the meta backward measured it; where it could not run, the largest save after the last
        group (the logits, whose gradient the loss's backward allocates)."""
        if self.backward_extra:
            return self.backward_extra[-1]
        return max((s.nbytes for s in self.saved if s.group == len(self.groups)), default=0)

    def inside_bytes_per_group(self) -> list[int]:
        """Bytes saved inside each group's own forward (what checkpointing recomputes)."""
        out = [0] * len(self.groups)
        for s in self.saved:
            if s.inside:
                out[s.group] += s.nbytes
        return out


class _FusedAttention(torch.autograd.Function):
    """Stand-in for a fused SDPA kernel: saves q, k, v, the output, a float32 log-sum-exp and the
    mask, if any.

    The output has the kernels' memory layout: (batch, seq, heads, dim) seen as (batch, heads,
    seq, dim), as flash and memory-efficient attention (CPU and CUDA) return it. So the model's
    `transpose(1, 2).contiguous()` and `reshape` before `o_proj` are views, and `o_proj` saves the
    attention output's storage, not a copy of it (a contiguous stand-in counted one extra
    hidden-size storage per layer: the estimate ran 4-5% high)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if q.dim() == 4:
            batch, heads, seq, _ = q.shape
            out = q.new_empty((batch, seq, heads, v.shape[-1])).transpose(1, 2)
        else:
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        # a mask is saved too (memory-efficient attention's bias, the CPU kernel's mask), a boolean
        # one as the additive mask in q's dtype that SDPA converts it to, a new storage per call
        if mask is not None and mask.dtype != q.dtype:
            mask = q.new_empty(mask.shape)
        ctx.save_for_backward(q, k, v, out, lse, *([] if mask is None else [mask]))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        """The fused kernels' backward returns dq, dk, dv in the inputs' shapes (meta only)."""
        q, k, v = ctx.saved_tensors[:3]
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), None


def _cpu_would_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any, dropout_p: float,
                    is_causal: bool, scale: Any, enable_gqa: bool) -> bool:
    """Ask torch which SDPA backend a CPU run takes for these shapes' head dims and dtypes."""
    def tiny(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros((1, t.shape[-3] if t.dim() >= 3 else 1, 8, t.shape[-1]), dtype=t.dtype)

    mask = None if attn_mask is None else torch.zeros((1, 1, 8, 8), dtype=attn_mask.dtype)
    kwargs = {"scale": scale, **({"enable_gqa": True} if enable_gqa else {})}
    choice = torch._fused_sdp_choice(tiny(q), tiny(k), tiny(v), mask, dropout_p, is_causal, **kwargs)
    return choice != int(torch.nn.attention.SDPBackend.MATH)


def attention_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool) -> int:
    """Forward FLOPs of attention (QK^T and PV), as torch's flop counter counts SDPA; a causal
    kernel skips the masked half of the blocks."""
    batch_heads = query.numel() // (query.shape[-2] * query.shape[-1])
    flops = 2 * batch_heads * query.shape[-2] * key.shape[-2] * (query.shape[-1] + value.shape[-1])
    return flops // 2 if is_causal else flops


@contextmanager
def _attention_as_on(target: str, count: Any = None) -> Iterator[None]:
    """Swap `F.scaled_dot_product_attention` for the saves of the kernel `target` would run
    (`count(flops)` is told the FLOPs of each stand-in call, which no flop counter sees)."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: Any = None, enable_gqa: bool = False) -> Any:
        if query.device.type == "meta" and (
            target == "cuda" or _cpu_would_fuse(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        ):
            if count is not None:
                count(attention_flops(query, key, value, is_causal))
            return _FusedAttention.apply(query, key, value, attn_mask)
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

    functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


def _edge_key(edge: Any) -> tuple[int, int]:
    return id(edge.node), edge.output_nr


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _cache_tensors(cache: Any) -> Iterator[torch.Tensor]:
    """The keys and values a transformers cache holds (`DynamicCache.layers[i].keys/.values`; the
    `key_cache`/`value_cache` lists of older versions)."""
    if cache is None:
        return
    for layer in getattr(cache, "layers", None) or ():
        yield from _tensors([getattr(layer, "keys", None), getattr(layer, "values", None)])
    yield from _tensors([getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)])


class _Token:
    """Carried by every packed save of one storage; `__weakref__` for `_Recorder.tokens`."""

    __slots__ = ("__weakref__",)


class _Recorder:
    """The pack hook and the group hooks of one probe forward."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        self.profile = ActivationProfile(names, flops=[0] * len(names), forward_peak=[0] * len(names),
                                         entry=[{} for _ in names])
        self.watch = _ForwardWatch(self)  # entered around the forward by the caller
        self.param_keys = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
        self.seen: set[int] = set()
        self.current = 0  # offload frame of what is saved now
        self.inside = False
        self._hold: list[torch.Tensor] = []  # keeps every recorded storage alive, so keys stay unique
        # per saved storage, the token its packed saves carry: autograd's graph holds it while it
        # holds any save of that storage, so at the end of the forward a token gone means the
        # graph has let go of them (`release`)
        self.tokens: weakref.WeakValueDictionary[int, _Token] = weakref.WeakValueDictionary()
        # where backward stops: the gradient edges of the groups' inputs, held as edges, not
        # tensors, so that each input is freed when backward is done with it, as in a real step
        self.entries: dict[tuple[int, int], Any] = {}
        # the groups' outputs' edges (next groups' inputs), held until the forward ends: an edge's key
        # is the id() of its node's Python object, which torch 2.11 frees with the last reference
        # to it and makes anew, under another id, for the next group's input (every layer's input
        # then looked like one no group made, and backward asked for each: one hidden state per
        # layer held to the end). Not after: a branch the model drops must be freed (`release`)
        self.outputs: dict[tuple[int, int], Any] = {}
        self.stops: list[Any] = []  # `stopping_points`, found when the forward ends
        self.in_backward = len(names)  # frame whose backward runs now (the last saved-tensor unpack's)

    def is_activation(self, t: torch.Tensor) -> bool:
        return not _is_param_like(t) and _storage_key(t) not in self.param_keys

    def record(self, t: torch.Tensor) -> SavedStorage:
        self._hold.append(t.detach())  # the storage, not its graph: a branch the model drops is freed
        return SavedStorage(_storage_key(t), t.untyped_storage().nbytes(), self.current, t.is_floating_point(),
                            self.inside)

    def pack(self, t: torch.Tensor) -> tuple[int, torch.Tensor, _Token | None]:
        token = None
        if self.is_activation(t):
            key = _storage_key(t)
            if key not in self.seen:
                self.seen.add(key)
                self.profile.saved.append(self.record(t))
            token = self.tokens.get(key)
            if token is None:
                token = self.tokens[key] = _Token()
        # the frame of the op that saves it, not of the storage: one storage (RoPE's cos and
        # sin) is saved by every layer, and its unpack in layer 3's backward is layer 3's.
        # Detached, as autograd saves an op's own output: `t` itself would hold its `grad_fn`,
        # the node holding this, a cycle through C++ that kept every dropped branch alive
        return self.current, t.detach(), token

    def unpack(self, packed: tuple[int, torch.Tensor, _Token | None]) -> torch.Tensor:
        self.in_backward, t, _ = packed
        return t

    def release(self) -> None:
        """At the end of the forward: forget the saves autograd's graph no longer holds. A layer
        whose output the model never uses (a vision tower's last layer under
        `vision_feature_layer: -2`) has its graph freed within the forward where the model code
        drops that output, as transformers 5.16's LLaVA-NeXT does, and kept where it returns it
        (5.25's): its saves then take no memory when backward starts."""
        self.profile.saved = [s for s in self.profile.saved if s.key in self.tokens]

    def add_flops(self, flops: int) -> None:
        if self.inside:
            self.profile.flops[self.current] += flops

    def enter(self, index: int, args: tuple, kwargs: dict) -> None:
        self.current, self.inside = index, True
        for t in _tensors((args, kwargs)):
            if self.is_activation(t):
                key = _storage_key(t)
                self.profile.entry[index][key] = t.untyped_storage().nbytes()
                if key not in self.profile.inputs:
                    self.profile.inputs[key] = self.record(t)
            if t.requires_grad:
                edge = get_gradient_edge(t)
                self.entries[_edge_key(edge)] = edge
        self.watch.begin_group()  # after `record`'s detach: an input is the group's entry, not made by it

    def exit(self, index: int, output: Any) -> None:
        self.current, self.inside = index + 1, False
        for t in _tensors(output):
            if t.requires_grad:
                edge = get_gradient_edge(t)
                self.outputs[_edge_key(edge)] = edge

    def end_forward(self) -> None:
        """Find where backward stops (`stopping_points`) while every output's edge is held, then
        let go of them."""
        self.stops = [edge for key, edge in self.entries.items() if key not in self.outputs]
        self.outputs.clear()

    def stopping_points(self) -> list[Any]:
        """The groups' inputs that no group made (the first decoder layer's, the first vision
        layer's): backward stops there. Each edge asked for holds its gradient to the end, so
        asking for every layer's input would keep one hidden state per layer that a real
        backward frees."""
        return self.stops


class _ForwardWatch(TorchDispatchMode):
    """After each op of the probe's forward inside a group: the live bytes of the activation
    storages made since the group began, the group's `forward_peak` the most of them, and the
    op's FLOPs by torch's own formulas (`flop_registry`, what `FlopCounterMode` counts with). A
    save counts while autograd's graph holds it (its token), not while `_hold` keeps its storage;
    a temporary while its storage lives.

    Not `FlopCounterMode` itself: its module tracker hooks the gradient function of every module's
    input and output for the whole forward, which keeps alive graphs a real forward frees as it
    goes (DoRA's weight product through its adapters, an identity of the input size in each):
    their saves counted as held, each later layer's peak 0.13 MB high per adapted layer before it
    in the test's Llama."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}  # storage key -> (weak ref, bytes), this group's

    def begin_group(self) -> None:
        self.made.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        recorder = self.recorder
        if recorder.inside:
            formula = flop_registry.get(func._overloadpacket)
            if formula is not None:
                recorder.profile.flops[recorder.current] += formula(*args, **(kwargs or {}), out_val=out)
            for t in _tensors(out):
                if recorder.is_activation(t):
                    storage = t.untyped_storage()
                    known = self.made.get(storage._cdata)
                    if known is None or known[0].expired():  # new, or a freed storage's key given again
                        self.made[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
            peaks = recorder.profile.forward_peak
            peaks[recorder.current] = max(peaks[recorder.current], self._live())
        return out

    def _live(self) -> int:
        tokens, saved = self.recorder.tokens, self.recorder.seen
        gone = [k for k, (ref, _) in self.made.items() if (k not in tokens if k in saved else ref.expired())]
        for key in gone:  # a save the graph let go, a temporary freed: its key may come back for a new storage
            del self.made[key]
        return sum(nbytes for _, nbytes in self.made.values())


class _BackwardWatch(TorchDispatchMode):
    """After each op of a meta backward: the live bytes of every storage it tracks (the saves,
    and what backward ops make), over what the replay counts for the group whose backward runs;
    and before a group's first op, what it is then (the gradients flowing into the group: where
    a checkpointed group's recompute runs, at its first unpack).

    A frame's saves live until its own backward at least: its group is the first to save each of
    them, so the last to unpack it. Below the frame whose backward runs they are summed, not
    looked at; an 8B Llama's probe looked at every one of its 1,300 saves after each of 12,000
    ops (half the estimate's time)."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        profile = recorder.profile
        per_group = profile.bytes_per_group()
        # what `activations.residency` counts at frame i's backward: the saves of frames <= i
        self.counted = [sum(per_group[: i + 1]) for i in range(len(per_group))]
        self.extra = [0] * len(per_group)
        self.at_entry: list[int | None] = [None] * len(per_group)
        # storage key -> (weak ref, bytes): per frame, what the forward left there; and what backward makes
        self.frames: list[dict[int, tuple[StorageWeakRef, int]]] = [{} for _ in per_group]
        self.frame_bytes = [0] * len(per_group)
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}
        self.where: dict[int, int] = {}  # storage key -> its frame, -1 for `made`
        frame_of = {s.key: s.group for s in (*profile.inputs.values(), *profile.held.values(), *profile.saved)}
        for t in recorder._hold:
            self.track(t, frame_of.get(_storage_key(t), -1))

    def track(self, t: torch.Tensor, frame: int = -1) -> None:
        if not self.recorder.is_activation(t):
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.where:
            known = self.where[key]
            if not (self.made if known < 0 else self.frames[known])[key][0].expired():
                return  # a view of a storage tracked already
            self._forget(key)  # a freed storage's key given again
        self.where[key] = frame
        entry = (StorageWeakRef(storage), storage.nbytes())
        if frame < 0:
            self.made[key] = entry
        else:
            self.frames[frame][key] = entry
            self.frame_bytes[frame] += entry[1]

    def _forget(self, key: int) -> None:
        frame = self.where.pop(key)
        _, nbytes = (self.made if frame < 0 else self.frames[frame]).pop(key)
        if frame >= 0:
            self.frame_bytes[frame] -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        group = self.recorder.in_backward
        if self.at_entry[group] is None:
            self.at_entry[group] = self.over(group)
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            self.track(t)
        group = self.recorder.in_backward
        self.extra[group] = max(self.extra[group], self.over(group))
        return out

    def over(self, group: int) -> int:
        """The live bytes now, over what the replay counts at `group`'s backward."""
        self.forget_freed(group)  # the frames below keep theirs (class docstring)
        live = sum(self.frame_bytes) + sum(nbytes for _, nbytes in self.made.values())
        return live - self.counted[group]

    def forget_freed(self, lowest: int = 0) -> None:
        """Stop counting the storages freed since, of what backward made and of the frames from
        `lowest` up (all of them once the probe lets go of what it held: a group's input that
        nothing saved, a dropped branch's saves)."""
        for entries in (self.made, *self.frames[lowest:]):
            for key in [k for k, (ref, _) in entries.items() if ref.expired()]:
                self._forget(key)  # freed: its key may come back for a new storage


def _measure_backward(recorder: _Recorder, root: torch.Tensor | None, trainable: list[nn.Parameter]) -> None:
    """Fill `backward_extra` from a backward of `root` on meta that stops at the groups' inputs;
    a model whose backward cannot run on meta leaves it empty and says why (`backward_error`).
    Where no group input needs a gradient (a LoRA over a frozen embedding), backward runs to the
    `trainable` parameters instead: their gradients are held to the end, which is small where
    that happens (adapters)."""
    profile = recorder.profile
    entries = recorder.stopping_points() or trainable
    if root is None or not entries:
        profile.backward_error = "the forward returned no loss" if root is None else "no group input needs a gradient"
        return
    watch = _BackwardWatch(recorder)
    recorder._hold.clear()  # from here on, only autograd keeps the saves alive, as in a real backward
    watch.forget_freed()
    try:
        with watch:
            torch.autograd.grad(root, entries, allow_unused=True)
    except Exception as exc:  # noqa: BLE001 - an op without a meta backward: the forward's figures stand
        profile.backward_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return
    profile.backward_extra = watch.extra
    profile.backward_entry = [max(entry or 0, 0) for entry in watch.at_entry]


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a forward's output: a ModelOutput's values, or plain tensors in tuples,
    lists and dicts (an object of another kind has none)."""
    return list(_tensors(list(output.values()) if hasattr(output, "values") else output))


def _output_bytes(output: Any, recorder: _Recorder) -> int:
    """The bytes of the output's activations (the logits) that no save and no cache already counts."""
    counted = {s.key for s in recorder.profile.saved} | set(recorder.profile.held)
    loss = getattr(output, "loss", None)
    storages = {_storage_key(t): t.untyped_storage().nbytes() for t in _output_tensors(output)
                if t is not loss and t.is_floating_point() and recorder.is_activation(t)}
    return sum(n for key, n in storages.items() if key not in counted)


def _backward_root(output: Any) -> torch.Tensor | None:
    """The loss, else (a head run without labels) the sum of the first output that has a graph."""
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    graphed = [t for t in _output_tensors(output) if t.requires_grad and t.is_floating_point()]
    return graphed[0].sum() if graphed else None


def _parameters_reached(loss: torch.Tensor | None) -> set[int]:
    """id() of every parameter the loss's graph reaches: only those get a gradient, and only
    those get optimizer state (a vision layer whose output is never used gets neither)."""
    reached: set[int] = set()
    seen: set[Any] = set()
    stack = [loss.grad_fn] if loss is not None else []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it feeds
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return reached


@contextmanager
def _no_collection_meanwhile() -> Iterator[None]:
    """Python's cycle collector off for the probe's forward, after a collection: a storage that a
    reference cycle holds is freed when the collector happens to run, so the forward watch's live
    bytes would change from one probe to the next (the first estimate in a process differed)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def offload_groups(model: nn.Module, layer_classes: list[str] | None) -> list[nn.Module]:
    """The groups the activation offload (and checkpointing) would use on this model."""
    return lift_to_boundaries(model, find_units(model, layer_classes or None))


def measure_activations(model: nn.Module, batch: dict[str, torch.Tensor], layer_classes: list[str] | None,
                        target: str = "cuda", head: Head | None = None) -> ActivationProfile:
    """Run one training forward (loss included) of `model` on `meta` and record what it saves,
    then its backward, for what each group's backward holds beyond its saves. `head`: the loss
    head TRL runs instead of the model's (`heads.py`): the model then runs as TRL runs its
    backbone, without labels (no cross-entropy) and without a cache."""
    if head is not None:
        batch = {**{k: v for k, v in batch.items() if k != "labels"}, "use_cache": False}
    groups = offload_groups(model, layer_classes)
    names = {id(m): n for n, m in model.named_modules()}
    recorder = _Recorder(model, [names[id(g)] for g in groups])
    hooks = []
    for i, g in enumerate(groups):
        hooks.append(g.register_forward_pre_hook(lambda _m, a, k, i=i: recorder.enter(i, a, k), with_kwargs=True))
        hooks.append(g.register_forward_hook(lambda _m, _a, out, i=i: recorder.exit(i, out)))
    was_training = model.training
    model.train()  # each parameter keeps its requires_grad: a LoRA's frozen base saves no input for its gradient
    try:
        with meta_forward(), _attention_as_on(target, recorder.add_flops), head_replaced(model, head), \
                recorder.watch, saved_tensors_hooks(recorder.pack, recorder.unpack), \
                torch.enable_grad(), _no_collection_meanwhile():
            output = model(**batch)
        recorder.end_forward()
        recorder.release()
        root = _backward_root(output)
        recorder.profile.trained = _parameters_reached(root)
        for t in _cache_tensors(output_cache(output)):
            if recorder.is_activation(t):
                recorder.profile.held.setdefault(_storage_key(t), recorder.record(t))
        recorder.profile.output_bytes = _output_bytes(output, recorder)
        del output  # the logits and the cache go, as a training step drops them before backward
        _measure_backward(recorder, root, [p for p in model.parameters() if p.requires_grad])
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return recorder.profile
