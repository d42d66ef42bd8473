"""Peak memory and step time of activation offload on a Llama-style model, one process.

Rows, each with and without activation checkpointing (torch's `checkpoint_wrapper` on every
decoder layer, as accelerate's `fsdp2_apply_ac` applies it):
  none         no offload;
  save_on_cpu  torch `save_on_cpu(pin_memory=True)`: what accelerate's
               `activation_checkpointing_offload` uses (around each checkpointed layer via
               `offload_wrapper`; around the whole forward without checkpointing);
  ours-sync    `enable_activation_offload(mode="sync")`;
  ours-async   `enable_activation_offload(mode="async")`.

Peak: on CUDA `torch.cuda.max_memory_allocated()` over the measured steps (everything: weights,
grads, optimizer state, activations). On the CPU there is no device memory to read, so the peak
is the saved-activation proxy: bytes of tensors saved for backward left in place (not moved to a
separate host buffer), parameters excluded; `offload_stats()["peak_resident_bytes"]` for ours,
a saved-tensor-hooks meter (`SavedBytesMeter`) for the others. Ratios are to the `none` row with
the same checkpointing setting. Times are the median of the measured steps (forward, backward,
AdamW step), after one warm-up step.

    python benchmarks/activation_offload.py                       # small CPU config, < 2 min
    python benchmarks/activation_offload.py --device cuda --layers 16 --hidden 2048 --seq 4096
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, offload_wrapper

from fsdp_offload_cfg.config import ActivationOffloadConfig
from fsdp_offload_cfg.offload import SavedBytesMeter, enable_activation_offload, offload_stats, reset_offload_stats

METHODS = ("none", "save_on_cpu", "ours-sync", "ours-async")
MIB = 2**20


@dataclass
class Row:
    method: str
    ac: bool
    peak: int
    step_s: float
    offloaded: int
    loss: float


def build(args: argparse.Namespace, method: str, ac: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 64 * 64 or 64,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=max(args.seq, 128),
        use_cache=False, attn_implementation=args.attn,
    )
    model = LlamaForCausalLM(cfg).to(args.device)
    if ac:
        for i, layer in enumerate(model.model.layers):
            wrapped = checkpoint_wrapper(layer, preserve_rng_state=False)
            model.model.layers[i] = offload_wrapper(wrapped) if method == "save_on_cpu" else wrapped
    if method.startswith("ours"):
        enable_activation_offload(model, ActivationOffloadConfig(enabled=True, mode=method.split("-")[1]))
    return model


def forward_context(model: nn.Module, method: str, ac: bool, cuda: bool) -> contextlib.AbstractContextManager:
    """What wraps each forward+backward: the baseline's hooks, and on the CPU the meter."""
    if method == "save_on_cpu" and not ac:
        inner = save_on_cpu(pin_memory=True)
        return inner if cuda else SavedBytesMeter(model, inner=inner)
    if method in ("none", "save_on_cpu") and not cuda:
        return SavedBytesMeter(model)  # with AC + save_on_cpu, offload_wrapper's hooks sit inside
    return contextlib.nullcontext()


@contextlib.contextmanager
def timed(cuda: bool, sink: list[float]) -> Iterator[None]:
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    yield
    if cuda:
        torch.cuda.synchronize()
    sink.append(time.perf_counter() - t0)


def run(args: argparse.Namespace, method: str, ac: bool) -> Row:
    cuda = args.device.startswith("cuda")
    model = build(args, method, ac)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)
    times: list[float] = []
    peak, loss = 0, 0.0
    for step in range(args.steps + 1):  # step 0 warms up (pool, allocator, kernels)
        if step == 1:
            reset_offload_stats()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
        ctx = forward_context(model, method, ac, cuda)
        with timed(cuda, times), ctx:
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if step >= 1 and isinstance(ctx, SavedBytesMeter):
            peak = max(peak, ctx.peak_bytes)
        loss = out.loss.item()
    stats = offload_stats()
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    elif method.startswith("ours"):
        peak = stats["peak_resident_bytes"]
    del model, opt
    gc.collect()
    return Row(method, ac, peak, statistics.median(times[1:]), stats["offloaded_bytes"] // args.steps, loss)


def table(rows: list[Row], cuda: bool) -> str:
    what = "peak device MiB" if cuda else "peak saved-on-device MiB (CPU proxy)"
    lines = [
        f"| method | AC | {what} | mem ratio | step ms | time ratio | offloaded MiB/step | loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = {r.ac: r for r in rows if r.method == "none"}
    for r in rows:
        b = base[r.ac]
        moved = f"{r.offloaded / MIB:.2f}" if r.method.startswith("ours") else "-"
        lines.append(
            f"| {r.method} | {'yes' if r.ac else 'no'} | {r.peak / MIB:.2f} | {r.peak / b.peak:.2f} | "
            f"{r.step_s * 1e3:.0f} | {r.step_s / b.step_s:.2f} | {moved} | {r.loss:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--ac", nargs="+", default=["no", "yes"], choices=["no", "yes"])
    args = p.parse_args(argv)
    rows = [run(args, m, ac == "yes") for ac in args.ac for m in args.methods]
    print(f"Llama {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, "
          f"{args.steps} steps, device {args.device}, torch {torch.__version__}\n")
    print(table(rows, args.device.startswith("cuda")))


if __name__ == "__main__":
    main()
