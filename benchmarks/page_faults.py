"""What filling fresh shard memory from the page cache costs: page faults, not copying.

Reads `--mib` MiB of a file (already in the page cache: it is read once first) with `os.preadv`
into a tensor, four ways, each `--repeat` times in this one process, and prints the median
time and GiB/s per way:

  new pages        a fresh `torch.empty`: every 4 KiB page faults on first write (what both
                   load strategies do when they fill newly allocated shards);
  touched pages    the same tensor again: no faults, the copy alone;
  populate first   `madvise(MADV_POPULATE_WRITE)` on a fresh tensor, then read (Linux >= 5.14);
  huge pages       `madvise(MADV_HUGEPAGE)` on a fresh tensor, then read (transparent huge pages
                   in "madvise" mode); the first repeat is shown apart, it pays for the first
                   huge allocation of the process.

and, for the way transformers' own FSDP2 load keeps its shards (views of a private mapping of the
file, `UntypedStorage.from_file(shared=False)` as safetensors maps it), two more, each on a new
mapping: `mapped, first read` (one byte of every page read: the page cache's pages mapped, nothing
copied) and `mapped, first write` (one byte of every page written: each page copied out of the
file, copy on write; what the first optimizer step pays there). Below the table: the host's
transparent-huge-page setting, the huge pages the process got, and whether it runs under a
hypervisor, which set what a fault costs.

    python benchmarks/page_faults.py --file /tmp/bench/llama-300m-fp32/model.safetensors
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import torch

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
PAGE = 4096
HUGE = 2 * 2**20
_libc = ctypes.CDLL(None, use_errno=True)


def _madvise(t: torch.Tensor, advice: int, align: int) -> None:
    start = (t.data_ptr() + align - 1) // align * align
    end = (t.data_ptr() + t.numel()) // align * align
    if end > start and _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice) != 0:
        raise OSError(ctypes.get_errno(), f"madvise({advice}) failed")


def _read(fd: int, t: torch.Tensor) -> float:
    view = memoryview(t.numpy())
    start = time.perf_counter()
    done, chunk = 0, 32 * 2**20
    while done < len(view):
        done += os.preadv(fd, [view[done : done + chunk]], done)
    return time.perf_counter() - start


def _fresh(nbytes: int, advice: int | None, align: int) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    t = torch.empty(nbytes, dtype=torch.uint8)
    if advice is not None:
        _madvise(t, advice, align)
    return t, time.perf_counter() - start


def _mapped(path: str, nbytes: int, write: bool) -> float:
    """Map `path` privately, then read (or write) one byte of each page of its first `nbytes`."""
    start = time.perf_counter()
    storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=os.path.getsize(path))
    pages = torch.empty(0, dtype=torch.uint8).set_(storage)[:nbytes][::PAGE]
    if write:
        pages.add_(0)
    else:
        pages.sum()
    return time.perf_counter() - start


def _anon_huge_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next((int(line.split()[1]) for line in f if line.startswith("AnonHugePages")), 0)


def _machine(huge_kb: int) -> str:
    def first(path: str) -> str:
        try:
            with open(path) as f:
                return f.readline().strip()
        except OSError:
            return "unknown"

    with open("/proc/cpuinfo") as f:
        hypervisor = any(line.startswith("flags") and " hypervisor" in line for line in f)
    return (f"transparent huge pages: {first('/sys/kernel/mm/transparent_hugepage/enabled')}; "
            f"huge pages the `huge pages` tensor got: {huge_kb // 1024} MiB; "
            f"{'under a hypervisor (first touch of a page may fault in the host too)' if hypervisor else 'bare metal'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", required=True, help="a file of at least --mib MiB (e.g. a checkpoint)")
    parser.add_argument("--mib", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    nbytes = args.mib * 2**20
    if os.path.getsize(args.file) < nbytes:
        raise SystemExit(f"{args.file} is smaller than {args.mib} MiB")
    fd = os.open(args.file, os.O_RDONLY)
    _read(fd, torch.empty(nbytes, dtype=torch.uint8))  # into the page cache

    times: dict[str, list[float]] = {}
    touched = torch.empty(nbytes, dtype=torch.uint8)
    huge_kb = 0
    _read(fd, touched)
    for _ in range(args.repeat):
        t, setup = _fresh(nbytes, None, PAGE)
        times.setdefault("new pages", []).append(setup + _read(fd, t))
        times.setdefault("touched pages", []).append(_read(fd, touched))
        t, setup = _fresh(nbytes, MADV_POPULATE_WRITE, PAGE)
        times.setdefault("populate first", []).append(setup + _read(fd, t))
        t, setup = _fresh(nbytes, MADV_HUGEPAGE, HUGE)
        times.setdefault("huge pages", []).append(setup + _read(fd, t))
        huge_kb = max(huge_kb, _anon_huge_kb())
        del t
        times.setdefault("mapped, first read", []).append(_mapped(args.file, nbytes, write=False))
        times.setdefault("mapped, first write", []).append(_mapped(args.file, nbytes, write=True))
    os.close(fd)
    first_huge = times["huge pages"].pop(0)

    print(f"preadv of {args.mib} MiB from the page cache, median of {args.repeat} (huge pages: of the later ones)\n")
    print("| way | seconds | GiB/s | vs new pages |")
    print("|---|---|---|---|")
    base = statistics.median(times["new pages"])
    for way, values in times.items():
        median = statistics.median(values)
        print(f"| {way} | {median:.3f} | {nbytes / 2**30 / median:.1f} | {median / base:.2f}x |")
    print(f"| huge pages, first allocation of the process | {first_huge:.3f} | {nbytes / 2**30 / first_huge:.1f} "
          f"| {first_huge / base:.2f}x |")  # fmt: skip
    print(f"\n{_machine(huge_kb)}")


if __name__ == "__main__":
    main()
