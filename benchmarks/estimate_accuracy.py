"""How close `fsdp-offload-cfg estimate` comes to what real runs measure, figure by figure.

For Llama, Qwen2 (tied), DeepseekV3 (MoE, MLA) and Llava (CLIP tower), at two sequence lengths:

  activations     one forward of the real model (bf16, CPU), saved bytes through saved-tensor hooks
                  (`SavedBytesMeter`, storages once, parameters excluded) against `activations_bytes`;
  checkpointing   the same with torch's non-reentrant `checkpoint_wrapper` on every layer, as
                  accelerate applies it, plus the KV cache the checkpointed layers keep alive,
                  against the estimate's `checkpointing` saved bytes;
  allocator       independent of saved-tensor hooks: what the C allocator (glibc `mallinfo2`) holds
                  after a real forward while its loss is alive, plain and checkpointed, for Llamas
                  large enough that the allocator's other traffic is noise (hidden 256, 4 layers,
                  GQA and MHA, 512 and 1024 tokens); and the most it holds after any op of a real
                  forward and backward (stopped at the embeddings' output: no weight gradient)
                  against the plain setting's `device_peak_bytes` (saves and backward's working set);
  offload         `enable_activation_offload` (async handler, CPU proxy), forward + backward:
                  `offload_stats()` peak resident bytes and pool bytes against the estimate's
                  replay of the saves alone (the counters see saved tensors, not backward's
                  working set, which `activations_on_device_bytes` adds) and `pinned_host_bytes`;
                  and under a pool cap (`max_pinned_bytes` at half that pool) what the run's pool
                  refused and kept on the device (`pool_full_bytes`) against `capped_bytes`;
                  and the pools of 2 gloo ranks under FSDP2, added, against `per_machine.host_bytes`;
  params/grads/optimizer
                  2 gloo ranks, `fully_shard` per layer and root with bf16 mixed precision over
                  fp32 weights, one AdamW step: rank 0's local storages of parameters, gradients
                  and optimizer state against `params_bytes`, `grads_bytes`, `optimizer_bytes`;
  LoRA            `--lora-rank 8` (PEFT, every linear layer but the head) on the allocator's GQA Llama:
                  saved bytes of PEFT on the real model (its float32 adapters in bf16, as FSDP2's
                  mixed precision gathers them) and the C allocator after a forward against
                  `activations_bytes`; 2 gloo ranks prepared by the installed accelerate (bf16
                  mixed precision, AdamW over the adapters, one step) against the states; the
                  same for DoRA (`--lora-dora`, and the LoRA figure it was estimated with before;
                  checkpointed, the allocator's peak in backward, where the recompute's norm
                  temporaries count)
                  and for LoRA with the embeddings trained whole (`--lora-modules-to-save`);
  loading         `benchmarks/load_memory.py` (~320M Llama, peak RSS above baseline, broadcast
                  and sharded, fp32 and bf16->fp32 checkpoints) against the loading peaks.

Each row prints estimate, measured, and estimate/measured. Targets: within 10% for parameters,
gradients, optimizer and activations; within 20% for the loading peaks.

    OMP_NUM_THREADS=1 python benchmarks/estimate_accuracy.py                 # everything (~4 min here)
    OMP_NUM_THREADS=1 python benchmarks/estimate_accuracy.py --skip-loading  # ~1 min
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

MODELS = ("llama", "qwen2_tied", "deepseek_v3", "llava")
BATCH = 2
RANKS = 2


def bench_config(**fsdp: object):
    from fsdp_offload_cfg import load_config

    mixed = fsdp.pop("mixed_precision", "bf16")
    base = {"version": 2, "activation_cpu_offload": {"enabled": True, "mode": "async"},
            "cpu_ram_efficient_loading": True, "load_strategy": "broadcast"}
    return load_config({"distributed_type": "FSDP", "mixed_precision": mixed, "fsdp_config": {**base, **fsdp}})


def estimate(model_dir: str, seq_len: int, **fsdp: object) -> dict:
    from fsdp_offload_cfg.estimate import estimate_memory

    return estimate_memory(bench_config(**fsdp), model_dir, seq_len=seq_len, batch_size=BATCH, num_processes=RANKS,
                           device="cpu")


# ------------------------------------------------------------------------------ real runs


def measured_activations(model_dir: str, seq_len: int, layers: list[str], cap: int) -> dict[str, int]:
    """Saved bytes plain and checkpointed, and the offload's counters, uncapped and with the pool
    capped at `cap` bytes, on the real model (bf16)."""
    from fsdp_offload_cfg.offload.options import ActivationOffloadConfig
    from fsdp_offload_cfg.testing.real_runs import (
        cache_bytes,
        checkpoint_every_group,
        offload_counters,
        real_model,
        saved_bytes,
    )

    model, batch = real_model(model_dir, torch.bfloat16, BATCH, seq_len)
    plain = saved_bytes(model, batch)
    stats = offload_counters(model, batch, layers)
    capped = offload_counters(model, batch, layers, ActivationOffloadConfig(max_pinned_bytes=cap))
    checkpoint_every_group(model, layers)
    return {"activations": plain, "checkpointed": saved_bytes(model, batch) + cache_bytes(model, batch),
            "offload_on_device": stats["peak_resident_bytes"], "pool": stats["pinned_pool_bytes"],
            "past_the_cap": capped["pool_full_bytes"]}


def measured_machine_pools(model_dir: str, layers: list[str], seq_len: int) -> int:
    """The pinned pools of `RANKS` gloo ranks under FSDP2 (one forward and backward each), added:
    what one machine's ranks pin together."""
    from fsdp_offload_cfg.testing.dist import run_workers
    from fsdp_offload_cfg.testing.real_runs import pinned_pool_under_fsdp2

    return sum(run_workers(pinned_pool_under_fsdp2, RANKS, model_dir, layers, BATCH, seq_len, timeout=300))


