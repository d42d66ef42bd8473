"""Host memory and wall time of loading a Llama into FSDP2, per rank: ~320M parameters by
default, or (`--model`) a 100M one or the Llama-3-8B shape.

Methods (each in its own `torchrun` launch, CPU + gloo):
  plain     every rank runs `from_pretrained` in full, then accelerate's `fsdp2_prepare_model`;
  stock     transformers + accelerate as shipped with `cpu_ram_efficient_loading`
            (ACCELERATE_USE_FSDP / FSDP_CPU_RAM_EFFICIENT_LOADING set, then `fsdp2_prepare_model`
            with `cpu_ram_efficient_loading=True`); "crash" if it raises;
  broadcast `rank0_from_pretrained` + `load_into_sharded` (accelerate's `fsdp2_prepare_model`,
            stock loading off, as the shard_fn): rank 0 builds on meta too and streams every
            rank its slices from the files at prepare (the full rank-0 load of earlier versions
            happens only for checkpoints that cannot be read slice by slice);
  sharded   `sharded_from_pretrained` + `load_into_sharded(strategy="sharded")`: every rank
            builds on meta and reads only its own slices from the safetensors file;
  auto      `auto_from_pretrained` (the default): here, as sharded (every rank can read);
  native    transformers' own FSDP2 load, `from_pretrained(distributed_config=
            DistributedConfig(fsdp_size=ranks))` (transformers >= 5.15): each rank keeps its
            rows as views of the mapped safetensors file, so its load copies nothing and the
            first read of every shard pays the page faults instead, and the first write (the
            first optimizer step) copies each page out of the file (copy on write). For a fair
            time, the table also shows each method's first read, then first write, of every
            local shard ("load + first read" and "+ first write").

Checkpoints: `fp32` (loaded as saved: transformers maps the safetensors file and FSDP copies
only each rank's rows, so plain loading costs little *anonymous* memory) and `bf16->fp32` (a
bf16 checkpoint loaded with dtype=float32, as for fp32 master weights: every reader must
materialise converted copies), and `fp32x8` (the fp32 model in 8 safetensors files, as large
checkpoints ship: each rank's slices span several files); `bf16-files` (any `--model`: bf16,
loaded as saved, in `save_pretrained`'s layout of files of at most 5 GB and at least 4 of them,
written tensor by tensor so that the 8B one never exists whole in memory); `moe-experts` (not a
Llama: a ~290M Qwen3-MoE, 32 experts per layer, fp32, saved one tensor per expert as the hub
stores MoE checkpoints, which transformers 5 stacks into one tensor per layer on load);
`vl-moe-transposed` (a Qwen3-VL-MoE with that MoE as its language model, fp32, its experts
stacked as the hub stores them, `[E, hidden, 2 x intermediate]`, which transformers 5 transposes
on load).

Per rank: peak RSS and peak anonymous RSS above the rank's own baseline (taken after imports,
process-group init and Accelerator creation; see `PeakMemory`; the peak runs to the end of the
first write, so `native`'s copied pages count), and the load wall time (from
`from_pretrained` to the end of `fsdp2_prepare_model`/`load_into_sharded`, slowest rank), with
two of its parts: `from_pretrained`, and moving the weight bytes (broadcast: rank 0's transfer;
sharded: each rank's own reads, plus any scatter), the only part the strategy changes. Beside
it, for a rank that read from the files, the storage/copy bound of the same bytes, measured on
that rank after its load (`raw_read_seconds`: `pread` into a fresh buffer, then into the same
touched buffer). "estimate" is `fsdp-offload-cfg estimate`'s host peak for the method's strategy
(rank 0, other ranks), computed offline from the checkpoint, over the measured peak RSS.
"worst anon vs ..." is the largest rank's anonymous peak over what a rank must
hold at least, its share of the model plus one 32 MiB bucket (target at scale: 1.00x). `loss` (one
forward on fixed tokens, models up to 2 GiB) and `weight sum` (every parameter element once,
summed over the ranks) show that the methods load the same model. Model bytes = parameters +
buffers as loaded. A launch that drives the host's available memory under 5% of it (or
`--min-available-gib`) is stopped whole and its row says "does not fit", with what the ranks held. A second table splits the loader's
methods' time by step (`LoadReport.seconds`, rank 0 of the median run; each step ends in an
agreement, so it includes waiting for the slowest rank).

Each configuration runs `--repeat` times, the methods interleaved (plain, stock, broadcast, sharded,
plain, ...) so that a slow spell of the machine hits all of them; before each launch the
checkpoint is read once so that every method starts with it in the page cache. Times are the
median over the repeats, memory the largest peak seen; "vs broadcast" is the median time divided by
the median time of `broadcast` of the same configuration in the same run.

    python benchmarks/load_memory.py                 # 2 and 4 ranks, all methods, 3 repeats (~15 min here)
    python benchmarks/load_memory.py --ranks 4 --methods broadcast sharded --repeat 5
    python benchmarks/load_memory.py --model 100m --ranks 4 --repeat 1 --methods stock native broadcast sharded auto
    python benchmarks/load_memory.py --model 8b --ranks 8 --repeat 1 ...   # a 16 GB checkpoint: 16 cores, 128 GB
    python benchmarks/load_memory.py --model 100m --ranks 2 --methods plain broadcast sharded --reference

`--reference` loads a frozen second copy of the model beside it, as TRL's DPO loads its reference
model: both loaded before either is prepared, the model prepared first (the estimate then counts
the reference model too); "x model" stays the one model's bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fsdp_offload_cfg.testing.host_memory import meminfo_bytes, run_guarded, status_bytes

METHODS = ("plain", "stock", "broadcast", "sharded", "auto", "native")
LOADER_METHODS = ("broadcast", "sharded", "auto")
GIB = 2**30


# ------------------------------------------------------------------------------ memory probes


class PeakMemory:
    """Peak RSS (VmHWM, reset through /proc/self/clear_refs) and peak anonymous RSS (RssAnon,
    sampled every 10 ms: finer sampling slows the load it measures, and the peaks it must catch
    last tenths of a second) from `start()` on, in bytes. Both matter: transformers maps
    safetensors files, and mapped file pages count in RSS only once touched (page cache, shared
    by the ranks of a node), while anonymous memory is what each rank really allocates."""

    def __init__(self) -> None:
        self._anon = 0
        self._rss = 0
        self._hwm_reset = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def start(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self._hwm_reset = True
        except OSError:
            pass
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._anon = max(self._anon, status_bytes("RssAnon"))
            self._rss = max(self._rss, status_bytes("VmRSS"))
            time.sleep(0.01)

    def stop(self) -> tuple[int, int]:
        """(peak RSS, peak anonymous RSS)."""
        self._stop.set()
        self._thread.join()
        rss = status_bytes("VmHWM") if self._hwm_reset else self._rss
        return rss, max(self._anon, status_bytes("RssAnon"))


# ------------------------------------------------------------------------------ one rank


def model_class(model_dir: str) -> type:
    """The checkpoint's model class, from its `config.json` (a Llama, or the MoE checkpoint's)."""
    import transformers

    with open(os.path.join(model_dir, "config.json")) as f:
        return getattr(transformers, json.load(f)["architectures"][0])


def _accelerator(cpu_ram_efficient_loading: bool, model_dir: str):
    """A real Accelerator (MULTI_CPU on a CPU machine) with the FSDP2 plugin put on its state by
    hand, which is what `patch()` does on the CPU; on a GPU machine accelerate does it itself."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        cpu_ram_efficient_loading=cpu_ram_efficient_loading,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=list(model_class(model_dir)._no_split_modules),  # the decoder layer
    )
    accelerator = Accelerator(cpu=True)
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def _setup(method: str, model_dir: str):
    """Everything that is not loading (runs before the baseline is taken)."""
    accelerator = _accelerator(method == "stock", model_dir)
    if method == "stock":
        # transformers' own gate for "local rank 0 reads, the others do not" (read at load time;
        # set after the Accelerator, which refuses ACCELERATE_USE_FSDP without an accelerator)
        os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true")
    return accelerator


