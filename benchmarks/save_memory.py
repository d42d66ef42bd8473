"""Host memory and wall time of saving a model sharded by FSDP2 (a Llama or a Qwen3-MoE), per
rank: what a full fine-tune's final `save_pretrained` costs rank 0's host.

Methods (each in its own `torchrun` launch, CPU + gloo; the model loaded by the plugin's sharded
loader, as saved, bf16, before the baseline is taken):
  streamed  `model.save_pretrained(dir)` on every rank with the plugin: each weight gathered as
            its bytes are written, rank 0 holding one at a time (`fsdp_offload_cfg.streamed_save`);
  recipe    accelerate's documented way, `save_pretrained(dir, is_main_process=...,
            state_dict=accelerator.get_state_dict(model))`: the whole model gathered on rank 0's
            host first (what the Trainer's `FULL_STATE_DICT` save does too);
  save_model        `accelerator.save_model(model, dir)` on every rank with the plugin: streamed
                    the same way, in accelerate's own files;
  save_model_stock  accelerate's own `save_model` in the same launch setup (the function the
                    plugin wraps): the whole state dict gathered on rank 0's host first.

Per rank: peak RSS and peak anonymous RSS above the rank's baseline (after loading), from the
save's start to its end (`load_memory.PeakMemory`), and the save's wall time (slowest rank).
"equal" compares every tensor written with the checkpoint the model was loaded from (the model
is not trained, so a save must give back its bytes). A launch that drives the host's available
memory under `--min-available-gib` is stopped whole and says "does not fit".

    python benchmarks/save_memory.py                                   # 100M model, 2 ranks (~1 min)
    python benchmarks/save_memory.py --model moe300m --ranks 2 4       # a Qwen3-MoE, 32 experts a layer
    OMP_NUM_THREADS=1 python benchmarks/save_memory.py --model 8b --ranks 4 --model-dir /tmp/bench_models
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from load_memory import MODELS, PeakMemory, build_model, model_class, warm_page_cache

from fsdp_offload_cfg.testing.host_memory import GIB, run_guarded, status_bytes

METHODS = ("streamed", "recipe", "save_model", "save_model_stock")


def worker(method: str, model_dir: str, out_dir: str, result_path: str) -> None:
    import torch
    import torch.distributed as dist

    import fsdp_offload_cfg
    from fsdp_offload_cfg.testing.configs import loader_config

    fsdp_offload_cfg.patch(loader_config("sharded"))
    from accelerate import Accelerator

    dist.init_process_group("gloo")
    rank, result = dist.get_rank(), {"method": method}
    try:
        accelerator = Accelerator(cpu=True)
        prepared = accelerator.prepare(model_class(model_dir).from_pretrained(model_dir, dtype=torch.bfloat16))
        model = accelerator.unwrap_model(prepared)
        stock_save_model = getattr(type(accelerator).save_model, "__wrapped__", None)
        dist.barrier()
        baseline_rss, baseline_anon = status_bytes("VmRSS"), status_bytes("RssAnon")
        peak = PeakMemory()
        peak.start()
        start = time.perf_counter()
        if method == "streamed":
            model.save_pretrained(out_dir)
        elif method == "save_model":
            accelerator.save_model(prepared, out_dir)
        elif method == "save_model_stock":
            stock_save_model(accelerator, prepared, out_dir)
        else:
            model.save_pretrained(out_dir, is_main_process=accelerator.is_main_process,
                                  state_dict=accelerator.get_state_dict(model))  # fmt: skip
        dist.barrier()
        result["seconds"] = time.perf_counter() - start
        rss, anon = peak.stop()
        result["peak_rss"], result["peak_anon"] = rss - baseline_rss, anon - baseline_anon
        result["shard_bytes"] = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        result["largest"] = max(p.numel() * p.element_size() for p in model.parameters())
    except Exception as exc:  # noqa: BLE001 - the row says it
        result["crash"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    Path(f"{result_path}.{rank}").write_text(json.dumps(result))
    if "crash" in result:
        os._exit(1)
    dist.destroy_process_group()


def equal_to_checkpoint(saved: Path, checkpoint: Path) -> str:
    """Every tensor the save wrote equals the checkpoint's of that name, and none is missing."""
    import torch
    from safetensors import safe_open

    def tensors(folder: Path) -> dict[str, Path]:
        found = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                found.update(dict.fromkeys(f.keys(), file))
        return found

    written, source = tensors(saved), tensors(checkpoint)
    if written.keys() != source.keys():
        return f"no: names differ ({len(written)} written, {len(source)} in the checkpoint)"
    for name, file in written.items():
        with safe_open(str(file), "pt") as a, safe_open(str(source[name]), "pt") as b:
            if not torch.equal(a.get_tensor(name), b.get_tensor(name)):
                return f"no: {name}"
    return "yes"