def measured_states(model_dir: str, layers: list[str]) -> dict[str, int]:
    from fsdp_offload_cfg.testing.dist import run_workers
    from fsdp_offload_cfg.testing.real_runs import states_after_one_step

    return run_workers(states_after_one_step, RANKS, model_dir, layers, timeout=300)[0]


# ------------------------------------------------------------------------------ table


def row(model: str, seq: object, figure: str, est: int, real: int, target: float) -> str:
    ratio = est / real if real else float("nan")
    ok = "yes" if abs(ratio - 1) <= target else "**no**"
    return f"| {model} | {seq} | {figure} | {est:,} | {real:,} | {ratio:.3f} | {ok} |"


HEADER = ["| model | seq | figure | estimate bytes | measured bytes | estimate / measured | within target |",
          "|---|---|---|---|---|---|---|"]


def model_rows(name: str, model_dir: str, seq_lens: list[int]) -> list[str]:
    from fsdp_offload_cfg.testing.real_runs import estimated_saves_only

    rows = []
    for seq in seq_lens:
        report = estimate(model_dir, seq)
        layers = report["model"]["layer_classes"]
        per, acts = report["per_rank"], report["activations"]["settings"]
        cap = per["pinned_host_bytes"] // 2
        capped = estimate(model_dir, seq, activation_cpu_offload={"enabled": True, "mode": "async",
                                                                  "max_pinned_bytes": cap})
        real = measured_activations(model_dir, seq, layers, cap)
        saves = estimated_saves_only(model_dir, report, bench_config().activation_cpu_offload)["offload"]
        rows += [
            row(name, seq, "activations_bytes", per["activations_bytes"], real["activations"], 0.10),
            row(name, seq, "checkpointing saved_bytes", acts["checkpointing"]["saved_bytes"], real["checkpointed"], 0.10),
            row(name, seq, "on the device, saves only (offload)", saves.device_peak_bytes,
                real["offload_on_device"], 0.10),
            row(name, seq, "pinned_host_bytes", per["pinned_host_bytes"], real["pool"], 0.10),
            row(name, seq, "capped_bytes (offload, pool capped at half)",
                capped["activations"]["settings"]["offload"]["capped_bytes"], real["past_the_cap"], 0.10),
            row(name, seq, f"per_machine host_bytes ({RANKS} ranks)", report["per_machine"]["host_bytes"],
                measured_machine_pools(model_dir, layers, seq), 0.10),
        ]
    states = measured_states(model_dir, layers)
    for figure in ("params", "grads", "optimizer"):
        rows.append(row(name, "-", f"{figure}_bytes", report["per_rank"][f"{figure}_bytes"], states[figure], 0.10))
    return rows


ALLOCATOR_MODELS = {  # name -> save_llama overrides
    "llama-h256-gqa": {"num_key_value_heads": 4},
    "llama-h256-mha": {"num_key_value_heads": 8},
}


