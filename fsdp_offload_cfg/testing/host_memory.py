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


def _kib_field_bytes(path: str, field: str) -> int:
    """A "Field:  N kB" line of a /proc file, in bytes."""
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path(path).read_text(), re.MULTILINE).group(1)) * 1024


def meminfo_bytes(field: str) -> int:
    """One field of /proc/meminfo (`MemAvailable`, `MemTotal`), in bytes."""
    return _kib_field_bytes("/proc/meminfo", field)


def status_bytes(field: str, pid: int | str = "self") -> int:
    """One field of a process's /proc status (`RssAnon`, `VmRSS`, `VmHWM`), in bytes."""
    return _kib_field_bytes(f"/proc/{pid}/status", field)


def _stat_fields(pid_dir: Path) -> list[str]:
    """/proc/PID/stat after the command name (which may hold spaces): state, ppid, pgrp, ..."""
    return (pid_dir / "stat").read_text().rsplit(")", 1)[1].split()


def descendants(root: int) -> list[int]:
    """Every live process below `root`, by parent links. Not by session or process group:
    torchrun starts each rank in a session of its own (`start_new_session=True`), so a kill of
    the launcher's group would leave the ranks running, holding their memory."""
    children: dict[int, list[int]] = {}
    for pid_dir in Path("/proc").glob("[0-9]*"):
        try:
            children.setdefault(int(_stat_fields(pid_dir)[1]), []).append(int(pid_dir.name))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def anon_bytes(pids: list[int]) -> list[int]:
    """RssAnon of each of `pids` still alive."""
    sizes = []
    for pid in pids:
        try:
            sizes.append(status_bytes("RssAnon", pid))
        except (OSError, AttributeError):  # gone meanwhile, or a kernel thread
            continue
    return sizes


def kill_tree(root: int) -> None:
    """SIGKILL `root` and everything below it: the tree is listed first (a rank whose launcher
    is gone is reparented and can no longer be found from it), the launcher killed next (it can
    start nothing more), then the rest."""
    below = descendants(root)
    for pid in [root, *below]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_guarded(cmd: list[str], env: dict[str, str], log: Path, timeout: float, min_available: int,
                available: Callable[[], int] = lambda: meminfo_bytes("MemAvailable")) -> str | None:  # fmt: skip
    """Run `cmd` (output to `log`) and wait for it; stop it and every process it started (a
    launcher's ranks) when `available()` bytes fall under `min_available`, or after `timeout`
    seconds. Returns why it was stopped; None when it ended by itself."""
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
    start, why = time.monotonic(), None
    while proc.poll() is None:
        free, elapsed = available(), time.monotonic() - start
        if free < min_available:
            held = anon_bytes(descendants(proc.pid))
            why = (f"does not fit: stopped after {elapsed:.0f} s, the host's available memory down to "
                   f"{free / GIB:.1f} GiB of {meminfo_bytes('MemTotal') / GIB:.0f}; the ranks held "
                   f"{sum(held) / GIB:.1f} GiB (largest {max(held, default=0) / GIB:.1f} GiB)")  # fmt: skip
        elif elapsed > timeout:
            why = f"stopped after {timeout:.0f} s (hung?)"
        if why:
            kill_tree(proc.pid)
            proc.wait()
            return why
        time.sleep(0.1)
    return None
