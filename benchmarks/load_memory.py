"""Host memory and wall time of loading a ~320M-parameter Llama into FSDP2, per rank.

Methods (each in its own `torchrun` launch, CPU + gloo):
  plain     every rank runs `from_pretrained` in full, then accelerate's `fsdp2_prepare_model`;
  stock     transformers + accelerate as shipped with `cpu_ram_efficient_loading`
            (ACCELERATE_USE_FSDP / FSDP_CPU_RAM_EFFICIENT_LOADING set, then `fsdp2_prepare_model`
            with `cpu_ram_efficient_loading=True`); "crash" if it raises;
  ours      `rank0_from_pretrained` + `load_into_sharded` (accelerate's `fsdp2_prepare_model`,
            stock loading off, as the shard_fn): load_strategy "broadcast";
  sharded   `sharded_from_pretrained` + `load_into_sharded(strategy="sharded")`: every rank
            builds on meta and reads only its own slices from the safetensors file.

Checkpoints: `fp32` (loaded as saved: transformers maps the safetensors file and FSDP copies
only each rank's rows, so plain loading costs little *anonymous* memory) and `bf16->fp32` (a
bf16 checkpoint loaded with dtype=float32, as for fp32 master weights: every reader must
materialise converted copies).

Per rank: peak RSS and peak anonymous RSS above the rank's own baseline (taken after imports,
process-group init and Accelerator creation; see `PeakMemory`), and the load wall time (from
`from_pretrained` to the end of `fsdp2_prepare_model`/`load_into_sharded`, slowest rank).
`loss` (one forward on fixed tokens) shows that the methods load the same model. Model bytes =
parameters + buffers as loaded (fp32).

    python benchmarks/load_memory.py                 # 2 and 4 ranks, all methods (~6 min here)
    python benchmarks/load_memory.py --ranks 2 --methods ours
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

METHODS = ("plain", "stock", "ours", "sharded")
GIB = 2**30


# ------------------------------------------------------------------------------ memory probes


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


class PeakMemory:
    """Peak RSS (VmHWM, reset through /proc/self/clear_refs) and peak anonymous RSS (RssAnon,
    sampled every 2 ms) from `start()` on, in bytes. Both matter: transformers maps safetensors
    files, and mapped file pages count in RSS only once touched (page cache, shared by the
    ranks of a node), while anonymous memory is what each rank really allocates."""

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
            self._anon = max(self._anon, _status_kib("RssAnon") * 1024)
            self._rss = max(self._rss, _status_kib("VmRSS") * 1024)
            time.sleep(0.002)

    def stop(self) -> tuple[int, int]:
        """(peak RSS, peak anonymous RSS)."""
        self._stop.set()
        self._thread.join()
        rss = _status_kib("VmHWM") * 1024 if self._hwm_reset else self._rss
        return rss, max(self._anon, _status_kib("RssAnon") * 1024)


# ------------------------------------------------------------------------------ one rank


def _accelerator(cpu_ram_efficient_loading: bool):
    """A real Accelerator (MULTI_CPU on a CPU machine) with the FSDP2 plugin put on its state by
    hand, which is what `patch()` does on the CPU; on a GPU machine accelerate does it itself."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        cpu_ram_efficient_loading=cpu_ram_efficient_loading,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    )
    accelerator = Accelerator(cpu=True)
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def _setup(method: str):
    """Everything that is not loading (runs before the baseline is taken)."""
    accelerator = _accelerator(cpu_ram_efficient_loading=method == "stock")
    if method == "stock":
        # transformers' own gate for "local rank 0 reads, the others do not" (read at load time;
        # set after the Accelerator, which refuses ACCELERATE_USE_FSDP without an accelerator)
        os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true")
    return accelerator


def _load(method: str, model_dir: str, accelerator):
    import torch
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from transformers import LlamaForCausalLM, PreTrainedModel

    if method in ("plain", "stock"):
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return fsdp2_prepare_model(accelerator, model)
    if method == "ours":
        from fsdp_offload_cfg.loading import load_into_sharded, rank0_from_pretrained

        original = PreTrainedModel.from_pretrained
        model = rank0_from_pretrained(original, LlamaForCausalLM, model_dir, dtype=torch.float32)
        return load_into_sharded(model, lambda m: fsdp2_prepare_model(accelerator, m))
    if method == "sharded":
        from fsdp_offload_cfg.loading import load_into_sharded, sharded_from_pretrained

        original = PreTrainedModel.from_pretrained
        model = sharded_from_pretrained(original, LlamaForCausalLM, model_dir, dtype=torch.float32)
        return load_into_sharded(model, lambda m: fsdp2_prepare_model(accelerator, m), strategy="sharded")
    raise ValueError(method)


