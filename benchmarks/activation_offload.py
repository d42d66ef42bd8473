"""Peak memory and step time of activation offload on a Llama-style model, against its peers.

Rows, each with and without activation checkpointing (torch's `checkpoint_wrapper` on every
decoder layer, as accelerate's `fsdp2_apply_ac` applies it):
  none         no offload;
  save_on_cpu  torch `save_on_cpu(pin_memory=True)`: what accelerate's
               `activation_checkpointing_offload` uses (around each checkpointed layer via
               `offload_wrapper`; around the whole forward without checkpointing);
  trl          TRL's `OffloadActivations` with streams, around the forward as TRL's trainers
               use it (a row only on CUDA, where `trl` imports: on the CPU it finds no
               accelerator and fails);
  ours-sync    `enable_activation_offload(mode="sync")`;
  ours-async   `enable_activation_offload(mode="async")`;
  budget=SIZE  `activation_memory_budget` (`--budget 6GiB`, or `--budget auto`: what the device,
               or the `--device-memory` cap, leaves; without checkpointing only: the plan
               decides it): each layer kept, offloaded, checkpointed or both, planned at the first
               step at rates measured on this device; the plan is printed under the table.

Each row runs in a fresh process (`--same-process` to share one), so one row's allocator cache,
pinned pool or compiled kernels never flatter the next. `--fsdp2` shards every decoder layer and
the root with `fully_shard` in a one-rank process group first, as `accelerate launch` with FSDP2
does, and hooks the offload after (where the plugin's prepare puts it).

Memory: on CUDA the peak is `torch.cuda.max_memory_allocated()` over the measured steps, beside
`max_memory_reserved()` (what the allocator held from the device: freed blocks that a copy stream
still uses stay reserved until that stream passes them, and an out-of-memory comes from there;
"retries" counts the allocations that found the device full and waited for every stream to free
what it held, which `--device-memory 9GiB` provokes as a smaller GPU would), and
"activations" is the allocated peak less what was allocated when the step began (weights, optimizer
state: what remains is what the step saved for backward, plus gradients as they appear, and the
optimizer's own temporaries). "fwd+bwd" is the same over forward and backward only: AdamW's
foreach step holds the gradients and one parameter-sized temporary, which can be the whole
step's peak once activations are small (every checkpointing row of docs/benchmarks.md stood
within 41 MiB of those two), so this column is the one that shows what an offload keeps.
"less grads" is that peak without the gradients alive at it (`NonGradientPeak`, read over one
more, untimed step): an offloading row peaks late in backward beside nearly all the gradients,
the `none` row early, before most exist, so only this column compares the activations. On the
CPU there is no device memory to read: both columns are the saved-activation proxy, the bytes of
tensors saved for backward left in place (`offload_stats()["peak_resident_bytes"]` for ours, a
saved-tensor-hooks meter for the others). Ratios are to the `none` row with the same checkpointing.

Time: the median measured step (forward, backward, AdamW), after one warm-up step; each phase is
timed on its own, and the `none` row's phases give each offloading row its copy bound: the time
the step cannot beat when its copies run beside compute, `max(forward, bytes out / bandwidth) +
max(backward, bytes in / bandwidth) + optimizer`, at the copy bandwidth measured here
(`estimate/rates.py`: 32 MiB to pinned host memory and back, the slower way).

    python benchmarks/activation_offload.py --budget 20MiB        # small CPU config, < 1 min
    python benchmarks/activation_offload.py --device cuda --layers 16 --hidden 2048 --seq 8192 \\
        --batch 1 --budget 6GiB 9GiB [--fsdp2]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, offload_wrapper

from fsdp_offload_cfg._sizes import show_size
from fsdp_offload_cfg.config import ActivationOffloadConfig
from fsdp_offload_cfg.estimate import EstimateError
from fsdp_offload_cfg.estimate.plot import parse_size
from fsdp_offload_cfg.offload import SavedBytesMeter, enable_activation_offload, offload_stats, reset_offload_stats
from fsdp_offload_cfg.testing.peaks import NonGradientPeak

METHODS = ("none", "save_on_cpu", "trl", "ours-sync", "ours-async")
MIB = 2**20


@dataclass
class Row:
    method: str
    ac: bool
    peak: int  # device peak (CUDA) or the saved-bytes proxy (CPU)
    activations: int  # the peak above the step's start (CUDA) or the proxy (CPU)
    phases: dict[str, float]  # median seconds of forward, backward, optimizer
    moved_out: int  # bytes per step the offload copied to the host (ours; 0 where not counted)
    moved_in: int  # and back
    loss: float
    plan: str = ""  # the budget's plan, as rank 0 logs it
    reserved: int = 0  # CUDA: the allocator's peak reserved bytes (what the device really gave it)
    fwd_bwd: int = 0  # CUDA: the allocated peak of forward and backward above the step's start (no optimizer)
    retries: int = 0  # CUDA: allocations over the measured steps that found the device full (`num_alloc_retries`)
    less_grads: int = 0  # CUDA: fwd+bwd less the gradients alive, at most (`NonGradientPeak`, one more step)
    error: str = ""  # why the row did not run (a peer that is not installed, or that failed)
    step_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.step_s = sum(self.phases.values())


def build(args: argparse.Namespace, method: str, ac: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=args.intermediate or int(args.hidden * 8 / 3) // 64 * 64 or 64,
        num_hidden_layers=args.layers, num_attention_heads=args.heads or max(1, args.hidden // 64),
        num_key_value_heads=args.kv_heads or max(1, args.hidden // 128), max_position_embeddings=max(args.seq, 128),
        use_cache=False, attn_implementation=args.attn,
    )
    # built where it runs, in its dtype: a 3B model's float32 init on the host takes minutes
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, args.dtype))
    try:
        with torch.device(args.device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default_dtype)
    if ac:
        for i, layer in enumerate(model.model.layers):
            wrapped = checkpoint_wrapper(layer, preserve_rng_state=False)
            model.model.layers[i] = offload_wrapper(wrapped) if method == "save_on_cpu" else wrapped
    budget = _budget_config(method, args.device_memory) if method.startswith("budget=") else None
    if budget is not None:
        from fsdp_offload_cfg.budget import wrap_layers

        wrap_layers(model, budget)  # before sharding, as the plugin's prepare does
    if args.fsdp2:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    if method.startswith("ours"):
        enable_activation_offload(model, ActivationOffloadConfig(enabled=True, mode=method.split("-")[1]))
    if budget is not None:
        from fsdp_offload_cfg.budget import enable_budget

        enable_budget(model, budget)
    return model


def _budget_config(method: str, device_memory: int | None):  # type: ignore[no-untyped-def]
    """The row's config; `budget=auto...` under `--device-memory` plans against that cap (the
    allocator can hold no more), else against the device's own memory."""
    from fsdp_offload_cfg import load_config

    budget = method.removeprefix("budget=")
    fsdp = {"fsdp_version": 2, "activation_memory_budget": budget}
    if budget.startswith("auto") and device_memory:
        fsdp["activation_budget_device_memory"] = device_memory
    return load_config({"distributed_type": "FSDP", "mixed_precision": "no", "fsdp_config": fsdp})


