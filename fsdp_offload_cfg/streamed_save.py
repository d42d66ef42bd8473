"""A model sharded by `fully_shard`, saved as `save_pretrained` (or `Accelerator.save_model`)
writes it, with rank 0 holding one gathered tensor at a time instead of the whole model.

Why: accelerate's recipe (`state_dict=accelerator.get_state_dict(model)`),
`accelerator.save_model`, the Trainer's `FULL_STATE_DICT` saves and its final model under a
sharded state dict all gather every weight onto rank 0's host before transformers writes a byte:
an 8B model is 15 GiB there (30 GiB as float32 masters), where training held 1/8 of it per rank;
users meet the OOM at the very end of a run (accelerate #3633). transformers 5 writes files of up to 50 GB, so gathering file by file
would not bound it either.

How: transformers still decides everything about the files (names, tied weights, shards, the
index, the config), over meta stand-ins of the sharded weights (their shapes and dtypes, one per
parameter, shared by tied names), and its weight writes are recorded instead of made
(`compat.saving.weights_writer_module().safe_save_file`). When the save returns, every rank
replays rank 0's record: for each file rank 0 writes the safetensors header, then each weight is
gathered in turn (a collective on every rank) and rank 0 appends its bytes
(`safetensors_writer.FileWriter`), byte for byte the file `save_file` would have written.
`Accelerator.save_model` is streamed the same way, accelerate deciding its files
(`streamed_state_dict_save`: its writes go through `accelerate.utils.other.safe_save_file`).
Ranks differ in data (rank 0's record, which every rank receives), not in control flow.

A MoE: transformers 5 writes one tensor per expert, which its save builds from a layer's fused
experts (`revert_weight_conversion`); that runs on the stand-ins too, and the new meta tensors
are recorded by name with the one key each is built from (`compat.saving.built_from`). When the
first of them is written, that key's weight is gathered whole and transformers' own conversion
builds them from it on rank 0; they are kept until the last is written: rank 0 holds a layer's
experts at most, not the model. The files are split as the gathered tensors would be
(`compat.saving.split_as_gathered`).

A failure on any rank (the save itself, a write on rank 0) is agreed before and after the
gathers, so every rank raises, naming where it happened, and none waits in a gather. Saved as
before, gathered whole: a model whose save builds a tensor from several keys, or renames keys
where 4.57 then looks them up on the model (VLMs), a `torch.save` write (4.57's
`safe_serialization=False`), a dtype the writer here does not know (`compat.saving`), and a
framework's own Trainer `_save` other than ms-swift's common path (`saving._streams`).
"""

from __future__ import annotations

import contextlib
import os
import time
from types import TracebackType
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fsdp_offload_cfg import safetensors_writer
from fsdp_offload_cfg._logging import get_logger
from fsdp_offload_cfg._sizes import show_size
from fsdp_offload_cfg.compat import saving as compat

logger = get_logger("fsdp_offload_cfg.streamed_save")


