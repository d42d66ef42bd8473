"""Run a function on N real gloo ranks (no mocked process group) and collect what each returns.

Each rank is a fresh process with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set exactly as torchrun
would set them, and a gloo process group already initialised. A rank that raises reports its
traceback; a rank that hangs is killed after `timeout` seconds and the test fails naming it, so a
broken collective can never wedge the suite.

Warm start: ranks are forked from a forkserver that has imported torch, transformers and
accelerate once (`_WARM`), not spawned: a spawned rank spent about 4 s of CPU importing them,
and the suite starts hundreds of ranks on CI's 2 cores. A rank still gets what a spawned one
got: the parent's environment as it is at `run_workers` (the server's is the one it started
with), restored before the function and its arguments are unpickled, so the test module and the
package import under it. A forked rank runs no `atexit` handlers at its end, which is why the
tests of exit behaviour start real launchers (`test_launch.py`, `_real_runs.py`), never this.

A rank leaves the heap it inherits out of its garbage collections (`gc.freeze()`, first thing):
the forkserver's imports are about 380,000 objects, and every full collection in a rank walked
them all, 0.3 s each on this project's 2-core machine, a tenth of the ranks' time (79 full collections, 25 s of
242 s, in tests/test_final_model.py and tests/test_loading.py; 2.6 s frozen). Nothing a rank
makes is frozen: its own garbage is collected as before.

A rank that dies of a signal (a native crash: SIGSEGV, or SIGABRT from glibc's heap checks) prints
every thread's Python stack to its stderr first (`faulthandler`, which pytest turns on in its own
process only), so the failure names the Python line that was running, not just an exit code.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import random
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch.multiprocessing as mp

# ports `free_port` reserved, each by an exclusive lock on its file that lives as long as this
# process: a launcher given the port binds it seconds later, and the test that started it outlives it.
_RESERVED: dict[int, Any] = {}
# the machine's, not TMPDIR's: the suite gives each session a scratch TMPDIR (tests/conftest.py)
_LOCKS = f"/tmp/fsdp-offload-cfg-ports-{os.getuid()}"
# torchrun's rendezvous (29400) and master (29500) ports, the latter accelerate's too
_LAUNCHER_DEFAULTS = range(29400, 29501)


def free_port(candidates: Sequence[int] | None = None) -> int:
    """A port for a launcher that binds it itself (torchrun's `--master_port`, accelerate's
    `--main_process_port`, ms-swift's and LlamaFactory's `MASTER_PORT`), which nothing else takes
    before that launcher binds it, seconds later.

    The kernel's pick (`bind` to port 0) was not that: it comes from the ephemeral range, from
    which the kernel hands out the next socket's port too, and a port picked, freed and bound a
    few seconds later was taken in between in CI (EADDRINUSE, then a rank waiting out its
    timeout). So the port comes from outside that range, where the kernel never picks, is free
    now, and is reserved against this machine's other test processes (CI runs its legs side by
    side) by a lock on its file that the kernel drops when this process ends. `candidates`
    (default: every port from 10000 outside the ephemeral range and the launchers' defaults, which
    a launch given no port binds, in random order) is the order to try them in."""
    if candidates is None:
        low, high = _ephemeral_range()
        candidates = [p for p in range(10000, 65536) if not low <= p <= high and p not in _LAUNCHER_DEFAULTS]
        random.shuffle(candidates)
    os.makedirs(_LOCKS, exist_ok=True)
    for port in candidates:
        if port not in _RESERVED and _reserve(port) and _bindable(port):
            return port
    raise RuntimeError(f"no free port among {len(candidates)} outside the kernel's ephemeral range")


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel picks from; Linux's default where it does not say (another OS)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = f.read().split()
        return int(low), int(high)
    except OSError:
        return 32768, 60999


def _reserve(port: int) -> bool:
    import fcntl

    lock = open(os.path.join(_LOCKS, str(port)), "a")  # noqa: SIM115 - held until this process ends
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # another live test process holds it
        lock.close()
        return False
    _RESERVED[port] = lock
    return True


def _bindable(port: int) -> bool:
    """Free on every interface, as the launchers' stores bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


# imported once by the forkserver, before any rank forks from it; what nearly every rank imports.
# The last four were each rank's own until run 34 (docs/compatibility.md): the test module imports
# pytest, `patch()` validates with jsonschema, and a rank that builds a Trainer or an adapter
# imports transformers' `training_args` (which imports PEFT; `patch()` itself no longer does, its
# Trainer patch waits for that import: tests/test_patching.py checks that in a fresh interpreter,
# where nothing is preloaded): about 900 modules a rank, 11-14% of the CPU the ranks of
# test_budget.py, test_final_model.py, test_before_prepare.py and test_tied_groups.py took (run
# 35, when `patch()` still imported them all). Nothing that reads the
# environment at import for a test to set (datasets, TRL, the Trainer) is here.
_WARM = ["torch", "torch.distributed", "torch.distributed.fsdp", "transformers", "accelerate",
         "transformers.models.llama.modeling_llama",
         "pytest", "transformers.training_args", "peft", "jsonschema"]


