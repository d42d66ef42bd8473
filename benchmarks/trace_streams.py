"""Where a profiled step's time goes, per CUDA stream, from the Chrome traces that
`activation_offload.py --profile DIR` writes (`DIR/<row>.json.gz`).

Prints, for each trace: the step's GPU span; per stream its busy time, its first and last activity
and its idle gaps over `--gap` ms (a copy stream that idles is waiting on something); and the
compute stream's stalls, each with what the other streams were doing then. For why an FSDP2
offload row sits above its copy bound while the one-process row does not: compare the two.

    python benchmarks/trace_streams.py gpu_out/profile/ours-async-noac.json.gz \
        gpu_out/profile/ours-async-noac-fsdp2.json.gz
"""

from __future__ import annotations

import argparse
import collections
import gzip
import itertools
import json
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_events(path: str) -> list[dict[str, Any]]:
    with gzip.open(path) as f:
        trace = json.load(f)
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]


def gaps(events: list[dict[str, Any]], over_us: float) -> list[tuple[float, float]]:
    """(start, length) of each idle stretch longer than `over_us` between consecutive events."""
    events = sorted(events, key=lambda e: e["ts"])
    return [(a["ts"] + a["dur"], b["ts"] - a["ts"] - a["dur"]) for a, b in itertools.pairwise(events)
            if b["ts"] - a["ts"] - a["dur"] > over_us]


def kind(event: dict[str, Any]) -> str:
    """What an event is: a kernel, or a copy's or memset's kind ("Memcpy HtoD" of "Memcpy HtoD
    (Pinned -> Device)")."""
    return "kernel" if event["cat"] == "kernel" else event["name"].split(" (")[0]


def busy_in(events: list[dict[str, Any]], start: float, end: float) -> float:
    """Microseconds of `events` inside [start, end)."""
    return sum(max(0.0, min(e["ts"] + e["dur"], end) - max(e["ts"], start)) for e in events)


def report(path: str, gap_ms: float) -> None:
    events = gpu_events(path)
    t0 = min(e["ts"] for e in events)
    span = max(e["ts"] + e["dur"] for e in events) - t0
    streams: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for e in events:
        streams[e["args"].get("stream", -1)].append(e)
    # the compute stream runs the most kernels
    compute = max(streams, key=lambda s: sum(e["cat"] == "kernel" for e in streams[s]))
    print(f"## {path}\n\nGPU span {span / 1e3:.1f} ms; compute stream {compute}\n")
    print(f"| stream | kinds | busy ms | first ms | last ms | gaps over {gap_ms:g} ms (at ms: length) |")
    print("|---:|---|---:|---:|---:|---|")
    for s, es in sorted(streams.items()):
        kinds = ", ".join(f"{k} {n}" for k, n in collections.Counter(map(kind, es)).most_common(3))
        first, last = min(e["ts"] for e in es) - t0, max(e["ts"] + e["dur"] for e in es) - t0
        idle = ", ".join(f"{(a - t0) / 1e3:.0f}: {g / 1e3:.1f}" for a, g in gaps(es, gap_ms * 1e3)[:12])
        print(f"| {s} | {kinds} | {sum(e['dur'] for e in es) / 1e3:.1f} | {first / 1e3:.1f} | {last / 1e3:.1f} | {idle} |")
    print(f"\nCompute stalls (over {gap_ms:g} ms), and what each other stream did meanwhile (busy ms):\n")
    for start, length in gaps([e for e in streams[compute] if e["cat"] == "kernel"], gap_ms * 1e3):
        others = ", ".join(f"stream {s} {busy_in(es, start, start + length) / 1e3:.1f}"
                           for s, es in sorted(streams.items()) if s != compute)
        print(f"- at {(start - t0) / 1e3:.1f} ms for {length / 1e3:.1f} ms: {others}")
    print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="Chrome traces (.json.gz) from activation_offload.py --profile")
    p.add_argument("--gap", type=float, default=1.0, help="smallest idle stretch reported, in ms (default 1)")
    args = p.parse_args()
    for path in args.traces:
        report(path, args.gap)


if __name__ == "__main__":
    main()
