"""Where a test suite's CPU goes: the machine's busy CPU-seconds per test and per file, beside wall time.

Usage: python benchmarks/suite_cpu.py [--top N] [--json FILE] [pytest arguments...]
       (on an otherwise idle machine; e.g. `python benchmarks/suite_cpu.py -q -p no:cacheprovider`)

Why the machine's busy CPU (`/proc/stat`), not pytest's `--durations`: CI runs two lanes of legs
on 2 cores and is CPU-bound while both run (`.ci/run`), so what a test costs CI is the CPU it
takes, about half of which comes back as the run's length. Wall time says little about that: a
2-rank test keeps both cores busy, a launch adds a launcher's interpreter, a test waiting on a
timeout takes none. Nor the process's own rusage: a gloo rank is a child of the harness's
forkserver, which pytest never waits for, so its CPU is never added to pytest's children. The
machine's count sees every process, which is also why it needs the machine to itself: whatever
else ran in a test's time is counted as the test's.

A row is a test's setup, call and teardown together: a module-scoped fixture (one launch shared
by the file's tests) is counted in the first test that asks for it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

OUT_VAR = "SUITE_CPU_OUT"  # where the plugin, in pytest's process, writes its rows
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")  # /proc/stat counts in these
_rows: list[tuple[str, float, float]] = []  # (node id, busy CPU-s, wall s), in the order the tests ran


def busy_cpu_seconds() -> float:
    """CPU-seconds every core of the machine has spent busy since boot: `/proc/stat`'s `cpu` line,
    user, nice, system, irq and softirq (guest time is inside user; idle, iowait and a VM's steal,
    time its host gave to others, are not this machine's work)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / _TICKS_PER_S


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    busy, start = busy_cpu_seconds(), time.monotonic()
    yield
    _rows.append((item.nodeid, busy_cpu_seconds() - busy, time.monotonic() - start))


def pytest_sessionfinish(session: pytest.Session) -> None:
    if os.environ.get(OUT_VAR):
        Path(os.environ[OUT_VAR]).write_text(json.dumps(_rows))


def table(rows: list[tuple[str, float, float]], top: int) -> str:
    """Per file, most CPU first, then the `top` tests that took the most."""
    files: dict[str, list[tuple[float, float]]] = defaultdict(list)  # file -> its tests' (CPU-s, wall s)
    for node, cpu, wall in rows:
        files[node.split("::")[0]].append((cpu, wall))
    totals = {name: (sum(c for c, _ in tests), sum(w for _, w in tests), len(tests)) for name, tests in files.items()}
    cpu_all, wall_all = sum(r[1] for r in rows), sum(r[2] for r in rows)
    lines = [f"{len(rows)} tests: {cpu_all:.1f} busy CPU-s in {wall_all:.1f} s of wall time", "",
             "| file | busy CPU-s | share | wall s | CPU / wall | tests |", "|---|---|---|---|---|---|"]
    for name, (cpu, wall, count) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        share = f"{cpu / cpu_all:.0%}" if cpu_all else "-"
        ratio = f"{cpu / wall:.2f}" if wall else "-"
        lines.append(f"| {name} | {cpu:.1f} | {share} | {wall:.1f} | {ratio} | {count} |")
    lines += ["", "| test | busy CPU-s | wall s |", "|---|---|---|"]
    lines += [f"| {node} | {cpu:.1f} | {wall:.1f} |" for node, cpu, wall in sorted(rows, key=lambda r: -r[1])[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--top", type=int, default=30, help="how many of the costliest tests to list")
    parser.add_argument("--json", metavar="FILE", help="also write every row, [node id, CPU-s, wall s], to FILE")
    args, pytest_args = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(args.json or Path(scratch) / "rows.json")
        env = dict(os.environ, **{OUT_VAR: str(out)})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
        rc = subprocess.call([sys.executable, "-m", "pytest", "-p", Path(__file__).stem, *pytest_args], env=env)
        rows = [tuple(row) for row in json.loads(out.read_text())] if out.exists() else []
        if not rows:
            print(f"pytest exited {rc} before any test ran: no table", file=sys.stderr)
            return rc or 1
        print("\n" + table(rows, args.top))
    return rc


if __name__ == "__main__":
    sys.exit(main())
