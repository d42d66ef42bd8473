"""Exit cleanly on gloo: let torch's gloo worker threads go idle before the interpreter finalizes.

The failure this prevents: a run in which every rank finished dies at exit with
`terminate called without an active exception` (SIGABRT, launcher rc 1), a few runs in a hundred,
with or without this plugin, whenever the process group is still up at exit. The mechanism
(backtraces taken on torch 2.13, CPython 3.11):

1. `ProcessGroupGloo` runs every collective on a worker thread (`pt_gloo_runloop`). The worker
   marks the work complete, the caller's `wait()` returns, and only *then* does the worker drop its
   own reference to the finished work.
2. Dropping a tensor that has a Python object (the collective's inputs and outputs) goes through
   `decref_pyobject`, which takes the GIL. The main thread holds the GIL while it runs Python, so
   the worker waits for it.
3. If the script ends first, the main thread carries the GIL into `Py_FinalizeEx`. A thread that
   asks for the GIL after finalization has started is ended with `pthread_exit`; its forced unwind
   meets the `noexcept` work destructor and the C++ runtime calls `std::terminate`.

Why not `destroy_process_group()` at exit (torch's own attempt, pytorch#179291, was abandoned):
it joins the workers only when nothing else holds the group, and FSDP2's `FSDPMeshInfo` always
does, so the race stays; and where it does join, a worker still inside a collective whose peer
failed makes that join block the exit until the process-group timeout (30 min on gloo). The first
was measured here: after `end_training()` in an FSDP2 run the workers are still alive.

What we do instead, at exit, while the interpreter is still whole: release the GIL and wait until
every gloo worker thread is idle. The check reads the kernel's per-thread counters: an idle worker
sleeps on its queue's condition variable and is never woken, while a worker that still has to drop
a finished work is runnable, or sleeps in CPython's GIL wait, which wakes up every switch interval.
So "all asleep, no context switch across a window in which the GIL was free" means idle. A worker
blocked inside a collective (a peer died) also looks idle: we never wait on a peer. The wait is
bounded; Linux only (elsewhere `/proc` is absent and the guard does nothing).
"""

from __future__ import annotations

import atexit
import os
import time

from fsdp_offload_cfg._logging import get_logger

logger = get_logger("fsdp_offload_cfg.clean_exit")

# c10d names ProcessGroupGloo's worker threads so (`c10::setThreadName` in `runLoop`).
GLOO_WORKER_THREAD_NAME = "pt_gloo_runloop"
# Long enough for a woken thread to take the free GIL, drop its work and go back to sleep, and
# longer than CPython's default 5 ms GIL switch interval, at which a GIL waiter wakes again.
QUIET_WINDOW_S = 0.02
# A worker that is still busy after this is not waiting for us; exit rather than hang.
MAX_WAIT_S = 10.0

_TASKS = "/proc/self/task"
_installed = False  # one atexit registration per process, whatever the number of patch() calls


def install() -> None:
    """Register the exit wait once per process. Idempotent; never removed (it only delays exit)."""
    global _installed
    if not _installed:
        atexit.register(wait_for_idle_gloo_workers)
        _installed = True


def wait_for_idle_gloo_workers(max_wait: float = MAX_WAIT_S, window: float = QUIET_WINDOW_S) -> bool:
    """Block, GIL released, until no gloo worker thread of this process is still finishing work.

    Returns True when they are idle (or there are none), False when `max_wait` ran out first.
    """
    deadline = time.monotonic() + max_wait
    before = _worker_activity()
    while before:
        time.sleep(window)  # the GIL is free: a worker waiting to drop a finished work takes it now
        after = _worker_activity()
        if after == before and all(state == "S" for state, _ in after.values()):
            return True
        if time.monotonic() >= deadline:
            logger.warning(
                "gloo worker threads still busy %.0fs after the script ended (%s); exiting anyway, the "
                "process may abort at exit", max_wait, after,
            )
            return False
        before = after
    return True


def _worker_activity() -> dict[str, tuple[str, int]]:
    """`{thread id: (scheduler state letter, context switches so far)}` for every gloo worker."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return {}
    activity = {}
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                if f.read().strip() != GLOO_WORKER_THREAD_NAME:
                    continue
            with open(f"{_TASKS}/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # the thread ended between listdir and open
            continue
        switches = int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])
        activity[tid] = (fields["State"].strip()[:1], switches)
    return activity
