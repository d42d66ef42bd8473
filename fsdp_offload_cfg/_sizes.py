"""Sizes as people write them: bytes as an integer, or a number with a unit (12GiB, 80GB, 512MiB).

One reader for every place that takes a size (the `activation_memory_budget` key, the
estimate's `--activation-budget` and `--device-memory`), so that they accept the same spellings;
and the `auto` forms of a budget (`auto`, `auto-2GiB`, `auto-5%`), read alike by the config and
the estimate's command line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# No device or host this plugin plans for has a petabyte: a size above it is a typo (1.0e+30),
# refused rather than logged as "931322574615478534144.00 GiB".
LARGEST = 2**50
# the JSON Schema pattern of a size string (the schema is case-sensitive: units spelled both ways);
# an exponent is allowed as YAML allows it in a number, so `1.5e9` means the same quoted or not
SIZE_BODY = r"[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)? *([KkMmGgTt][Ii]?)?[Bb]?"
PATTERN = rf"^ *{SIZE_BODY} *$"
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


# `auto`, `auto-2GiB` (a margin in bytes), `auto-5%` (a margin in percent of the device); the JSON
# Schema pattern is case-sensitive, as the reader below is
AUTO_PATTERN = rf"^ *auto *(- *([0-9]+(\.[0-9]+)? *%|{SIZE_BODY}) *)?$"
_AUTO = re.compile(r"\s*auto\s*(?:-\s*(?:(?P<percent>[0-9]+(?:\.[0-9]+)?)\s*%|(?P<size>.+?)))?\s*")
# `auto` alone keeps a tenth of the device free: the allocator's blocks are rounded and split, so
# what it reserves runs above what is allocated, and the plan's activation figures are estimates
DEFAULT_MARGIN_FRACTION = 0.10


@dataclass(frozen=True)
class AutoBudget:
    """`activation_memory_budget: auto[-margin]`: the budget is the device's memory less what the
    step holds besides activations, less a margin, worked out at the first training forward
    (`estimate/room.py`)."""

    margin_bytes: int | None  # a margin stated in bytes (`auto-2GiB`)
    margin_fraction: float  # else this fraction of the device (`auto-5%`; `auto`: the default)
    device_bytes: int | None = None  # `activation_budget_device_memory`: None = the device's own total

    def margin(self, device_bytes: int) -> int:
        return self.margin_bytes if self.margin_bytes is not None else int(device_bytes * self.margin_fraction)

    def shown(self) -> str:
        """The margin as written (`2.00 GiB`, `10%`), for log lines and errors."""
        return show_size(self.margin_bytes) if self.margin_bytes is not None else f"{self.margin_fraction * 100:g}%"


def parse_auto(value: object) -> AutoBudget | None:
    """The `auto` forms of a budget; None for anything else (a size, or a typo the rules name).
    A margin of 100% or more would leave nothing, so it is not an `auto` form either."""
    match = _AUTO.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        return None
    if match.group("percent") is not None:
        fraction = float(match.group("percent")) / 100
        return AutoBudget(None, fraction) if fraction < 1 else None
    if match.group("size") is not None:
        margin = size_in_bytes(match.group("size"))
        return None if margin is None else AutoBudget(margin, 0.0)
    return AutoBudget(None, DEFAULT_MARGIN_FRACTION)
