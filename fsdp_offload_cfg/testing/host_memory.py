"""A launch that stops itself before the host runs out of memory: a benchmark row that does not
fit then says so (with what its ranks held) instead of bringing the kernel's OOM killer onto the
machine, which on a lent GPU machine can take the whole session with it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

GIB = 2**30


def meminfo_bytes(field: str) -> int:
    """One field of /proc/meminfo (`MemAvailable`, `MemTotal`), in bytes."""
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE).group(1)) * 1024


def session_anon_bytes(session: int) -> list[int]:
    """RssAnon of each live process of `session` (a launch: torchrun and its ranks)."""
    sizes = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) == session:
                status = (stat.parent / "status").read_text()
                sizes.append(int(re.search(r"^RssAnon:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024)
        except (OSError, AttributeError, IndexError, ValueError):  # gone meanwhile, or a kernel thread
            continue
    return sizes


def run_guarded(cmd: list[str], env: dict[str, str], log: Path, timeout: float, min_available: int,
                available: Callable[[], int] = lambda: meminfo_bytes("MemAvailable")) -> str | None:  # fmt: skip
    """Run `cmd` (output to `log`) in a session of its own and wait for it; stop the whole session
    (every process of it: a launcher's ranks too) when `available()` bytes fall under
    `min_available`, or after `timeout` seconds. Returns why it was stopped; None when it ended
    by itself."""
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    start, why = time.monotonic(), None
    while proc.poll() is None:
        free, elapsed = available(), time.monotonic() - start
        if free < min_available:
            held = session_anon_bytes(proc.pid)
            why = (f"does not fit: stopped after {elapsed:.0f} s, the host's available memory down to "
                   f"{free / GIB:.1f} GiB of {meminfo_bytes('MemTotal') / GIB:.0f}; the ranks held "
                   f"{sum(held) / GIB:.1f} GiB (largest {max(held, default=0) / GIB:.1f} GiB)")  # fmt: skip
        elif elapsed > timeout:
            why = f"stopped after {timeout:.0f} s (hung?)"
        if why:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return why
        time.sleep(0.1)
    return None
