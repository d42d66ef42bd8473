"""Sizes as people write them: bytes as an integer, or a number with a unit (12GiB, 80GB, 512MiB).

One reader for every place that takes a size (the `activation_memory_budget` key, the
estimate's `--activation-budget` and `--device-memory`), so that they accept the same spellings.
"""

from __future__ import annotations

import re

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# the JSON Schema pattern of a size string (the schema is case-sensitive: units spelled both ways)
PATTERN = r"^ *[0-9]+(\.[0-9]+)? *([KkMmGgTt][Ii]?)?[Bb]? *$"
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def size_in_bytes(value: int | str) -> int | None:
    """Bytes (> 0) for an integer or a size string; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    match = _SIZE.fullmatch(str(value))
    if match is None or match.group(2).lower() not in UNITS:
        return None
    nbytes = int(float(match.group(1)) * UNITS[match.group(2).lower()])
    return nbytes if nbytes > 0 else None


def show_size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"