def forward_context(model: nn.Module, method: str, ac: bool, cuda: bool) -> contextlib.AbstractContextManager:
    """What wraps each forward: the peer's hooks, and on the CPU the meter."""
    if method == "trl":
        from trl.models.activation_offloading import get_act_offloading_ctx_manager

        inner = get_act_offloading_ctx_manager(model, use_pin_memory=cuda, use_streams=cuda)
        return inner if cuda else SavedBytesMeter(model, inner=inner)
    if method == "save_on_cpu" and not ac:
        inner = save_on_cpu(pin_memory=True)
        return inner if cuda else SavedBytesMeter(model, inner=inner)
    if method in ("none", "save_on_cpu") and not cuda:
        return SavedBytesMeter(model)  # with AC + save_on_cpu, offload_wrapper's hooks sit inside
    return contextlib.nullcontext()


def _sync(cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, method: str, ac: bool,
               cuda: bool, after_backward: Callable[[], None] = lambda: None,
               ) -> tuple[contextlib.AbstractContextManager, Any, tuple[float, float, float]]:
    """One step as the row's method runs it: its forward context, the output, and the seconds of
    forward, backward and the optimizer. `after_backward` runs between backward and the optimizer,
    untimed (it reads the device's peak there)."""
    ctx = forward_context(model, method, ac, cuda)
    t0 = _sync(cuda)
    with ctx:
        out = model(input_ids=ids, labels=ids)
        if method != "trl":  # TRL's trainers leave backward outside the context
            t1 = _sync(cuda)
            out.loss.backward()
    if method == "trl":
        t1 = _sync(cuda)
        out.loss.backward()
    t2 = _sync(cuda)
    after_backward()
    t2_opt = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t3 = _sync(cuda)
    return ctx, out, (t1 - t0, t2 - t1, t3 - t2_opt)