def _load(method: str, model_dir: str, dtype, accelerator, result: dict, reference: bool = False):
    """Load with `method`; `result["build_seconds"]` is the time spent in `from_pretrained`.
    `reference`: a frozen second copy too, loaded and prepared as TRL's DPO does (both models
    loaded before either is prepared, the model prepared first). Returns (model, reference)."""
    start = time.perf_counter()
    model = _from_pretrained(method, model_dir, dtype)
    frozen = _from_pretrained(method, model_dir, dtype).requires_grad_(False) if reference else None
    result["build_seconds"] = time.perf_counter() - start
    report = _prepare(method, model, accelerator)
    result["move_seconds"] = _move_seconds(report)
    result["read_bytes"] = getattr(getattr(report, "read", None), "bytes_read", 0)
    result["phases"] = dict(getattr(report, "seconds", {}))
    if frozen is not None:
        frozen = _prepare(method, frozen, accelerator)
        frozen = frozen.model if method in LOADER_METHODS else frozen
    return (report.model if method in LOADER_METHODS else report), frozen


def first_touch_seconds(model) -> tuple[float, float]:
    """Seconds to read every byte of this rank's shards and buffers once (a sum per tensor),
    then to write every shard once (`mul_(1)`, which leaves every value as it is, as an optimizer
    step writes each parameter): nothing much for memory a load filled; for shards that are views
    of a mapped file (`native`) the page faults of the read, and the copy on write of each page."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    start = time.perf_counter()
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            local(tensor).sum()
        read = time.perf_counter()
        for param in model.parameters():
            local(param).mul_(1)
    return read - start, time.perf_counter() - read


def raw_read_seconds(model_dir: str, nbytes: int, rank: int) -> tuple[float, float]:
    """The storage/copy bound of reading `nbytes` on this rank: `pread` of as many bytes of the
    checkpoint (this rank's stretch of it, in 64 MiB calls) into a fresh buffer, then again into
    the same, already touched, buffer. Fresh memory is what a load fills (the kernel faults and
    zeroes each page as the copy reaches it); touched memory is the copy alone."""
    import torch

    files = sorted(Path(model_dir).glob("*.safetensors"))
    sizes = [f.stat().st_size for f in files]
    start = (rank * nbytes) % max(1, sum(sizes) - nbytes + 1)
    times = []
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(2):
        view, done, began = memoryview(buffer.numpy()).cast("B"), 0, time.perf_counter()
        offset = start
        for path, size in zip(files, sizes):
            if offset >= size:
                offset -= size
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                while done < nbytes and offset < size:
                    n = os.preadv(fd, [view[done:done + min(64 * 2**20, nbytes - done, size - offset)]], offset)
                    done, offset = done + n, offset + n
            finally:
                os.close(fd)
            offset = 0
        times.append(time.perf_counter() - began)
    return times[0], times[1]


def _move_seconds(report) -> float | None:
    """Seconds this rank spent moving weight bytes: rank 0's scatter and/or its own reads."""
    if not hasattr(report, "sent"):  # plain and stock: accelerate's own prepare, no report
        return None
    read = report.read.seconds if report.read else 0.0
    return read + (report.sent.seconds if report.sent else 0.0)


def _from_pretrained(method: str, model_dir: str, dtype):
    from transformers import PreTrainedModel

    from fsdp_offload_cfg.loading import auto_from_pretrained, rank0_from_pretrained, sharded_from_pretrained

    cls = model_class(model_dir)
    if method in ("plain", "stock"):
        return cls.from_pretrained(model_dir, dtype=dtype)
    if method == "native":
        import torch.distributed as dist
        from transformers.distributed import DistributedConfig  # transformers >= 5.15

        config = DistributedConfig(fsdp_size=dist.get_world_size())
        return cls.from_pretrained(model_dir, dtype=dtype, distributed_config=config)
    load = {"broadcast": rank0_from_pretrained, "sharded": sharded_from_pretrained}.get(method, auto_from_pretrained)
    return load(PreTrainedModel.from_pretrained, cls, model_dir, dtype=dtype)


def _prepare(method: str, model, accelerator):
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    from fsdp_offload_cfg.loading import load_into_sharded

    if method in ("plain", "stock"):
        return fsdp2_prepare_model(accelerator, model)
    if method == "native":  # transformers sharded it in from_pretrained
        return model
    strategy = method
    return load_into_sharded(model, lambda m: fsdp2_prepare_model(accelerator, m), strategy=strategy)


def weight_sum(model) -> float:
    """The sum of every parameter element, each counted once over the ranks (float64, one
    all_reduce): equal for two methods that load the same weights however each shards them, and
    cheap at any size (a forward of an 8B model would all-gather 16 GB per rank over gloo)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    def float64_sum(tensor) -> torch.Tensor:  # in blocks: a float64 copy of an 8B model's embedding is 2 GB
        return sum((block.double().sum() for block in tensor.reshape(-1).split(2**22)), torch.zeros((), dtype=torch.float64))

    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for param in model.parameters():
            if isinstance(param, DTensor):  # a replicated placement holds the same values on each of its ranks
                copies = 1
                for dim, placement in enumerate(param.placements):
                    copies *= param.device_mesh.size(dim) if placement.is_replicate() else 1
                total += float64_sum(param.to_local()) / copies
            else:  # a plain tensor: the whole parameter on every rank
                total += float64_sum(param) / dist.get_world_size()
    dist.all_reduce(total)
    return total.item()


LOSS_UP_TO_BYTES = 2 * GIB  # a forward on fixed tokens for models up to this size (`loss` column)


def worker(method: str, model_dir: str, dtype_name: str, out: str, reference: bool = False) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # imports are part of the baseline (transformers imports a model's module lazily, on first
    # access of its class: ~45 MiB for Llama, which is not loading)
    import accelerate.utils.fsdp_utils  # noqa: F401

    import fsdp_offload_cfg.loading  # noqa: F401

    model_class(model_dir)
    result: dict = {"rank": rank, "method": method}
    try:
        accelerator = _setup(method, model_dir)
        dist.barrier()
        baseline_rss, baseline_anon = status_bytes("VmRSS"), status_bytes("RssAnon")
        peak = PeakMemory()
        peak.start()
        start = time.perf_counter()
        model, frozen = _load(method, model_dir, getattr(torch, dtype_name), accelerator, result, reference)
        dist.barrier()
        result["seconds"] = time.perf_counter() - start
        result["first_read_seconds"], result["first_write_seconds"] = first_touch_seconds(model)
        dist.barrier()
        rss, anon = peak.stop()
        result["peak_rss"], result["peak_anon"] = rss - baseline_rss, anon - baseline_anon
        result["model_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
            b.numel() * b.element_size() for b in model.buffers()
        )
        result["weight_sum"] = weight_sum(model)
        if result["model_bytes"] <= LOSS_UP_TO_BYTES:
            with torch.no_grad():
                ids = torch.arange(16).reshape(1, 16)
                result["loss"] = model(ids, labels=ids).loss.item()
        del model, frozen  # the raw read below fills as much fresh memory as the shards took: not beside them
        gc.collect()
        dist.barrier()  # every rank reads its raw bytes at once, as they read their shards at once
        if result["read_bytes"]:
            result["raw_fresh_seconds"], result["raw_touched_seconds"] = raw_read_seconds(
                model_dir, result["read_bytes"], rank)
    except Exception as exc:  # noqa: BLE001 - recorded as "crash" in the table
        result["crash"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    if "crash" not in result:
        dist.destroy_process_group()
    else:
        os._exit(1)  # torchrun then stops the ranks left waiting in a collective of the crashed method


# ------------------------------------------------------------------------------ driver


CHECKPOINTS = ("fp32", "bf16->fp32", "fp32x8", "bf16-files", "moe-experts", "vl-moe-transposed")
MODELS = ("300m", "100m", "8b")  # `fsdp_offload_cfg.testing.models.LLAMA_SHAPES`


def load_dtype(checkpoint: str) -> str:
    """`bf16-files` loads as saved (bf16), the others as float32."""
    return "bfloat16" if checkpoint == "bf16-files" else "float32"


def build_model(model_dir: Path, checkpoint: str, model: str = "300m") -> None:
    """The checkpoint of `checkpoint`: the 300M model saved as one file (fp32, or bf16), or the fp32
    model saved in 8 files (`max_shard_size` an eighth of it), as large checkpoints ship; or
    (`bf16-files`, any `model`) a bf16 checkpoint written file by file in `save_pretrained`'s
    layout: files of at most 5 GB, and at least 4 of them (Llama-3-8B ships as 4)."""
    import torch

    from fsdp_offload_cfg.testing.models import (
        save_llama_300m,
        save_qwen3_moe_300m,
        save_qwen3_vl_moe_300m,
        write_llama_checkpoint,
    )

    if checkpoint == "bf16-files":
        write_llama_checkpoint(str(model_dir), model, torch.bfloat16, min_files=4)
        return
    if model != "300m":
        raise SystemExit(f"--checkpoints {checkpoint} is built for --model 300m only; use bf16-files for {model}")
    if checkpoint == "moe-experts":
        save_qwen3_moe_300m(str(model_dir))
        return
    if checkpoint == "vl-moe-transposed":
        save_qwen3_vl_moe_300m(str(model_dir))
        return
    save_llama_300m(str(model_dir), torch.bfloat16 if checkpoint == "bf16->fp32" else torch.float32)
    if checkpoint == "fp32x8":
        from transformers import LlamaForCausalLM

        one_file = model_dir / "model.safetensors"
        eighth = one_file.stat().st_size * 53 // 400  # whole tensors per file: a little over an eighth makes 8
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        one_file.unlink()
        model.save_pretrained(model_dir, max_shard_size=eighth)


def warm_page_cache(model_dir: Path) -> None:
    """Read every checkpoint file once, so no method pays (or profits from) a cold page cache."""
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as f:
            while f.read(64 * 2**20):
                pass


def launch(method: str, ranks: int, model_dir: Path, dtype: str, out: Path, timeout: int,
           min_available: int, reference: bool = False) -> list[dict]:  # fmt: skip
    """One `torchrun` of `method`; one result dict per rank."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", __file__,
        "--worker", method, "--model-dir", str(model_dir), "--dtype", dtype, "--out", str(out),
        *(["--reference"] if reference else []),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    log = Path(f"{out}.log")
    stopped = run_guarded(cmd, env, log, timeout, min_available)
    results = []
    for rank in range(ranks):
        path = Path(f"{out}.{rank}")
        if stopped is None and path.exists():
            results.append(json.loads(path.read_text()))
            continue
        last = (log.read_text(errors="replace").strip().splitlines() or ["(empty)"])[-1][:160]
        results.append({"rank": rank, "crash": stopped or f"no result; the launch's last line: {last}"})
    return results


@dataclass
class Summary:
    """One method and configuration over its repeats."""

    crash: str | None = None
    rank0_rss: int = 0
    rank0_anon: int = 0
    others_rss: int = 0  # largest peak over the other ranks and the repeats
    others_anon: int = 0
    seconds: float = 0.0  # median over repeats of the slowest rank's time
    build_seconds: float = 0.0  # the same run's `from_pretrained` share (slowest rank)
    move_seconds: float | None = None  # the same run's scatter/read share (slowest rank; the loader's methods)
    first_read_seconds: float = 0.0  # the same run's first read of every shard (slowest rank)
    first_write_seconds: float = 0.0  # then its first write of every parameter shard (slowest rank)
    phases: dict[str, float] | None = None  # the same run's rank 0 `LoadReport.seconds` (loader methods)
    loss: float | None = None  # a forward on fixed tokens (models up to LOSS_UP_TO_BYTES)
    weight_sum: float = 0.0  # every parameter element summed once over the ranks (`weight_sum`)
    estimate: tuple[int, int] | None = None  # `estimated_peaks` (rank 0, others), set by the driver
    model_bytes: int = 0
    raw_fresh_seconds: float | None = None  # the same run's raw read of the same bytes (slowest rank)
    raw_touched_seconds: float | None = None


def summarize(runs: list[list[dict]]) -> Summary:
    crashes = [r["crash"] for results in runs for r in results if "crash" in r]
    if crashes:
        return Summary(crash=crashes[0])
    times = sorted((max(r["seconds"] for r in results), i) for i, results in enumerate(runs))
    median = runs[times[len(times) // 2][1]]
    return Summary(
        rank0_rss=max(results[0]["peak_rss"] for results in runs),
        rank0_anon=max(results[0]["peak_anon"] for results in runs),
        others_rss=max(r["peak_rss"] for results in runs for r in results[1:]),
        others_anon=max(r["peak_anon"] for results in runs for r in results[1:]),
        seconds=max(r["seconds"] for r in median),
        build_seconds=max(r["build_seconds"] for r in median),
        move_seconds=None if median[0]["move_seconds"] is None else max(r["move_seconds"] for r in median),
        first_read_seconds=max(r["first_read_seconds"] for r in median),
        first_write_seconds=max(r["first_write_seconds"] for r in median),
        phases=median[0]["phases"] or None,
        loss=median[0].get("loss"),
        weight_sum=median[0]["weight_sum"],
        model_bytes=median[0]["model_bytes"],
        raw_fresh_seconds=max((r.get("raw_fresh_seconds") or 0.0 for r in median), default=0.0) or None,
        raw_touched_seconds=max((r.get("raw_touched_seconds") or 0.0 for r in median), default=0.0) or None,
    )


def estimated_peaks(model_dir: Path, method: str, ranks: int, dtype: str,
                    reference: bool = False) -> tuple[int, int] | None:  # fmt: skip
    """`fsdp-offload-cfg estimate`'s host peaks (rank 0, each other rank) for `method`'s strategy,
    computed offline from the checkpoint's config and headers: the estimate checked against the
    real peaks in the same table, at the size the run loads. None for a method it has no model of."""
    from fsdp_offload_cfg import load_config
    from fsdp_offload_cfg.estimate import estimate_memory

    if method not in ("plain", *LOADER_METHODS):
        return None
    config = load_config({"distributed_type": "FSDP", "mixed_precision": "no",
                          "fsdp_config": {"version": 2, "cpu_ram_efficient_loading": True}})  # fmt: skip
    report = estimate_memory(config, str(model_dir), seq_len=16, batch_size=1, num_processes=ranks, device="cpu",
                             dtype=dtype, reference=reference)  # fmt: skip
    peaks = report["loading"]["by_strategy"][method]
    return peaks["rank0_host_peak_bytes"], peaks["other_host_peak_bytes"]


def progress(method: str, ranks: int, repeat: int, results: list[dict]) -> str:
    """One line per launch as it ends (a large model's table comes only after all its launches)."""
    crashes = [r["crash"] for r in results if "crash" in r]
    if crashes:
        return f"  {method}, {ranks} ranks, run {repeat + 1}: {crashes[0]}"
    worst = max(max(r["peak_anon"] for r in results), 0)
    return (f"  {method}, {ranks} ranks, run {repeat + 1}: {max(r['seconds'] for r in results):.2f} s, "
            f"largest rank's anonymous peak {worst / GIB:.2f} GiB")  # fmt: skip


def _gib(nbytes: int, model_bytes: int) -> str:
    return f"{nbytes / GIB:.2f} ({nbytes / model_bytes:.2f}x)"


def worst_rank_vs_bound(s: Summary, ranks: int, model_bytes: int) -> str:
    """The largest rank's anonymous peak against what a rank must hold at least: its share of the
    model plus one bucket in flight (the target of loading at scale)."""
    from fsdp_offload_cfg.loading.prepare import DEFAULT_BUCKET_BYTES

    bound = model_bytes / ranks + DEFAULT_BUCKET_BYTES
    return f"{max(s.rank0_anon, s.others_anon) / bound:.2f}x"


def estimate_vs_measured(s: Summary) -> str:
    """The estimate's peaks over the measured peak RSS, rank 0 and the largest other rank."""
    if s.estimate is None:
        return ""
    return " / ".join(f"{e / GIB:.2f} ({e / max(m, 1):.2f}x)" for e, m in zip(s.estimate, (s.rank0_rss, s.others_rss)))


def row(checkpoint: str, method: str, ranks: int, s: Summary, baseline: Summary | None, model_bytes: int) -> str:
    if s.crash is not None:
        label = "does not fit" if s.crash.startswith("does not fit") else "crash"
        return f"| {checkpoint} | {method} | {ranks} | {label} |" + " |" * 14 + f" {s.crash} |"
    ratio = f"{s.seconds / baseline.seconds:.2f}x" if baseline is not None and baseline.crash is None else ""
    move = "" if s.move_seconds is None else f"{s.move_seconds:.2f}"
    raw = "" if s.raw_fresh_seconds is None else (
        f"{s.raw_fresh_seconds:.2f} / {s.raw_touched_seconds:.2f} ({s.move_seconds / s.raw_fresh_seconds:.2f}x)")
    return (
        f"| {checkpoint} | {method} | {ranks} | {_gib(s.rank0_rss, model_bytes)} | {_gib(s.rank0_anon, model_bytes)} "
        f"| {_gib(s.others_rss, model_bytes)} | {_gib(s.others_anon, model_bytes)} "
        f"| {worst_rank_vs_bound(s, ranks, model_bytes)} | {estimate_vs_measured(s)} | {s.seconds:.2f} "
        f"| {s.seconds + s.first_read_seconds:.2f} | {s.seconds + s.first_read_seconds + s.first_write_seconds:.2f} "
        f"| {s.build_seconds:.2f} | {move} | {raw} | {ratio} | {'' if s.loss is None else f'{s.loss:.6f}'} "
        f"| {s.weight_sum:.6e} | |"
    )


def phase_row(checkpoint: str, method: str, ranks: int, s: Summary) -> str | None:
    """Where a loader method's time went, step by step (rank 0 of the median run)."""
    if s.crash is not None or not s.phases:
        return None
    steps = " | ".join(f"{s.phases.get(step, 0.0):.3f}" for step in PHASES)
    return f"| {checkpoint} | {method} | {ranks} | {s.build_seconds:.3f} | {steps} |"


PHASES = ("describe", "agree sources", "shard on meta", "allocate", "read own slices", "transfer from rank 0", "check")
PHASE_HEADER = [
    "| checkpoint | method | ranks | from_pretrained (slowest rank) | " + " | ".join(PHASES) + " |",
    "|---|---|---|---|" + "---|" * len(PHASES),
]


HEADER = [
    (
        "| checkpoint | method | ranks | rank 0 peak RSS GiB (x model) | rank 0 peak anon | "
        "other ranks: max peak RSS | other ranks: max peak anon | worst anon vs model / ranks + one bucket "
        "| estimate GiB: rank 0 / other ranks (x measured RSS) "
        "| time s (median) | load + first read s "
        "| + first write s | of which from_pretrained s "
        "| of which moving bytes s | raw read of those bytes s: fresh / touched memory (moving vs fresh) "
        "| time vs broadcast | loss | weight sum | note |"
    ),
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--model", default="300m", choices=MODELS,
                        help="the Llama shape (300m: every checkpoint kind; 100m, 8b: bf16-files)")
    parser.add_argument("--checkpoints", nargs="+", choices=CHECKPOINTS,
                        help="default: fp32 bf16->fp32 fp32x8 for 300m, bf16-files for the others")
    parser.add_argument("--repeat", type=int, default=3, help="launches per method and configuration (median time)")
    parser.add_argument("--model-dir", help="reuse (or create) the checkpoints under here instead of a temp dir")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per launch")
    parser.add_argument("--min-available-gib", type=float,
                        help="stop a launch when the host's available memory falls under this (default: 5%% of it)")
    parser.add_argument("--reference", action="store_true",
                        help="load a frozen second copy beside the model and prepare it after, as TRL's DPO does")
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.model_dir, args.dtype, args.out, args.reference)
    checkpoints = args.checkpoints or (list(CHECKPOINTS[:3]) if args.model == "300m" else ["bf16-files"])
    min_available = int(args.min_available_gib * GIB) if args.min_available_gib else meminfo_bytes("MemTotal") // 20

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        root = Path(args.model_dir) if args.model_dir else work
        lines, phase_lines = list(HEADER), list(PHASE_HEADER)
        for checkpoint in checkpoints:
            family = {"moe-experts": "qwen3-moe", "vl-moe-transposed": "qwen3-vl-moe"}.get(checkpoint, "llama")
            model_dir = root / f"{family}-{args.model}-{checkpoint.replace('->', '-to-')}"
            if not model_dir.exists():  # built beside it, then renamed: an interrupted build is never reused
                print(f"writing the {args.model} {checkpoint} checkpoint to {model_dir}", flush=True)
                partial = model_dir.with_name(model_dir.name + ".partial")
                shutil.rmtree(partial, ignore_errors=True)
                build_model(partial, checkpoint, args.model)
                partial.rename(model_dir)
            model_bytes = None
            for ranks in args.ranks:
                runs: dict[str, list[list[dict]]] = {m: [] for m in args.methods}
                for repeat in range(args.repeat):
                    for method in args.methods:
                        warm_page_cache(model_dir)
                        out = work / f"{method}-{ranks}-{model_dir.name}-{repeat}"
                        runs[method].append(launch(method, ranks, model_dir, load_dtype(checkpoint), out, args.timeout,
                                                   min_available, args.reference))  # fmt: skip
                        print(progress(method, ranks, repeat, runs[method][-1]), flush=True)
                summaries = {m: summarize(r) for m, r in runs.items()}
                for method, summary in summaries.items():
                    summary.estimate = estimated_peaks(model_dir, method, ranks, load_dtype(checkpoint), args.reference)
                model_bytes = model_bytes or next((s.model_bytes for s in summaries.values() if s.model_bytes), None)
                for method in args.methods:
                    lines.append(
                        row(checkpoint, method, ranks, summaries[method], summaries.get("broadcast"), model_bytes or 1)
                    )
                    print(lines[-1], flush=True)
                    phases = phase_row(checkpoint, method, ranks, summaries[method])
                    if phases:
                        phase_lines.append(phases)
            if model_bytes:
                print(f"model bytes of {checkpoint} (parameters + buffers, as loaded): {model_bytes / GIB:.2f} GiB")
        print(f"{args.repeat} repeats per row, {time.perf_counter() - started:.0f} s in all\n")
        print("\n".join(lines))
        print("\nseconds by step, rank 0 (`LoadReport.seconds`)\n")
        print("\n".join(phase_lines))


if __name__ == "__main__":
    main()