def launch(method: str, ranks: int, model_dir: Path, work: Path, timeout: int, min_available: int) -> list[dict]:
    out, results = work / f"saved_{method}", work / f"result_{method}_{ranks}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", __file__,
           "--worker", method, "--model-dir", str(model_dir), "--out", str(out), "--result", str(results)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    stopped = run_guarded(cmd, env, Path(f"{results}.log"), timeout, min_available)
    rows = []
    for rank in range(ranks):
        path = Path(f"{results}.{rank}")
        rows.append(json.loads(path.read_text()) if stopped is None and path.exists()
                    else {"crash": stopped or f"no result (see {results}.log)"})  # fmt: skip
    if all("crash" not in r for r in rows):
        rows[0]["equal"] = equal_to_checkpoint(out, model_dir)
    shutil.rmtree(out, ignore_errors=True)
    return rows


def row(method: str, ranks: int, results: list[dict], model_bytes: int) -> str:
    crash = next((r["crash"] for r in results if "crash" in r), None)
    if crash:
        return f"| {method} | {ranks} | {crash} | | | | | |"
    r0, others = results[0], results[1:]

    def gib(n: int) -> str:
        return f"{n / GIB:.2f} ({n / model_bytes:.2f}x)"

    return (f"| {method} | {ranks} | {gib(r0['peak_rss'])} / {gib(r0['peak_anon'])} | "
            f"{gib(max(r['peak_anon'] for r in others))} | {r0['largest'] / GIB:.2f} | "
            f"{max(r['seconds'] for r in results):.1f} | {model_bytes / GIB / max(r['seconds'] for r in results):.2f} | "
            f"{r0['equal']} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="100m", choices=(*MODELS, "moe300m"),
                        help="a Llama of that size, or moe300m: a ~290M Qwen3-MoE (32 experts a layer, bf16), "
                             "whose save transformers 5 builds one tensor per expert in")  # fmt: skip
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--model-dir", help="reuse (or create) the checkpoint under here instead of a temp dir")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per launch")
    parser.add_argument("--min-available-gib", type=float, default=1.0)
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.model_dir, args.out, args.result)
        return
    root = Path(args.model_dir or tempfile.mkdtemp(prefix="save_memory_"))
    model_dir = root / f"{args.model}_bf16-files"
    if not (model_dir / "config.json").exists():
        print(f"writing the {args.model} checkpoint to {model_dir} ...", file=sys.stderr)
        if args.model == "moe300m":
            import torch

            from fsdp_offload_cfg.testing.models import save_qwen3_moe_300m

            save_qwen3_moe_300m(str(model_dir), torch.bfloat16)
        else:
            build_model(model_dir, "bf16-files", args.model)
    model_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    work = Path(tempfile.mkdtemp(prefix="save_memory_out_", dir=root))
    print(f"Saving a {args.model} model ({model_bytes / GIB:.2f} GiB of bf16 safetensors) sharded by FSDP2, "
          f"CPU + gloo; GiB above each rank's baseline (x the model's bytes)\n")  # fmt: skip
    print("| method | ranks | rank 0 peak RSS / anon | other ranks' anon | largest weight GiB | save s | GiB/s "
          "| equal to the checkpoint |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for ranks in args.ranks:
        for method in args.methods:
            warm_page_cache(model_dir)
            results = launch(method, ranks, model_dir, work, args.timeout, int(args.min_available_gib * GIB))
            print(row(method, ranks, results, model_bytes), flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