def allocator_rows(work: Path, seq_lens: list[int]) -> list[str]:
    """Plain and checkpointed activations against the C allocator (see the module docstring)."""
    from fsdp_offload_cfg.testing.models import save_llama
    from fsdp_offload_cfg.testing.real_runs import (
        MALLINFO2,
        allocator_held_after_forward,
        allocator_peak_in_backward,
        checkpoint_every_group,
        real_model,
    )

    if MALLINFO2 is None:
        return ["| (allocator rows need glibc's mallinfo2) | | | | | | |"]
    rows = []
    for name, overrides in ALLOCATOR_MODELS.items():
        model_dir = save_llama(str(work / name), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                               num_attention_heads=8, vocab_size=1000, max_position_embeddings=2048, **overrides)
        for seq in seq_lens:
            report = estimate(model_dir, seq)
            layers = report["model"]["layer_classes"]
            model, batch = real_model(model_dir, torch.bfloat16, BATCH, seq)
            plain = allocator_held_after_forward(model, batch)
            peak = allocator_peak_in_backward(model, batch)
            checkpoint_every_group(model, layers)
            checkpointed = allocator_held_after_forward(model, batch)
            rows += [
                row(name, seq, "activations_bytes vs allocator", report["per_rank"]["activations_bytes"], plain, 0.10),
                row(name, seq, "checkpointing saved_bytes vs allocator",
                    report["activations"]["settings"]["checkpointing"]["saved_bytes"], checkpointed, 0.10),
                row(name, seq, "plain device_peak_bytes vs allocator's peak in backward",
                    report["activations"]["settings"]["plain"]["device_peak_bytes"], peak, 0.10),
            ]
    return rows


LORA_RANK = 8


LORA_VARIANTS = {  # name: the estimate's adapters, PEFT's config beyond rank and targets
    "LoRA": ({}, {}),
    "DoRA": ({"dora": True}, {"use_dora": True}),
    "LoRA + embeddings": ({"modules_to_save": "embed_tokens,lm_head"}, {"modules_to_save": ["embed_tokens", "lm_head"]}),
}


def lora_rows(work: Path, seq_lens: list[int]) -> list[str]:
    """`--lora-rank` against PEFT on the real model, the allocator and accelerate (module docstring)."""
    model_dir = _lora_llama(work, "llama-lora")
    # checkpointed, without a cache, as training runs it (a recompute appends to a cache again)
    no_cache = _lora_llama(work, "llama-lora-no-cache", use_cache=False)
    rows = []
    for variant, (ours, peft) in LORA_VARIANTS.items():
        rows += _adapter_rows(model_dir, no_cache, variant, ours, peft, seq_lens)
    return rows


def _lora_llama(work: Path, name: str, **config: object) -> str:
    from fsdp_offload_cfg.testing.models import save_llama

    return save_llama(str(work / name), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=1000, max_position_embeddings=2048,
                      **config)


def _adapter_rows(model_dir: str, no_cache: str, variant: str, ours: dict, peft: dict,
                  seq_lens: list[int]) -> list[str]:
    """One adapter variant's rows: activations against PEFT's saves and the allocator, states
    against accelerate (but DoRA's); for DoRA's activations and the embeddings' states, also the
    plain LoRA figure they were estimated with before 2026-12-07."""
    from peft import LoraConfig, get_peft_model

    from fsdp_offload_cfg.estimate import Lora, estimate_memory
    from fsdp_offload_cfg.testing.dist import run_workers
    from fsdp_offload_cfg.testing.real_runs import (
        MALLINFO2,
        allocator_held_after_forward,
        allocator_peak_in_backward,
        checkpoint_every_group,
        real_model,
        saved_bytes,
        states_after_accelerate_step,
    )

    name = f"llama-h256-gqa {variant}"
    rows = []

    def estimated(seq: int, path: str = model_dir, **adapters: object) -> dict:
        return estimate_memory(bench_config(), path, seq_len=seq, batch_size=BATCH, num_processes=RANKS,
                               device="cpu", dtype="bfloat16", lora=Lora(LORA_RANK, **adapters))

    for seq in seq_lens:
        report = estimated(seq, **ours)
        before = estimated(seq)["per_rank"]["activations_bytes"] if ours.get("dora") else None
        for figure, measure in (("saved-tensor hooks", saved_bytes), ("allocator", allocator_held_after_forward)):
            if figure == "allocator" and MALLINFO2 is None:
                continue
            model, batch = real_model(model_dir, torch.bfloat16, BATCH, seq)
            model = get_peft_model(model, LoraConfig(r=LORA_RANK, target_modules="all-linear", **peft))
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)  # as FSDP2's MixedPrecisionPolicy gathers them
            real = measure(model, batch)
            rows.append(row(name, seq, f"activations_bytes vs {figure}", report["per_rank"]["activations_bytes"],
                            real, 0.10))
            if before is not None:
                rows.append(row(name, seq, f"as LoRA (before 2026-12-07) vs {figure}", before, real, 0.10))
        if ours.get("dora") and MALLINFO2 is not None:  # the norm's temporaries in forward, and in a recompute
            report = estimated(seq, no_cache, **ours)
            for setting in ("plain", "checkpointing"):
                model, batch = real_model(no_cache, torch.bfloat16, BATCH, seq)
                model = get_peft_model(model, LoraConfig(r=LORA_RANK, target_modules="all-linear", **peft))
                for p in model.parameters():
                    if p.requires_grad:
                        p.data = p.data.to(torch.bfloat16)
                if setting == "checkpointing":
                    checkpoint_every_group(model, report["model"]["layer_classes"])
                rows.append(row(f"{name}, no cache", seq, f"{setting} device_peak_bytes vs allocator peak in backward",
                                report["activations"]["settings"][setting]["device_peak_bytes"],
                                allocator_peak_in_backward(model, batch, adapters=True), 0.10))
    if ours.get("dora"):
        return rows
    states = run_workers(states_after_accelerate_step, RANKS, model_dir, report["model"]["layer_classes"], 1,
                         LORA_RANK, peft.get("modules_to_save"), timeout=300)[0]
    before = estimated(seq_lens[-1])["per_rank"] if ours.get("modules_to_save") else None
    for figure in ("params", "grads", "optimizer"):
        rows.append(row(name, "-", f"{figure}_bytes (accelerate-prepared)", report["per_rank"][f"{figure}_bytes"],
                        states[figure], 0.10))
        if before is not None:
            rows.append(row(name, "-", f"as LoRA (before 2026-12-07): {figure}_bytes", before[f"{figure}_bytes"],
                            states[figure], 0.10))
    return rows


