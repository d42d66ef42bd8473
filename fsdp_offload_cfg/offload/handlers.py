"""The saved-tensor hooks: offload in forward, restore in backward (sync and async handlers).

Bookkeeping, and why it is shaped this way:
- A forward call is a `_Pass`; each group (decoder layer, FSDP unit) in it a `_Frame` indexed by
  the group's position. Tensors saved between groups belong to the *next* group (they are the
  next group's inputs, e.g. what transformers' own checkpointing saves before the layer runs);
  tensors saved after the last group belong to no group and stay on the device.
- An offloaded storage is an `_Entry`: one host block, copied once however many views of it are
  saved (`x` and `x.t()`, q/k/v slices of one projection). Views are restored from it with their
  exact dtype, size, stride and storage offset, all sharing one restored storage.
- Lifetimes follow the autograd graph, not a step counter: handles hold entries, entries hold
  nothing but their block, frames and passes are held by handles. When autograd frees a saved
  tensor (after its node ran, or when a graph is dropped without backward, or on an exception
  mid-forward) the host block goes back to the pool. So gradient accumulation, two forwards then
  two backwards, and aborted forwards need no special casing and leave nothing behind.
- Checkpoint recomputation runs inside the autograd engine; every entry point checks
  `in_backward()` so recomputation neither saves through us nor moves group state.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef

from fsdp_offload_cfg._logging import get_logger
from fsdp_offload_cfg._sizes import show_size
from fsdp_offload_cfg.offload.collisions import refuse_other_offloader
from fsdp_offload_cfg.offload.filter import ParamStorages, keep_reason
from fsdp_offload_cfg.offload.pool import HostBlock, HostPool
from fsdp_offload_cfg.offload.stats import COUNTS, KEPT, RESIDENT

logger = get_logger("fsdp_offload_cfg.offload")

# kept tensors that are activations on the compute device (counted as resident)
_RESIDENT_REASONS = frozenset({"small", "non_float", "last_group", "outside_groups", "pool_full", "planned_kept"})


def in_backward() -> bool:
    """True while the autograd engine runs (where checkpoint recomputation happens)."""
    return torch._C._current_graph_task_id() != -1


def _a_training_forward() -> bool:
    """A forward the offload would act on had it run inside one of its passes: one that records
    for backward, neither a recomputation in backward nor dynamo tracing a model compiled whole
    (whose forward steps aside on purpose; constant under tracing, so it traces as nothing)."""
    return not torch.compiler.is_compiling() and torch.is_grad_enabled() and not in_backward()


class _Entry:
    """One offloaded storage: a host block, plus a device copy while backward needs it."""

    __slots__ = ("__weakref__", "block", "covers", "device_buf", "handles", "nbytes", "ready", "release", "sref",
                 "unpacked")

    def __init__(self, release: object, block: HostBlock, nbytes: int, sref: StorageWeakRef) -> None:
        self.release = release  # handler method called when the last handle dies
        self.block = block
        self.nbytes = nbytes
        self.sref = sref  # tells a live alias from a new tensor at a recycled address
        self.handles = 0
        self.unpacked = 0
        self.device_buf: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None  # reload done (CUDA)
        # the offload copies this reload was queued behind (AsyncHandler's batch number): once
        # compute has waited for the reload, their sources may go
        self.covers = 0

    def __del__(self) -> None:
        try:
            self.release(self)  # type: ignore[operator]
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class _Kept:
    """One storage kept on the device, counted resident until its last saved view dies."""

    __slots__ = ("__weakref__", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        RESIDENT.add(nbytes)

    def __del__(self) -> None:
        try:
            RESIDENT.sub(self.nbytes)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class _Frame:
    """The tensors one group saved in one pass; `entries` are all it references (weakly)."""

    __slots__ = ("__weakref__", "entries", "index", "loaded", "pass_")

    def __init__(self, index: int, pass_: _Pass) -> None:
        self.index = index
        self.pass_ = pass_
        self.entries: weakref.WeakSet[_Entry] = weakref.WeakSet()
        self.loaded = False


class _Pass:
    """One forward call. Frames and entries are looked up weakly: handles own them."""

    __slots__ = ("__weakref__", "current", "entries", "frames", "group_params", "kept", "root_params")

    def __init__(self, root_params: ParamStorages) -> None:
        self.frames: weakref.WeakValueDictionary[int, _Frame] = weakref.WeakValueDictionary()
        self.entries: weakref.WeakValueDictionary[tuple[int, int], _Entry] = weakref.WeakValueDictionary()
        self.kept: weakref.WeakValueDictionary[int, _Kept] = weakref.WeakValueDictionary()
        self.root_params = root_params  # read when the pass starts (root unit unsharded by then)
        # re-read when each group starts (an FSDP2 unit is unsharded by then; parameters unsharded
        # later, inside a wrapper or by FSDP1, are kept by type: filter._is_param_like)
        self.group_params = ParamStorages()
        self.current = self.frame(0)

    def frame(self, index: int) -> _Frame:
        frame = self.frames.get(index)
        if frame is None:
            frame = self.frames[index] = _Frame(index, self)
        return frame

    def __contains__(self, ptr: object) -> bool:
        """Storage address of a parameter or buffer alive now (root's, or the current group's)."""
        return ptr in self.group_params or ptr in self.root_params


class _KeptHandle:
    __slots__ = ("frame", "kept", "tensor")

    def __init__(self, tensor: torch.Tensor, kept: _Kept | None, frame: _Frame | None) -> None:
        self.tensor, self.kept, self.frame = tensor, kept, frame


class _OffloadedHandle:
    """One saved view of an offloaded storage: everything needed to rebuild the view exactly.

    The negative and conjugate bits are part of the view, not of the bytes: `z.conj().imag` is a
    float view whose values are the negated stored ones. Rebuilt without them, the restored
    tensor would silently carry the opposite sign (or conjugate) into backward.
    """

    __slots__ = ("conj", "dtype", "entry", "frame", "neg", "offset", "size", "stride")

    def __init__(self, entry: _Entry, frame: _Frame, t: torch.Tensor) -> None:
        self.entry, self.frame = entry, frame
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()
        self.neg, self.conj = t.is_neg(), t.is_conj()

    def view_of(self, buf: torch.Tensor) -> torch.Tensor:
        """This view over the restored storage `buf`, bits included."""
        out = torch.empty(0, dtype=self.dtype, device=buf.device).set_(buf.untyped_storage(), self.offset, self.size,
                                                                       self.stride)  # fmt: skip
        if self.conj:
            out = out.conj()
        if self.neg:
            out = out._neg_view()
        return out


class OffloadHandler:
    """Sync handler: blocking copies, no streams, reload on demand.

    Works on any device with `Tensor.copy_` (NPU and other devices without CUDA stream semantics)
    and is the reference the async handler is tested against.
    """

    def __init__(self, root: nn.Module, device: torch.device, n_groups: int, pool: HostPool,
                 *, min_tensor_bytes: int, offload_last_group: bool) -> None:
        self.root = root
        self.device = device
        self.n_groups = n_groups
        self.n_offloadable = n_groups if offload_last_group else n_groups - 1
        self.min_bytes = min_tensor_bytes
        self.pool = pool
        self._pass: _Pass | None = None
        # groups an activation-budget plan keeps on the device (`budget.py`); set between forwards,
        # read at each pack, for as long as the plan stands
        self.kept_groups: frozenset[int] = frozenset()
        # training forwards this handler hooked: a budget whose plan offloads checks it moves (a
        # model compiled whole bypasses the hooks, see api._wrap_forward); only ever grows
        self.passes = 0
        # called with a layer that runs a training forward outside any pass (the model's forward
        # the offload wraps was replaced or gone around, so nothing of that layer moves); set by
        # `api`, which can say by what, for as long as the handler lives
        self.on_layer_outside_pass: Callable[[nn.Module], None] | None = None
        # whether this handler said that the pool's cap left saves on the device: once, at the
        # first, since a run that then runs out of device memory never reaches the closing line
        self._said_pool_full = False
        # the saved-tensor hooks as autograd gets them, kept from dynamo. Autograd calls them from
        # C++, and under a torch.nn module compiled in place (accelerate's regional compilation
        # compiles embed_tokens and lm_head so) dynamo skips the module's own frames, as torch's,
        # and compiled `pack` instead, the first Python frame it met: untraceable (a graph break
        # per call; under fullgraph=True, `Unsupported` at the first step). Disabled, they run as
        # they are, wherever autograd calls them.
        import torch._dynamo  # here: `import fsdp_offload_cfg` stays light

        self._hooks = (torch._dynamo.disable(self.pack, recursive=True),
                       torch._dynamo.disable(self.unpack, recursive=True))

    # ---- forward life cycle, driven by the hooks in groups.py ----
    @contextmanager
    def forward_pass(self) -> Iterator[None]:
        """Run one root forward with our hooks; whatever happens inside, no state is left."""
        if self._pass is not None or not torch.is_grad_enabled() or in_backward():
            yield  # nested call, no_grad/eval, or recomputation: nothing to do
            return
        refuse_other_offloader("around the model's forward")
        self.passes += 1
        self._settle_copies()
        self._pass = _Pass(ParamStorages(self.root))
        try:
            with saved_tensors_hooks(*self._hooks):
                yield
        finally:
            self._pass = None
            self._close_copies()

    def enter_group(self, index: int, module: nn.Module) -> None:
        p = self._pass
        if p is None:
            if self.on_layer_outside_pass is not None and _a_training_forward():
                self.on_layer_outside_pass(module)
            return
        if in_backward():
            return
        refuse_other_offloader(f"inside {type(module).__name__}")
        COUNTS["groups_entered"] += 1
        if self._moves(index):
            COUNTS["groups_to_offload_entered"] += 1  # ones whose moving nothing is worth a warning
        p.current = p.frame(index)
        p.group_params = ParamStorages(module)

    def exit_group(self, index: int) -> None:
        p = self._pass
        if p is not None and not in_backward():
            p.current = p.frame(index + 1)  # what follows feeds the next group
            self._close_copies()
            self._throttle_copies()

    def _moves(self, index: int) -> bool:
        """Whether group `index`'s saves go to the host: not the last group (unless
        offload_last_group), not code after the groups, not a layer a budget plan keeps on the
        device or only checkpoints."""
        return index < self.n_offloadable and index not in self.kept_groups

    # ---- saved tensor hooks ----
    def pack(self, t: torch.Tensor) -> _KeptHandle | _OffloadedHandle:
        p = self._pass
        if p is None or in_backward():
            return _KeptHandle(t.detach(), None, None)
        COUNTS["packed_tensors"] += 1
        frame = p.current
        reason = keep_reason(t, self.device, self.min_bytes, p)
        if reason is None and not self._moves(frame.index):
            reason = ("planned_kept" if frame.index < self.n_offloadable
                      else "last_group" if frame.index < self.n_groups else "outside_groups")
        entry = self._entry_for(t, p) if reason is None else None
        if entry is None:
            if reason is None:
                reason = "pool_full"
                self._past_the_cap(t, p)
            KEPT[reason] += 1
            return _KeptHandle(t.detach(), self._count_kept(t, p) if reason in _RESIDENT_REASONS else None, frame)
        entry.handles += 1
        frame.entries.add(entry)
        COUNTS["offloaded_tensors"] += 1
        return _OffloadedHandle(entry, frame, t)

    def unpack(self, h: _KeptHandle | _OffloadedHandle) -> torch.Tensor:
        if h.frame is not None:
            self._on_frame(h.frame)
        if isinstance(h, _KeptHandle):
            return h.tensor
        entry = h.entry
        if entry.device_buf is None:
            self._load([entry])
        buf = entry.device_buf
        assert buf is not None
        self._before_use(entry)
        out = h.view_of(buf)
        entry.unpacked += 1
        if entry.unpacked % entry.handles == 0:  # every view restored: drop our reference
            entry.device_buf = None
            RESIDENT.sub(entry.nbytes)
        return out

    def _past_the_cap(self, t: torch.Tensor, p: _Pass) -> None:
        """A save the pool's cap (`max_pinned_bytes`) leaves on the device: its storage counted
        once a pass (`pool_full_bytes`), and said when it first happens, with the layer and the cap:
        the user turned the offload on for that memory, and `estimate` counts the cap the same way."""
        storage = t.untyped_storage()
        if storage.data_ptr() not in p.kept:
            COUNTS["pool_full_bytes"] += storage.nbytes()
        if self._said_pool_full:
            return
        self._said_pool_full = True
        logger.warning(
            "activation offload: the pinned host pool reached its cap, max_pinned_bytes %s, in the forward of layer "
            "%d of %d: saves past it stay on the device, as without the offload (the run's closing line says how "
            "much). Raise max_pinned_bytes where the host has room (each rank pins a pool of its own), or set "
            "activation_memory_budget, whose plan counts the cap; `fsdp-offload-cfg estimate` shows both",
            show_size(self.pool.max_bytes or 0), p.current.index + 1, self.n_groups)

    # ---- storage bookkeeping ----
    def _count_kept(self, t: torch.Tensor, p: _Pass) -> _Kept:
        storage = t.untyped_storage()
        kept = p.kept.get(storage.data_ptr())
        if kept is None:
            kept = p.kept[storage.data_ptr()] = _Kept(storage.nbytes())
        return kept

    def _entry_for(self, t: torch.Tensor, p: _Pass) -> _Entry | None:
        """The entry holding `t`'s storage, copying it out on first sight; None if the pool is full."""
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t._version)
        entry = p.entries.get(key)
        if entry is not None and not entry.sref.expired():
            return entry
        nbytes = storage.nbytes()
        block = self.pool.acquire(nbytes)
        if block is None:
            return None
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (nbytes,), (1,))
        self._copy_out(src, block)
        entry = p.entries[key] = _Entry(self._release, block, nbytes, StorageWeakRef(storage))
        COUNTS["offloaded_storages"] += 1
        COUNTS["offloaded_bytes"] += nbytes
        return entry

    def _loaded(self, entry: _Entry, buf: torch.Tensor) -> None:
        entry.device_buf = buf
        COUNTS["reloaded_bytes"] += entry.nbytes
        RESIDENT.add(entry.nbytes)

    def _release(self, entry: _Entry) -> None:
        if entry.device_buf is not None:  # loaded ahead, never used (a backward cut short)
            self._before_use(entry)  # its buffer goes back to compute only after the copy into it
            RESIDENT.sub(entry.nbytes)
        entry.block.ready = entry.ready
        self.pool.release(entry.block)

    # ---- transport: blocking copies here, streams in AsyncHandler ----
    def _copy_out(self, src: torch.Tensor, block: HostBlock) -> None:
        block.tensor[: src.numel()].copy_(src)

    def _load(self, entries: list[_Entry]) -> None:
        for entry in entries:
            buf = torch.empty(entry.nbytes, dtype=torch.uint8, device=self.device)
            buf.copy_(entry.block.tensor[: entry.nbytes])
            self._loaded(entry, buf)

    def _before_use(self, entry: _Entry) -> None:
        """Blocking copies are complete when they return."""

    def _on_frame(self, frame: _Frame) -> None:
        """Sync reloads on demand only."""

    def _close_copies(self) -> None:
        """Blocking copies keep no source beyond their return."""

    def _throttle_copies(self) -> None:
        """Blocking copies keep no source beyond their return."""

    def _settle_copies(self) -> None:
        """Blocking copies keep no source beyond their return."""