def run(args: argparse.Namespace, method: str, ac: bool) -> Row:
    if args.expandable_segments:  # before the row's first CUDA allocation, as patch() sets it
        from fsdp_offload_cfg.compat.allocator import set_expandable

        set_expandable(True)
    if args.fsdp2:
        _one_rank_group(args.device)
    cuda = args.device.startswith("cuda")
    if args.device_memory:
        _cap_device_memory(args.device, args.device_memory)
    model = build(args, method, ac)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(args.device)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    peak = start = reserved = fwd_bwd = retries = 0
    loss = 0.0

    def read_fwd_bwd_peak() -> None:
        nonlocal fwd_bwd
        fwd_bwd = max(fwd_bwd, torch.cuda.max_memory_allocated())

    for step in range(args.steps + 1):  # step 0 warms up (pool, allocator, kernels, the budget's plan)
        if step == 1:
            reset_offload_stats()
            if cuda:
                start = torch.cuda.memory_allocated()
                retries = torch.cuda.memory_stats()["num_alloc_retries"]
        if step >= 1 and cuda:  # each step's peaks from its start, so the one after backward is the step's own
            torch.cuda.reset_peak_memory_stats()
        ctx, out, seconds = train_step(model, opt, ids, method, ac, cuda,
                                       read_fwd_bwd_peak if step >= 1 and cuda else lambda: None)
        if step >= 1:
            for name, phase_s in zip(phases, seconds):
                phases[name].append(phase_s)
            if isinstance(ctx, SavedBytesMeter):
                peak = max(peak, ctx.peak_bytes)
            if cuda:
                peak, reserved = max(peak, torch.cuda.max_memory_allocated()), max(reserved, torch.cuda.max_memory_reserved())
        loss = out.loss.item()
        # the step's output goes before the next step, as a loop's `outputs = model(...)` lets it go:
        # held across it, a 3B Llama's 7.8 GiB of logits at 32k tokens sat beside the next step's
        del ctx, out
    stats = offload_stats()
    if cuda:
        retries = torch.cuda.memory_stats()["num_alloc_retries"] - retries
    if not cuda and method.startswith(("ours", "budget")):
        peak = stats["peak_resident_bytes"]
    less_grads = non_gradient_peak(model, opt, ids, method, ac) if cuda else 0
    if args.profile:  # after the counters and peaks are read: the profiled step changes no figure of the row
        profile_step(args, model, opt, ids, method, ac, cuda)
    plan = _plan_line(model, args) if method.startswith("budget") else ""
    del model, opt
    gc.collect()
    return Row(method, ac, peak, peak - start if cuda else peak, {k: statistics.median(v) for k, v in phases.items()},
               stats["offloaded_bytes"] // args.steps, stats["reloaded_bytes"] // args.steps, loss, plan, reserved,
               fwd_bwd - start if cuda else 0, retries, less_grads)


def non_gradient_peak(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, method: str, ac: bool) -> int:
    """One more step, untimed (its readings sum parameter gradients in backward), read by
    `NonGradientPeak`; the bytes above the step's start."""
    meter = NonGradientPeak(model)
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        train_step(model, opt, ids, method, ac, True, meter.read)
    finally:
        meter.close()
    return meter.peak - start


def _cap_device_memory(device: str, nbytes: int) -> None:
    """Hold the allocator to `nbytes` of the device, as a smaller GPU would: reserved blocks that a
    copy stream still holds are then freed by a retry that waits for every stream, a cost a
    device with room to spare never shows."""
    index = torch.device(device).index or 0
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / total), index)