def worker(method: str, model_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # imports are part of the baseline (transformers imports a model's module lazily, on first
    # access of its class: ~45 MiB for Llama, which is not loading)
    import accelerate.utils.fsdp_utils  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    import fsdp_offload_cfg.loading  # noqa: F401

    result: dict = {"rank": rank, "method": method}
    try:
        accelerator = _setup(method)
        dist.barrier()
        baseline_rss, baseline_anon = _status_kib("VmRSS") * 1024, _status_kib("RssAnon") * 1024
        peak = PeakMemory()
        peak.start()
        start = time.perf_counter()
        model = _load(method, model_dir, accelerator)
        dist.barrier()
        result["seconds"] = time.perf_counter() - start
        rss, anon = peak.stop()
        result["peak_rss"], result["peak_anon"] = rss - baseline_rss, anon - baseline_anon
        with torch.no_grad():
            ids = torch.arange(16).reshape(1, 16)
            result["loss"] = model(ids, labels=ids).loss.item()
        result["model_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
            b.numel() * b.element_size() for b in model.buffers()
        )
    except Exception as exc:  # noqa: BLE001 - recorded as "crash" in the table
        result["crash"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    if "crash" not in result:
        dist.destroy_process_group()
    else:
        os._exit(1)  # torchrun then stops the ranks left waiting in a collective of the crashed method


# ------------------------------------------------------------------------------ driver


CHECKPOINTS = ("fp32", "bf16->fp32")


def build_model(model_dir: Path, checkpoint: str) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from _models import save_llama_300m

    save_llama_300m(str(model_dir), torch.float32 if checkpoint == "fp32" else torch.bfloat16)


def launch(method: str, ranks: int, model_dir: Path, work: Path, timeout: int) -> list[dict]:
    out = work / f"{method}-{ranks}-{model_dir.name}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", __file__,
        "--worker", method, "--model-dir", str(model_dir), "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    try:
        subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, check=False)
    except subprocess.TimeoutExpired:
        pass
    results = []
    for rank in range(ranks):
        path = Path(f"{out}.{rank}")
        results.append(json.loads(path.read_text()) if path.exists() else {"rank": rank, "crash": "no result (hung?)"})
    return results


def _gib(nbytes: int, model_bytes: int) -> str:
    return f"{nbytes / GIB:.2f} ({nbytes / model_bytes:.2f}x)"


def row(checkpoint: str, method: str, ranks: int, results: list[dict], model_bytes: int) -> str:
    crashes = [r for r in results if "crash" in r]
    if crashes:
        return f"| {checkpoint} | {method} | {ranks} | crash | crash | crash | crash | | | {crashes[0]['crash']} |"
    rank0, others = results[0], results[1:]
    rss = max(r["peak_rss"] for r in others)
    anon = max(r["peak_anon"] for r in others)
    seconds = max(r["seconds"] for r in results)
    return (
        f"| {checkpoint} | {method} | {ranks} | {_gib(rank0['peak_rss'], model_bytes)} "
        f"| {_gib(rank0['peak_anon'], model_bytes)} "
        f"| {_gib(rss, model_bytes)} | {_gib(anon, model_bytes)} | {seconds:.1f} | {rank0['loss']:.6f} | |"
    )


HEADER = [
    "| checkpoint | method | ranks | rank 0 peak RSS GiB (x model) | rank 0 peak anon | "
    "other ranks: max peak RSS | other ranks: max peak anon | time s | loss | note |",
    "|---|---|---|---|---|---|---|---|---|---|",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--checkpoints", nargs="+", default=list(CHECKPOINTS), choices=CHECKPOINTS)
    parser.add_argument("--model-dir", help="reuse (or create) the checkpoints under here instead of a temp dir")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per launch")
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.model_dir, args.out)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        root = Path(args.model_dir) if args.model_dir else work
        lines = list(HEADER)
        model_bytes = None
        for checkpoint in args.checkpoints:
            model_dir = root / ("llama-300m-" + checkpoint.replace("->", "-to-"))
            if not (model_dir / "config.json").exists():
                build_model(model_dir, checkpoint)
            for ranks in args.ranks:
                for method in args.methods:
                    results = launch(method, ranks, model_dir, work, args.timeout)
                    model_bytes = model_bytes or next((r["model_bytes"] for r in results if "model_bytes" in r), None)
                    lines.append(row(checkpoint, method, ranks, results, model_bytes or 1))
                    print(lines[-1], flush=True)
        if model_bytes:
            print(f"\nmodel bytes (fp32 parameters + buffers, as loaded): {model_bytes / GIB:.2f} GiB")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
