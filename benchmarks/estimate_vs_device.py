"""`fsdp-offload-cfg estimate` against the device's own peak, setting by setting.

For each activation setting the estimate models (plain, checkpointing, offload, checkpointing +
offload, and one plan per `--budget`), one training run on the path users take: the plugin's
`patch()` with an accelerate FSDP2 config, `Accelerator()`, `from_pretrained` of a Llama saved
here, `accelerator.prepare`, AdamW, `--mixed-precision` (bf16 by default on CUDA). Each setting
runs in its own process (a fresh allocator), as one rank: the process group has one member, as
under `accelerate launch --num_processes 1`.

Measured: `torch.cuda.max_memory_allocated()` over the steps after the first (the first creates
AdamW's state, and a budget plans there), the figure the estimate's `peak_device_bytes` models,
against `estimate_memory(...)["device_by_setting"][setting]["peak_device_bytes"]` for the same
config, model, batch and rates. Budget rows also print the plan the run logged and the
estimate's own plan for the same rates (stated in both configs, measured once here), and the
peak above the step's start (what the step added: activations, gradients, gathered weights).
Target: within 10% on every row.

On the CPU there is no device allocator to read, so the measured columns are empty there: a CPU
run only checks that every setting trains through the plugin and that the two plans agree.

    python benchmarks/estimate_vs_device.py --layers 16 --hidden 2048 --seq 8192 --budget 6GiB 9GiB
    python benchmarks/estimate_vs_device.py --device cpu --layers 2 --hidden 64 --seq 64 --budget 1MiB
    python benchmarks/estimate_vs_device.py --layers 16 --hidden 2048 --seq 4096 --settings plain checkpointing \
        --reshard-after-forward false
    python benchmarks/estimate_vs_device.py --vocab 128256 --settings plain checkpointing --loss-head trl-fused

`--loss-head trl-fused` scores the tokens as `trl sft` does, through TRL's fused LM head
(`add_fused_lm_head`, no logits over the vocabulary), against the estimate of a TRL run
(`loss_head="trl_fused_lm_head"`, `estimate/heads.py`).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_offload_cfg._sizes import show_size as _show

SETTINGS = ("plain", "checkpointing", "offload", "checkpointing_and_offload")


@dataclass
class Measured:
    peak: int | None  # max_memory_allocated over the measured steps (CUDA), None on the CPU
    above_start: int | None  # that peak less what was allocated when the step began
    plan: str  # the budget's plan as the run logged it ("" without a budget)
    choices: list[str] | None  # each layer's choice in that plan
    loss: float


def show_size(n: int | None) -> str:
    return "-" if n is None else _show(n)


def plugin_config(args: argparse.Namespace, setting: str, rates: tuple[float, float]) -> dict[str, Any]:
    """The accelerate config the run and the estimate share."""
    fsdp: dict[str, Any] = {
        "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_cpu_ram_efficient_loading": True, "fsdp_reshard_after_forward": args.reshard_after_forward == "true",
        "fsdp_activation_checkpointing": setting in ("checkpointing", "checkpointing_and_offload"),
        "fsdp_activation_cpu_offload": setting in ("offload", "checkpointing_and_offload"),
    }
    if setting.startswith("budget="):
        fsdp |= {"fsdp_activation_memory_budget": setting.removeprefix("budget="),
                 "fsdp_activation_budget_compute_tflops": rates[0] / 1e12,
                 "fsdp_activation_budget_copy_gb_per_s": rates[1] / 1e9}
    return {"distributed_type": "FSDP", "num_processes": 1, "mixed_precision": args.mixed_precision,
            "fsdp_config": fsdp}


def llama_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The model's config (tests/test_estimate.py estimates the measured rows from it alone)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 64 * 64 or 64,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=max(args.seq, 128),
        tie_word_embeddings=False,
    )


def save_llama(args: argparse.Namespace, path: str) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(args)).save_pretrained(path)


def train(args: argparse.Namespace, path: str, setting: str, rates: tuple[float, float], port: int) -> Measured:
    """One setting, in this (fresh) process, as rank 0 of 1."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(plugin_config(args, setting, rates))
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from fsdp_offload_cfg.budget import describe, planned, planned_choices

    accelerator = Accelerator()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=args.attn)  # saved in float32
    fused = getattr(args, "loss_head", "model") == "trl-fused"
    if fused:  # as `trl sft` does before preparing: its tokens scored tile by tile, no logits
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(accelerator.device)
    cuda = accelerator.device.type == "cuda"
    peak = start = None
    loss = float("nan")
    for step in range(args.steps + 1):
        if step == 1 and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        if fused:  # `trl sft`'s loss: the negative log-probability of each labelled token, averaged
            out = model(input_ids=ids, labels=ids, use_cache=False, fused_lm_head=True)
            step_loss = -out.log_probs.sum() / (ids.numel() - ids.shape[0])
        else:
            step_loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        accelerator.backward(step_loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = step_loss.item()
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    planner = planned(model)
    plan = describe(planner.plan, planner.shape, planner.rates_source()) if planner else ""
    choices = planned_choices(model)
    accelerator.end_training()
    return Measured(peak, peak - start if peak is not None and start is not None else None, plan, choices, loss)


def run_setting(args: argparse.Namespace, path: str, setting: str, rates: tuple[float, float]) -> Measured | str:
    """`train` in a spawned process; a setting that fails returns why, for its row."""
    from fsdp_offload_cfg.testing.dist import free_port

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        try:
            return pool.apply(train, (args, path, setting, rates, free_port()))
        except Exception as error:  # noqa: BLE001 - the table reports it in the row
            return f"{type(error).__name__}: {str(error)[:200]}"


def estimated(args: argparse.Namespace, path: str, setting: str, rates: tuple[float, float]) -> dict[str, Any]:
    from fsdp_offload_cfg import load_config
    from fsdp_offload_cfg.estimate import estimate_memory

    return estimate_memory(load_config(plugin_config(args, setting, rates)), path, seq_len=args.seq,
                           batch_size=args.batch, device=args.device, dtype="float32",
                           compute_flops=rates[0], copy_bytes=rates[1],
                           loss_head="trl_fused_lm_head" if getattr(args, "loss_head", "model") == "trl-fused"
                           else "cross_entropy")


def row(args: argparse.Namespace, path: str, setting: str, rates: tuple[float, float]) -> tuple[str, str]:
    """A table line for one setting, and (budget rows) the two plans beneath it."""
    from fsdp_offload_cfg.estimate import EstimateError

    try:
        report = estimated(args, path, setting, rates)
    except EstimateError as error:  # a budget no plan meets: the run would stop the same way
        return f"| {setting} | not estimated: {error} ||||||", ""
    key = "plan" if setting.startswith("budget=") else setting
    estimate = report["device_by_setting"][key]["peak_device_bytes"]
    measured = run_setting(args, path, setting, rates)
    if isinstance(measured, str):
        return f"| {setting} | {show_size(estimate)} | not run: {measured} |||||", ""
    ratio = estimate / measured.peak if measured.peak else None
    within = "-" if ratio is None else ("yes" if abs(ratio - 1) <= 0.10 else "no")
    line = (f"| {setting} | {show_size(estimate)} | {show_size(measured.peak)} | {f'{ratio:.3f}' if ratio else '-'} "
            f"| {within} | {show_size(measured.above_start)} | {measured.loss:.4f} |")
    plans = ""
    if key == "plan":
        choices = [layer["choice"] for layer in report["plan"]["layers"]]
        same = "the same plan" if choices == measured.choices else f"another plan: {choices}"
        plans = f"\n{setting}: the run planned: {measured.plan}\n{setting}: the estimate planned {same}"
    return line, plans


def rates_here(args: argparse.Namespace) -> tuple[float, float]:
    """The device's rates, measured once here and stated to every budget run and its estimate, so
    that both plan at the same rates."""
    from fsdp_offload_cfg.estimate.rates import measure_rates

    dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
    return measure_rates(torch.device(args.device), dtype, args.hidden, args.batch * args.seq)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=2, help="measured steps, after one that warms up")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--mixed-precision", default=None, choices=["no", "bf16"],
                   help="accelerate's mixed_precision (default: bf16 on CUDA, no on the CPU)")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    p.add_argument("--reshard-after-forward", default="true", choices=["true", "false"],
                   help="false: every layer stays gathered from its forward to its backward")
    p.add_argument("--budget", nargs="*", default=[], metavar="SIZE", help="add a row per activation_memory_budget")
    p.add_argument("--loss-head", default="model", choices=["model", "trl-fused"],
                   help="trl-fused: the loss through TRL's fused LM head, as `trl sft` scores tokens (no logits)")
    args = p.parse_args(argv)
    args.mixed_precision = args.mixed_precision or ("bf16" if args.device == "cuda" else "no")
    rates = rates_here(args)
    lines = ["| setting | estimated | measured | estimated / measured | within 10% | above step start "
             "| loss |", "|---|---:|---:|---:|---|---:|---:|"]
    plans = ""
    with tempfile.TemporaryDirectory(prefix="estimate_vs_device_") as path:
        save_llama(args, path)
        for setting in [*args.settings, *(f"budget={b}" for b in args.budget)]:
            line, plan = row(args, path, setting, rates)
            lines.append(line)
            plans += plan
            print(line, flush=True)  # a long run shows its progress
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (no device allocator: nothing measured)"
    print(f"\nLlama {args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab}, seq {args.seq}, batch "
          f"{args.batch}, loss head {args.loss_head}, mixed precision "
          f"{args.mixed_precision}, AdamW, FSDP2 (one rank, reshard_after_forward {args.reshard_after_forward}), "
          f"{args.steps} measured steps; device {device}; torch "
          f"{torch.__version__}; rates {rates[0] / 1e12:.3g} TFLOP/s, copies {rates[1] / 1e9:.3g} GB/s\n")
    print("\n".join(lines) + ("\n" + plans if plans else ""))


if __name__ == "__main__":
    main()