def profile_step(args: argparse.Namespace, model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor,
                 method: str, ac: bool, cuda: bool) -> None:
    """One more step under `torch.profiler`, for finding where a row's time goes (the FSDP2
    offload row once sat at 1.19x of its copy bound against 1.03x in one process). Writes
    `<dir>/<row>.txt` (the ops by device time, else CPU time) and `<dir>/<row>.json.gz` (a Chrome
    trace: the copy streams beside compute and FSDP's streams)."""
    import gzip
    import re

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        train_step(model, opt, ids, method, ac, cuda)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", f"{method}-{'ac' if ac else 'noac'}{'-fsdp2' if args.fsdp2 else ''}")
    os.makedirs(args.profile, exist_ok=True)
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    with open(os.path.join(args.profile, f"{name}.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by=sort, row_limit=40))
    trace = os.path.join(args.profile, f"{name}.json")
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
        dst.write(src.read())
    os.remove(trace)


def _plan_line(model: nn.Module, args: argparse.Namespace) -> str:
    from fsdp_offload_cfg.budget import describe, planned

    planner = planned(model)
    return describe(planner.plan, planner.shape, planner.rates_source()) if planner else "(not planned)"


def _one_rank_group(device: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device).index or 0)  # "cuda" names no index
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=0, world_size=1)


def run_row(args: argparse.Namespace, method: str, ac: bool) -> Row:
    """One row, in a fresh process unless --same-process; a row that fails says why, not the table."""
    if args.same_process:
        return run(args, method, ac)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        try:
            return pool.apply(run, (args, method, ac))
        except Exception as error:  # noqa: BLE001 - the table reports it in the row
            return Row(method, ac, 0, 0, {}, 0, 0, float("nan"), error=f"{type(error).__name__}: {error}")


def row_done(row: Row, seconds: float) -> str:
    """A row's figures the moment it ends, on stderr: the table comes once every row has run, and a
    run stopped by a time limit (a 3B model at 32k tokens outran a GPU call's 330 s with five rows)
    would otherwise leave nothing of the rows it finished."""
    head = f"[row done in {seconds:.0f} s] {row.method}, AC {'yes' if row.ac else 'no'}:"
    if row.error:
        return f"{head} not run: {row.error[:200]}"
    return (f"{head} peak {row.peak / MIB:.1f} MiB, reserved {row.reserved / MIB:.1f} MiB, {row.retries} retries, "
            f"step {row.step_s * 1e3:.0f} ms, loss {row.loss:.4f}")


def copy_bandwidth(args: argparse.Namespace) -> float:
    from fsdp_offload_cfg.estimate.rates import measure_rates

    return measure_rates(torch.device(args.device), getattr(torch, args.dtype), args.hidden, args.batch * args.seq)[1]