class AsyncHandler(OffloadHandler):
    """Copies on side streams, and backward reloads `prefetch` groups ahead (double buffer).

    Device memory is only ever allocated and freed on the compute stream, and no tensor is
    `record_stream`ed. The caching allocator keeps a block freed under `record_stream` reserved
    until the other stream passes it, and a block allocated on a side stream in that stream's own
    pool, out of compute's reach: an 0.74B Llama at seq 8192 reserved 23.7 GiB for a 7.3 GiB
    allocated peak that way (H200), and a GPU without the room paid allocator retries for it.
    FSDP2 avoids `record_stream` for the same reason; torchtitan's offload frees on events. Here:

    - Offload: the D2H copy waits on the stream that produced the tensor. Its source is held by us,
      counted as allocated, in a batch per group closed by an event on the D2H stream. When group
      i ends, compute waits for group i-1's batch and the batch is dropped: freed in compute's
      order after its copy, and forward runs at most one group ahead of its copies (as fast as it
      can go when copies are the bound: backward's first reload needs every copy anyway). The last
      batches of a pass go once compute has waited for a reload queued behind them (`covers`).
    - Reload: the buffer is allocated on the compute stream, and the H2D stream waits for compute
      to reach the point of that allocation (the block may be one compute freed a moment ago) and
      for the D2H stream (the bytes must be on the host). One event per reload batch; compute
      waits on it before touching the tensor, and frees it in its own order when autograd is done.
      A host block is rewritten only after the reload that read it (its `ready` event).

    Without CUDA (CPU proxy) the copies are immediate and only the prefetch order remains, which
    CI runs.
    """

    def __init__(self, *args: object, prefetch_groups: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.prefetch = prefetch_groups
        self.streams = self.device.type == "cuda"
        if self.streams:
            self.d2h = torch.cuda.Stream(self.device)
            self.h2d = torch.cuda.Stream(self.device)
        # sources whose D2H copies were queued since the last batch closed: held so that their
        # memory stays allocated (not merely reserved) until compute has waited for the copies
        self._copying: list[torch.Tensor] = []
        # closed batches, oldest first: (number, event after their copies, sources); a batch lives
        # until compute waits for it (the next group's end, or a reload queued behind it)
        self._copied: deque[tuple[int, torch.cuda.Event, list[torch.Tensor]]] = deque()
        self._batches = 0  # batches closed so far; numbers the batches for `_Entry.covers`

    def _copy_out(self, src: torch.Tensor, block: HostBlock) -> None:
        if not self.streams:
            return super()._copy_out(src, block)
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))  # after the producer
        if block.ready is not None:
            self.d2h.wait_event(block.ready)  # after the last reload that read this block
        with torch.cuda.stream(self.d2h):
            block.tensor[: src.numel()].copy_(src, non_blocking=True)
        self._copying.append(src)

    def _close_copies(self) -> None:
        """End the open batch of copies with an event on the D2H stream."""
        if self._copying:
            self._batches += 1
            self._copied.append((self._batches, self.d2h.record_event(), self._copying))
            self._copying = []

    def _throttle_copies(self) -> None:
        """At a group's end: compute waits for the copies of all but the newest batch, then
        their sources go (in compute's order, after the copies read them)."""
        while len(self._copied) > 1:
            _, done, _sources = self._copied.popleft()
            torch.cuda.current_stream(self.device).wait_event(done)

    def _settle_copies(self) -> None:
        """Before a new pass: a pass that ended without a backward leaves no copy in flight."""
        self._close_copies()
        while self._copied:
            _, done, _sources = self._copied.popleft()
            torch.cuda.current_stream(self.device).wait_event(done)

    def _load(self, entries: list[_Entry]) -> None:
        if not self.streams:
            return super()._load(entries)
        compute = torch.cuda.current_stream(self.device)
        self._close_copies()
        self.h2d.wait_stream(compute)  # buffers below may reuse blocks compute has only just freed
        self.h2d.wait_stream(self.d2h)  # after their own offload copies
        bufs = [torch.empty(e.nbytes, dtype=torch.uint8, device=self.device) for e in entries]  # compute's pool
        with torch.cuda.stream(self.h2d):
            for entry, buf in zip(entries, bufs):
                buf.copy_(entry.block.tensor[: entry.nbytes], non_blocking=True)
            ready = self.h2d.record_event()
        for entry, buf in zip(entries, bufs):
            entry.ready, entry.covers = ready, self._batches
            self._loaded(entry, buf)

    def _before_use(self, entry: _Entry) -> None:
        if self.streams:
            torch.cuda.current_stream(self.device).wait_event(entry.ready)
            while self._copied and self._copied[0][0] <= entry.covers:  # compute is now after those copies
                self._copied.popleft()

    def _on_frame(self, frame: _Frame) -> None:
        """Load this group whole, then the next `prefetch` groups of backward (lower indices).

        A group loaded ahead is gated on the GPU, not only asked for by the CPU: its copies wait
        until the compute stream reaches this point (this group's backward), as every reload does
        (`_load`: its buffer comes from compute's pool). In backward the CPU runs layers ahead of
        the GPU; ungated, "one layer ahead" counted from the CPU kept the reloads of ~10 layers
        queued at once, and the copy engine served that queue before any other stream's copy.
        Under FSDP2 that starved a copy of its own (a 360 KB pinned upload in its reduce-scatter's
        `_chunk_cat`, on the compute stream): backward's compute stalled 138 ms (H200 trace,
        docs/benchmarks.md). Gated, the reload stream runs dry once a layer, and such a copy waits
        at most for the reloads compute is waiting on anyway.
        """
        frames = frame.pass_.frames
        todo: list[_Entry] = []
        for index in range(frame.index, frame.index - 1 - self.prefetch, -1):
            ahead = frames.get(index)
            if ahead is None or ahead.loaded:
                continue
            ahead.loaded = True
            todo += [entry for entry in list(ahead.entries) if entry.device_buf is None]
        if todo:
            self._load(todo)