class _Built(NamedTuple):
    """A tensor transformers builds anew from one gathered weight in its save (one expert's weight
    split out of a MoE's fused experts): built on rank 0 from `key`'s whole weight, when written."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]


# One recorded file: its path, its metadata, and each tensor's saved name with either the
# gathered weight's key (the name it has in `get_model_state_dict`, the same on every rank), a
# tensor built from one (`_Built`), or, for a tensor rank 0 holds whole (a buffer), the tensor itself.
_Entry = str | _Built | torch.Tensor
_File = tuple[str, dict[str, str] | None, list[tuple[str, _Entry]]]


class StreamedSave:
    """One save's stand-ins and record; a context around the save: on exit every rank writes the
    record (rank 0) or takes part in its gathers (the others). Build it with `streamed_save`."""

    def __init__(self, model: torch.nn.Module, shards: dict[str, Any], stand_ins: dict[str, Any],
                 key_of: dict[int, str], writer_module: Any) -> None:  # fmt: skip
        # this rank's shards by key, for the gathers; the stand-ins under the full state dict's
        # names (every rank's, for the checks before the save); what the save is given (rank 0's
        # stand-ins; the other ranks save nothing); which key a stand-in stands for, by its id
        self._model, self._shards, self._key_of, self.stand_ins = model, shards, key_of, stand_ins
        self.state_dict = stand_ins if dist.get_rank() == 0 else {}
        # the tensors the save builds anew, by saved name, with the key each is built from
        # (`compat.built_from`; set by `streamed_save` where transformers builds any)
        self.built_from: dict[str, str] = {}
        self._files: list[_File] = []  # rank 0's record, in the order the save wrote
        self._writer_module = writer_module  # the module whose `safe_save_file` the save calls
        self._write = writer_module.safe_save_file  # the writer this save replaces, restored on exit
        # within the save, the file split a MoE's built tensors need (`compat.split_as_gathered`)
        self._split: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()

    def __enter__(self) -> StreamedSave:
        self._writer_module.safe_save_file = self._record
        if self.built_from:
            self._split = compat.split_as_gathered(self.stand_ins)
        self._split.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._writer_module.safe_save_file = self._write
        self._split.__exit__(None, None, None)
        plan: list[Any] = [None]
        if error is None and dist.get_rank() == 0:
            try:
                plan = [[[key for _, key, _ in steps if key is not None] for steps in self._steps()]]
            except Exception as failed:  # noqa: BLE001 - said to every rank below
                error = failed
        _stop_if_any_failed("saving the model", error)
        dist.broadcast_object_list(plan, src=0)
        _stop_if_any_failed("writing the model's weights", self._replay(plan[0]))

    def _record(self, tensors: dict[str, torch.Tensor], filename: Any, metadata: Any = None) -> None:
        """`safe_save_file` within the save: a file with stand-ins (or tensors built from them) in
        it is recorded; any other is written as before."""
        if not any(id(value) in self._key_of or name in self.built_from for name, value in tensors.items()):
            return self._write(tensors, filename, metadata=metadata)
        entries: list[tuple[str, _Entry]] = []
        for name, value in tensors.items():
            key = self._key_of.get(id(value))
            if key is None and value.device.type == "meta":
                if name not in self.built_from:
                    raise RuntimeError(f"{name}: transformers built a new tensor on meta for this save, which cannot be "
                                       "streamed; please report it, with the model's class")  # fmt: skip
                entries.append((name, _Built(self.built_from[name], value.dtype, tuple(value.shape))))
            else:
                entries.append((name, key if key is not None else value))
        self._files.append((os.fspath(filename), metadata, entries))
        return None

    def _steps(self) -> list[list[tuple[str, str | None, _Entry]]]:
        """Rank 0's record in the order its bytes are written, each file's tensors with the key
        gathered for them (None: nothing to gather). The keys are what every rank gathers, in turn
        (the plan); a tensor built from a weight gathered for an earlier one gathers nothing."""
        gathered_for_built: set[str] = set()
        files = []
        for _, _, entries in self._files:
            steps: list[tuple[str, str | None, _Entry]] = []
            for name, entry in self._in_layout(entries):
                if isinstance(entry, _Built):
                    key = None if entry.key in gathered_for_built else entry.key
                    gathered_for_built.add(entry.key)
                else:
                    key = entry if isinstance(entry, str) else None
                steps.append((name, key, entry))
            files.append(steps)
        return files

    def _in_layout(self, entries: list[tuple[str, _Entry]]) -> list[tuple[str, _Entry]]:
        by_name = dict(entries)
        return [(name, by_name[name]) for name in safetensors_writer.layout(self._specs(entries))]

    def _specs(self, entries: list[tuple[str, _Entry]]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {name: _spec(self._shards[entry]) if isinstance(entry, str) else (entry.dtype, tuple(entry.shape))
                for name, entry in entries}  # fmt: skip

    def _replay(self, plan: list[list[str]]) -> Exception | None:
        """Every rank makes the gathers of `plan`; rank 0 writes the files. A failed write on rank 0
        (its file system) is returned once every gather has been made."""
        if dist.get_rank() != 0:
            for keys in plan:
                for key in keys:
                    _gathered(self._shards[key])  # a collective; rank 0 writes it
            return None
        specs = [self._specs(entries) for _, _, entries in self._files]
        progress = _Progress(sum(_nbytes(spec) for file in specs for spec in file.values()), len(self._files))
        built: dict[str, dict[str, torch.Tensor]] = {}  # per key, what is built from it and not written yet
        failure: Exception | None = None
        for (path, metadata, _), spec, steps in zip(self._files, specs, self._steps()):
            writer = None
            try:
                writer = safetensors_writer.FileWriter(path, spec, metadata)
            except Exception as error:  # noqa: BLE001 - the gathers go on; said to every rank after
                failure = failure or error
            for name, key, entry in steps:
                gathered = _gathered(self._shards[key]) if key is not None else None  # the collective, on every rank
                try:
                    parts = self._bytes_of(name, entry, gathered, built)
                    if writer is not None and failure is None:
                        writer.append(name, *parts)
                except Exception as error:  # noqa: BLE001 - as above
                    failure = failure or error
                progress.wrote(_nbytes(spec[name]))
                gathered = parts = None  # this tensor's bytes are written: let them go before the next
            try:
                if writer is not None:
                    writer.close()
            except Exception as error:  # noqa: BLE001 - as above
                failure = failure or error
            progress.closed(path)
        return failure

    def _bytes_of(self, name: str, entry: _Entry, gathered: list[torch.Tensor] | None,
                  built: dict[str, dict[str, torch.Tensor]]) -> list[torch.Tensor]:  # fmt: skip
        """Rank 0: the tensor `name`, in parts: as gathered, held, or built from the weight gathered
        for it (or for an earlier tensor built from the same weight: kept in `built` until the
        last is written, a MoE layer's experts at most)."""
        if isinstance(entry, str):
            return gathered or []
        if not isinstance(entry, _Built):
            return [entry]
        if gathered is not None:
            whole = _joined(gathered, self._shards[entry.key])
            gathered.clear()  # the blocks, joined: let them go before transformers builds from the whole
            built[entry.key] = dict(compat.reverted(self._model, entry.key, whole))
        tensors = built[entry.key]
        tensor = tensors.pop(name)
        if not tensors:
            del built[entry.key]
        return [tensor]


_TENTHS_FROM = 2**30  # a write this large also logs every tenth of its bytes


class _Progress:
    """Rank 0's log of a write: where it starts, each file, and every tenth of the bytes of one
    of a GiB or more."""

    def __init__(self, total: int, files: int) -> None:
        self._total, self._files, self._done, self._closed = total, files, 0, 0
        self._started = time.monotonic()
        self._next_tenth = 1
        logger.info("writing %d file(s), %s, each weight gathered to rank 0 as it is written (one at a time)",
                    files, show_size(total))  # fmt: skip

    def wrote(self, nbytes: int) -> None:
        self._done += nbytes
        if self._total >= _TENTHS_FROM and self._done * 10 >= self._next_tenth * self._total and self._next_tenth < 10:
            logger.info("written %s of %s, %.1fs", show_size(self._done), show_size(self._total), self._seconds())
            self._next_tenth = self._done * 10 // self._total + 1

    def closed(self, path: str) -> None:
        self._closed += 1
        logger.info("wrote %s (%d/%d), %.1fs", os.path.basename(path), self._closed, self._files, self._seconds())

    def _seconds(self) -> float:
        return time.monotonic() - self._started


def _nbytes(spec: tuple[torch.dtype, tuple[int, ...]]) -> int:
    return torch.Size(spec[1]).numel() * spec[0].itemsize


def streamed_save(model: torch.nn.Module, safetensors: bool = True) -> StreamedSave | None:
    """A `StreamedSave` for transformers' `save_pretrained` of a model sharded by `fully_shard`, or
    None where it is saved as before (see the module's docstring). Tied names share one stand-in,
    as they share one parameter: transformers writes such a weight once. A collective: every rank
    calls it, and every rank gets rank 0's answer."""
    from transformers import PreTrainedModel

    save = None
    if isinstance(model, PreTrainedModel) and sharded_by_fully_shard(model) and safetensors:
        save = _stand_ins_for(model, compat.weights_writer_module(), ties_shared=True)
        built_from = compat.built_from(model, save.stand_ins) if save is not None else None
        if built_from is None:
            save = None
        else:
            save.built_from = built_from
    return _as_rank_0_decided(save)


def streamed_state_dict_save(model: torch.nn.Module) -> StreamedSave | None:
    """A `StreamedSave` for accelerate's `Accelerator.save_model` of any model sharded by
    `fully_shard`, or None where it is saved as before. accelerate writes the state dict's names
    as they are, a tied weight under each of its names (`get_state_dict` gathers each name into a
    tensor of its own), so each name gets a stand-in of its own. A collective, as above."""
    save = None
    if sharded_by_fully_shard(model):
        save = _stand_ins_for(model, compat.accelerate_writer_module(), ties_shared=False)
    return _as_rank_0_decided(save)


def _stand_ins_for(model: torch.nn.Module, writer_module: Any, ties_shared: bool) -> StreamedSave | None:
    """Meta stand-ins of this rank's shards (buffers and other unsharded values as they are),
    under the names the full state dict has; None where a dtype is one the writer cannot write."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    shards = get_model_state_dict(model, options=StateDictOptions())  # this rank's shards, the full names
    stand_ins: dict[str, Any] = {}
    key_of: dict[int, str] = {}
    stand_in_of: dict[int, torch.Tensor] = {}  # tied names' one shard object -> their stand-in, when shared
    for key, value in shards.items():
        if not isinstance(value, DTensor):
            stand_ins[key] = value
            continue
        stand_in = stand_in_of.get(id(value)) if ties_shared else None
        if stand_in is None:
            stand_in = torch.empty(value.shape, dtype=value.dtype, device="meta")
            stand_in_of[id(value)] = stand_in
            key_of[id(stand_in)] = key
        stand_ins[key] = stand_in
    if not all(safetensors_writer.writable(value.dtype) for value in stand_ins.values()):
        return None
    return StreamedSave(model, shards, stand_ins, key_of, writer_module)


def _as_rank_0_decided(save: StreamedSave | None) -> StreamedSave | None:
    agreed = [save is not None]
    dist.broadcast_object_list(agreed, src=0)
    return save if agreed[0] else None


def sharded_by_fully_shard(model: torch.nn.Module) -> bool:
    """Sharded by `fully_shard` (accelerate's FSDP2), not by transformers' own `distributed_config`,
    for which transformers gathers itself."""
    from torch.distributed.fsdp import FSDPModule

    config = getattr(model, "config", None)
    return isinstance(model, FSDPModule) and getattr(config, "distributed_config", None) is None


def _spec(value: Any) -> tuple[torch.dtype, tuple[int, ...]]:
    return value.dtype, tuple(value.shape)


def gathered_whole(value: torch.Tensor) -> torch.Tensor | None:
    """One weight whole on rank 0's host, None elsewhere (a collective for a sharded one): for a
    save that keeps a few weights at once (a PEFT model's adapters) rather than streaming them."""
    parts = _gathered(value)
    return _joined(parts, value) if dist.get_rank() == 0 else None


def _joined(parts: list[torch.Tensor], value: torch.Tensor) -> torch.Tensor:
    """A weight's gathered parts (`_gathered`) as one tensor on the host."""
    if not parts:  # no rows at all
        return torch.empty(value.shape, dtype=value.dtype)
    return (torch.cat(parts) if len(parts) > 1 else parts[0]).detach().cpu()


def _gathered(value: torch.Tensor) -> list[torch.Tensor]:
    """One weight's bytes in order, on rank 0 (empty elsewhere): a collective for a sharded one.

    FSDP2 shards a weight by rows (`Shard(0)`, `torch.chunk`'s split), and the rows' bytes follow
    each other in the file: rank 0 gathers every rank's block (`dist.gather`, each padded to the
    first's rows) and writes them as they are, so it holds the weight once and the other ranks
    only send their own block. `full_tensor()` (an all-gather: the whole weight on every rank) is
    left for other layouts (HSDP's 2-D mesh, a shard on another dim). Shards offloaded to the host are gathered on their mesh's device,
    where the process group reaches them."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(value, DTensor):
        return [value] if dist.get_rank() == 0 else []
    if value.device.type != value.device_mesh.device_type:
        value = value.to(value.device_mesh.device_type)
    mesh = value.device_mesh
    if mesh.ndim != 1 or tuple(value.placements) != (Shard(0),) or mesh.size() != dist.get_world_size():
        whole = value.full_tensor()  # on every rank: a collective
        return [whole] if dist.get_rank() == 0 else []
    local = value.to_local()
    block = -(-value.shape[0] // mesh.size()) if value.shape[0] else 0  # torch.chunk's rows per rank
    if local.shape[0] != block:
        padded = local.new_zeros((block, *local.shape[1:]))
        padded[: local.shape[0]] = local
        local = padded
    blocks = [torch.empty_like(local) for _ in range(mesh.size())] if dist.get_rank() == 0 else None
    dist.gather(local.contiguous(), blocks, dst=0, group=mesh.get_group())
    if blocks is None:
        return []
    rows = [max(0, min(block, value.shape[0] - r * block)) for r in range(mesh.size())]
    return [part[:n] for part, n in zip(blocks, rows) if n]


def _stop_if_any_failed(step: str, failure: BaseException | None) -> None:
    """Every rank says whether `step` failed on it; if it failed anywhere, every rank raises: a
    failing rank its own error, the others one naming where and why."""
    said: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(said, None if failure is None else f"{type(failure).__name__}: {failure}")
    failed = {rank: text for rank, text in enumerate(said) if text is not None}
    if failure is not None:
        raise failure
    if failed:
        named = "; ".join(f"rank {rank}: {text}" for rank, text in failed.items())
        raise RuntimeError(f"{step} failed on another rank, so this rank stopped too ({named})")