def loading_rows(work: Path, ranks: list[int]) -> list[str]:
    import load_memory

    rows = []
    for checkpoint in ("fp32", "bf16->fp32"):
        model_dir = work / ("llama-300m-" + checkpoint.replace("->", "-to-"))
        if not (model_dir / "config.json").exists():
            load_memory.build_model(model_dir, checkpoint)
        for world in ranks:
            for strategy in ("broadcast", "sharded"):
                load_memory.warm_page_cache(model_dir)
                results = load_memory.launch(strategy, world, model_dir, load_memory.load_dtype(checkpoint),
                                             work / f"{strategy}-{world}", 600, min_available=0)  # fmt: skip
                crashed = [r["crash"] for r in results if "crash" in r]
                if crashed:
                    raise RuntimeError(f"load_memory {strategy} crashed: {crashed[0]}")
                from fsdp_offload_cfg.estimate import estimate_memory

                config = bench_config(mixed_precision="no", load_strategy=strategy)
                report = estimate_memory(config, str(model_dir), seq_len=16, batch_size=1, num_processes=world,
                                         device="cpu", dtype="float32")
                loading = report["loading"]
                label = f"llama-300m {checkpoint}, {world} ranks"
                rows.append(row(label, "-", f"{strategy} rank0_host_peak_bytes", loading["rank0_host_peak_bytes"],
                                results[0]["peak_rss"], 0.20))
                rows.append(row(label, "-", f"{strategy} other_host_peak_bytes", loading["other_host_peak_bytes"],
                                max(r["peak_rss"] for r in results[1:]), 0.20))
                print(rows[-2], rows[-1], sep="\n", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs=2, default=[128, 512])
    parser.add_argument("--lora-seq-lens", type=int, nargs="+", default=[128, 512, 1024],
                        help="the adapter rows' lengths: at short ones DoRA's weight-sized temporaries decide the peak")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--loading-ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--skip-loading", action="store_true")
    parser.add_argument("--work-dir", help="keep the built models here (the 300M Llama takes a while to write)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from fsdp_offload_cfg.testing import models as _models

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        paths = _models.build_all(str(work / "tiny"), list(args.models))
        lines = list(HEADER)
        for name in args.models:
            for line in model_rows(name, paths[name], args.seq_lens):
                print(line, flush=True)
                lines.append(line)
        for line in allocator_rows(work, [512, 1024]) + lora_rows(work, args.lora_seq_lens):
            print(line, flush=True)
            lines.append(line)
        if not args.skip_loading:
            lines += loading_rows(work, args.loading_ranks)
    print(f"\n{time.perf_counter() - started:.0f} s in all; batch {BATCH} per rank, {RANKS} ranks for the states\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
