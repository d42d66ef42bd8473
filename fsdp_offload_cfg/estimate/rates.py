"""The two rates a budget's plan is made at, measured on the device the run trains on.

`plan.default_time_model` states what an H100 and a few CPU cores ran at; a run knows better: its
own device, its own dtype, its own layer width, and how fast its host takes pinned copies (a PCIe
Gen4 node moves half what an H100 SXM node does; a busy NUMA node less). So at the first training
forward each rank times, once, in well under a second:

- compute: a matmul shaped like the layer's own (the batch's tokens, up to 4096, by the hidden
  size, times a hidden x hidden weight) in the compute dtype; its FLOP/s stands for the layer's
  (attention and elementwise kernels run slower than a matmul, so a layer's compute is, if
  anything, estimated short, and a copy it must hide looks harder to hide: the plan errs towards
  recompute, never towards a copy that stalls);
- copies: 32 MiB to the host and back the way the offload copies them (pinned host memory on
  CUDA), the slower direction.

The ranks plan with the slowest rank's rates (`budget.BudgetPlanner.agreed_rates`), so they agree on one plan:
the step waits for the slowest rank anyway. A config that states both rates
(`activation_budget_compute_tflops`, `activation_budget_copy_gb_per_s`) skips the probe and gets
the same plan on every run, which a measured rate does not promise.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

_COPY_BYTES = 32 << 20  # large enough that a copy's fixed cost is noise, small enough to take milliseconds
_MIN_SECONDS = 0.02  # each timing repeats its kernel until at least this long: a timer's resolution is noise
_MAX_TOKENS = 4096  # a longer batch's matmul runs at the same rate; the probe need not take longer


def measure_rates(device: torch.device, dtype: torch.dtype, hidden: int, tokens: int) -> tuple[float, float]:
    """(FLOP/s of a layer-shaped matmul, bytes/s of the slower copy direction) on `device`."""
    return _matmul_flops(device, dtype, hidden, min(max(tokens, 1), _MAX_TOKENS)), _copy_bytes_per_second(device)


def _matmul_flops(device: torch.device, dtype: torch.dtype, hidden: int, tokens: int) -> float:
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w = torch.randn(hidden, hidden, device=device).to(dtype)
    torch.mm(x, w)  # warm up: the first call picks the kernel
    seconds, calls = _repeat(device, lambda: torch.mm(x, w))
    return 2.0 * tokens * hidden * hidden * calls / seconds


def _copy_bytes_per_second(device: torch.device) -> float:
    src = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=device)
    host = torch.empty(_COPY_BYTES, dtype=torch.uint8, pin_memory=device.type == "cuda")
    host.copy_(src)  # warm up both ways: the first touch of a buffer pays its page faults, not the copy
    src.copy_(host)
    rates = []
    for copy in (lambda: host.copy_(src, non_blocking=True), lambda: src.copy_(host, non_blocking=True)):
        seconds, calls = _repeat(device, copy)
        rates.append(_COPY_BYTES * calls / seconds)
    return min(rates)


def _repeat(device: torch.device, fn: Callable[[], object]) -> tuple[float, int]:
    """(seconds, calls) of calling `fn` in rounds of doubling size until a round lasts long enough."""
    calls = 1
    while True:
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        seconds = time.perf_counter() - start
        if seconds >= _MIN_SECONDS or calls >= 1 << 12:
            return max(seconds, 1e-9), calls
        calls *= 2


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
