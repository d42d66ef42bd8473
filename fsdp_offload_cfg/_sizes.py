"""Sizes as people write them: bytes as an integer, or a number with a unit (12GiB, 80GB, 512MiB).

One reader for every place that takes a size (the `activation_memory_budget` key, the
estimate's `--activation-budget` and `--device-memory`), so that they accept the same spellings.
"""

from __future__ import annotations

import re

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# No device or host this plugin plans for has a petabyte: a size above it is a typo (1.0e+30),
# refused rather than logged as "931322574615478534144.00 GiB".
LARGEST = 2**50
# the JSON Schema pattern of a size string (the schema is case-sensitive: units spelled both ways);
# an exponent is allowed as YAML allows it in a number, so `1.5e9` means the same quoted or not
PATTERN = r"^ *[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)? *([KkMmGgTt][Ii]?)?[Bb]? *$"
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def size_in_bytes(value: int | float | str) -> int | None:
    """Bytes (1 to LARGEST) for a number or a size string; None for anything else. A number and
    the same number quoted read alike (YAML gives `1.0e+30` as a float, `"1e30"` as a string)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        nbytes = float(value)
    else:
        match = _SIZE.fullmatch(str(value))
        if match is None or match.group(2).lower() not in UNITS:
            return None
        nbytes = float(match.group(1)) * UNITS[match.group(2).lower()]
    return int(nbytes) if 1 <= nbytes <= LARGEST else None


def show_size(nbytes: int) -> str:
    """Bytes in the largest binary unit that keeps the figure at 1 or more: 1 KiB reads "1.0 KiB",
    not "0.0 MiB", and a 3.2 MiB pool is not "0.00 GiB"."""
    for unit, scale, digits in (("TiB", 2**40, 2), ("GiB", 2**30, 2), ("MiB", 2**20, 1), ("KiB", 2**10, 1)):
        if nbytes >= scale:
            return f"{nbytes / scale:.{digits}f} {unit}"
    return f"{nbytes} B"