def _worker(
    rank: int,
    world_size: int,
    port: Any,
    environ: dict[str, str],
    call: bytes,
    local_world_size: int,
    pg_timeout: float | None,
    rendezvous_timeout: float,
    connect_gap: float,
    queue: Any,
) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    gc.freeze()  # the server's imports: never garbage, walked by every full collection (docstring)
    os.environ.clear()
    os.environ.update(environ)  # the parent's at run_workers, as a spawned rank would inherit it
    store = None
    faulthandler.enable(all_threads=True)  # a native crash names its Python line (module docstring)
    try:
        fn, args, env = pickle.loads(call)  # imports the test module under that environment
        os.environ.update(env)
        # The store is made here, and the group made with the run's timeout, not the test's short
        # collective one: init_process_group's timeout also bounds the rendezvous and gloo's
        # full-mesh connect, and a short one (a test's 2 s) failed whenever the ranks started more
        # than that apart (spawned interpreters importing torch on a loaded machine). `pg_timeout`
        # is set on the group once it exists, so it bounds the collectives only.
        run_timeout = timedelta(seconds=rendezvous_timeout)
        store = _store(rank, world_size, port, run_timeout)
        os.environ.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank % local_world_size),
                "LOCAL_WORLD_SIZE": str(local_world_size),
                "GROUP_RANK": str(rank // local_world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port),
            }
        )
        time.sleep(connect_gap * rank)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=run_timeout)
        collective_timeout = dist.default_pg_timeout if pg_timeout is None else timedelta(seconds=pg_timeout)
        dist.distributed_c10d._set_pg_timeout(collective_timeout)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        if rank == 0 and store is None:
            port.value = -1  # no store will open: the others stop waiting for it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if store is not None:
            _leave(store, rank, world_size)
        if dist.is_initialized():
            dist.destroy_process_group()


def _store(rank: int, world_size: int, port: Any, timeout: Any) -> Any:
    """Rank 0's store binds a port the kernel picks, and the others learn it through `port` (a
    shared value the parent made, 0 until rank 0 has bound). A port picked free beforehand
    (the kernel's pick, as `free_port` made it then) and bound later was taken in between, once in CI:
    rank 0 failed with EADDRINUSE and rank 1 waited out its 300 s for a store that never opened."""
    import torch.distributed as dist

    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        with port.get_lock():
            port.value = store.port
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while port.value == 0:  # rank 0 still starting
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 opened no store within {timeout.total_seconds():.0f}s")
        time.sleep(0.01)
    if port.value < 0:
        raise RuntimeError("rank 0 failed before it opened the store (its own error is reported with it)")
    return dist.TCPStore("127.0.0.1", port.value, world_size, is_master=False, timeout=timeout)


def _leave(store: Any, rank: int, world_size: int) -> None:
    """Rank 0 hosts the store: it stays until every rank is done with it, as torchrun's agent
    does. Without this a rank 0 that finished (or failed) first closed the store under a rank
    still waiting on it, which then read "lost contact with rank 0" instead of its own error: a
    race a forked rank, which exits at once, lost often enough to fail a test. A rank that dies
    outright (`os._exit`) still takes the store with it, as a crashed rank 0 does under torchrun."""
    try:
        store.set(f"_dist/left/{rank}", "1")
        if rank == 0:
            store.wait([f"_dist/left/{r}" for r in range(world_size)])
    except Exception:  # noqa: BLE001 - a peer gone or the store timed out: nothing left to wait for
        pass


@contextmanager
def _cpu_only_children() -> Iterator[None]:
    """The ranks are gloo CPU ranks whatever this machine has: they start with no GPU visible,
    so that nothing in them (FSDP2's default mesh takes the accelerator when one is visible) puts
    tensors on a device gloo cannot serve. The forkserver imports torch with this environment
    (the first run starts it inside this context), and each rank restores it before anything else."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def run_workers(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
    local_world_size: int | None = None,
    expect_errors: bool = False,
    pg_timeout: float | None = None,
    start_gap: float = 0.0,
    connect_gap: float = 0.0,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return results by rank.

    `pg_timeout` (seconds) is the process group's collective timeout (gloo's default otherwise).
    `start_gap` (seconds) passes between starting one rank and the next, as on a loaded machine;
    `connect_gap` (seconds, times the rank) between a rank meeting the others at the store and
    joining the process group.

    With `expect_errors=True` a rank's traceback string is returned in its slot instead of
    failing the test (for failure-propagation tests); a hang still fails.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_WARM)
    queue = ctx.SimpleQueue()
    port = ctx.Value("i", 0)  # rank 0's store's, once it has bound one (`_store`)
    call = pickle.dumps((fn, args, dict(env or {})))
    with _cpu_only_children():  # the forkserver, started by the first run, keeps this environment too
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, dict(os.environ), call, local_world_size or world_size, pg_timeout,
                      timeout, connect_gap, queue),
                daemon=False,
            )
            for r in range(world_size)
        ]
        for r, p in enumerate(procs):
            time.sleep(start_gap if r else 0.0)
            p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world_size and time.monotonic() < deadline:
        if not queue.empty():
            rank, status, payload = queue.get()
            results[rank] = (status, payload)
            continue
        if all(not p.is_alive() for p in procs) and queue.empty():
            break
        time.sleep(0.05)
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()) if len(results) == world_size else 0)
        if p.is_alive():
            p.kill()
            p.join()
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise AssertionError(
            f"ranks {missing} did not report within {timeout:.0f}s (hung or crashed; exit codes "
            f"{[procs[r].exitcode for r in missing]}, a negative one the signal that ended the rank, whose "
            f"Python stacks are in the captured stderr); reported: "
            + "; ".join(f"rank {r}: {s}" for r, (s, _) in sorted(results.items()))
            + "".join(f"\n--- rank {r} ---\n{p}" for r, (s, p) in sorted(results.items()) if s == "error")
        )
    errors = {r: p for r, (s, p) in results.items() if s == "error"}
    if errors and not expect_errors:
        raise AssertionError("".join(f"\n--- rank {r} raised ---\n{tb}" for r, tb in sorted(errors.items())))
    return [results[r][1] for r in range(world_size)]
