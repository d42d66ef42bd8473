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
    _read(fd, touched)
    for _ in range(args.repeat):
        t, setup = _fresh(nbytes, None, PAGE)
        times.setdefault("new pages", []).append(setup + _read(fd, t))
        times.setdefault("touched pages", []).append(_read(fd, touched))
        t, setup = _fresh(nbytes, MADV_POPULATE_WRITE, PAGE)
        times.setdefault("populate first", []).append(setup + _read(fd, t))
        t, setup = _fresh(nbytes, MADV_HUGEPAGE, HUGE)
        times.setdefault("huge pages", []).append(setup + _read(fd, t))
        del t
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


if __name__ == "__main__":
    main()
