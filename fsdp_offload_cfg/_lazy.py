"""Package attributes imported on first use (PEP 562).

`import fsdp_offload_cfg` happens in places that must stay light: the CLI's `validate`, `schema`
and `--help` (a torch import costs about 3 s a start), and the autopatch `.pth` line of every
Python process. A package's `__init__` names what it exports and where it lives; the module is
imported when the name is first read, and the value is cached in the package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, namespace: dict[str, Any],
                 exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`: `exports` maps a name to the module that defines it."""

    def get(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    def listing() -> list[str]:
        return sorted({*namespace, *exports})

    return get, listing