def table(rows: list[Row], cuda: bool, bandwidth: float, tokens: int) -> str:
    what = "peak device MiB" if cuda else "peak saved-on-device MiB (CPU proxy)"
    on_cuda = " reserved MiB | retries | fwd+bwd MiB | x none | less grads MiB | x none |" if cuda else ""
    lines = [
        f"| method | AC | {what} |{on_cuda} activations MiB | x none | step ms | x none | tokens/s | out MiB/step | in MiB/step "
        "| copy bound ms | x bound | loss |",
        "|---|---|---:|" + ("---:|---:|---:|---:|---:|---:|" if cuda else "") + "---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {r.ac: r for r in rows if r.method == "none" and not r.error}
    for r in rows:
        if r.error:
            lines.append(f"| {r.method} | {'yes' if r.ac else 'no'} | not run: {r.error[:120]} |||||||||||{'||||||' if cuda else ''}")
            continue
        b = base.get(r.ac)
        moved = r.moved_out > 0
        bound = _copy_bound(b, r, bandwidth) if b and moved and not r.method.startswith("budget") else None
        cuda_cells = (f" {r.reserved / MIB:.1f} | {r.retries} | {r.fwd_bwd / MIB:.1f} | {_ratio(r.fwd_bwd, b.fwd_bwd if b else 0)} |"
                      f" {r.less_grads / MIB:.1f} | {_ratio(r.less_grads, b.less_grads if b else 0, digits=3)} |" if cuda else "")
        lines.append(
            f"| {r.method} | {'yes' if r.ac else 'no'} | {r.peak / MIB:.1f} |{cuda_cells}"
            f" {r.activations / MIB:.1f} | "
            f"{_ratio(r.activations, b.activations if b else 0)} | {r.step_s * 1e3:.0f} | "
            f"{_ratio(r.step_s, b.step_s if b else 0)} | {tokens / r.step_s:.0f} | {_mib(r.moved_out, moved)} | {_mib(r.moved_in, moved)} | "
            f"{f'{bound * 1e3:.0f}' if bound else '-'} | {f'{r.step_s / bound:.2f}' if bound else '-'} | {r.loss:.4f} |"
        )
    return "\n".join(lines)


def _copy_bound(none: Row, row: Row, bandwidth: float) -> float:
    return (max(none.phases["forward"], row.moved_out / bandwidth) + max(none.phases["backward"], row.moved_in / bandwidth)
            + none.phases["optimizer"])


def _ratio(value: float, base: float, digits: int = 2) -> str:
    return f"{value / base:.{digits}f}" if base else "-"


def _mib(value: int, counted: bool) -> str:
    return f"{value / MIB:.1f}" if counted else "-"


def methods(args: argparse.Namespace, ac: bool) -> list[str]:
    """The rows to run: TRL's only where it can run (installed; its streams need CUDA), the budgets
    only without checkpointing (their plan decides it)."""
    chosen = [m for m in args.methods if m != "trl" or (_trl_importable() and args.device.startswith("cuda"))]
    return chosen + ([] if ac else [f"budget={b}" for b in args.budget])


def _trl_importable() -> bool:
    try:
        import trl.models.activation_offloading  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or not importable with this transformers
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=0, help="MLP width (default: 8/3 of hidden, rounded to 64)")
    p.add_argument("--heads", type=int, default=0, help="attention heads (default: hidden / 64)")
    p.add_argument("--kv-heads", type=int, default=0, help="key/value heads (default: hidden / 128)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="model dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS,
                   help="the fixed methods (none: only the --budget rows)")
    p.add_argument("--budget", nargs="*", default=[], metavar="SIZE",
                   help="add a row per activation_memory_budget (such as 6GiB), without checkpointing")
    p.add_argument("--ac", nargs="+", default=["no", "yes"], choices=["no", "yes"])
    p.add_argument("--fsdp2", action="store_true", help="fully_shard layers and root in a one-rank group first")
    p.add_argument("--same-process", action="store_true", help="run every row in this process")
    p.add_argument("--profile", metavar="DIR", help="profile one more step per row into DIR (op table, Chrome trace)")
    p.add_argument("--device-memory", metavar="SIZE",
                   help="CUDA: cap the allocator at SIZE (such as 9GiB), as a smaller GPU would")
    p.add_argument("--expandable-segments", action="store_true",
                   help="CUDA: each row's allocator makes expandable segments, set in-process as patch() sets it "
                        "with the offload on (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True sets it per variable)")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.device_memory:  # parsed as `fsdp-offload-cfg estimate --device-memory` parses it
        if not args.device.startswith("cuda"):
            p.error("--device-memory caps a CUDA device's allocator: use it with --device cuda")
        try:
            args.device_memory = parse_size(args.device_memory)
        except EstimateError as error:
            p.error(str(error))
    bandwidth = copy_bandwidth(args)
    rows = []
    for ac in args.ac:
        for method in methods(args, ac == "yes"):
            start = time.perf_counter()
            rows.append(run_row(args, method, ac == "yes"))
            print(row_done(rows[-1], time.perf_counter() - start), file=sys.stderr, flush=True)
    print(f"Llama {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, {args.dtype}, "
          f"{args.steps} steps, device {_device_name(args.device)}, torch {torch.__version__}"
          f"{', FSDP2 (one rank)' if args.fsdp2 else ''}"
          f"{f', allocator capped at {show_size(args.device_memory)}' if args.device_memory else ''}"
          f"{', expandable segments' if args.expandable_segments else ''}; "
          f"copies measured at {bandwidth / 1e9:.1f} GB/s (the slower direction)\n")
    print(table(rows, args.device.startswith("cuda"), bandwidth, args.batch * args.seq))
    for r in rows:
        if r.plan:
            print(f"\n{r.method}: {r.plan}")


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else device


if __name__ == "__main__":
    main()
