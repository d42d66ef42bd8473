"""A function's parameters by name, for the hooks that read a forward's keywords (the KV cache's
`use_cache`, a VLM's `pixel_values`) and call a model's own methods with the ones they take."""

from __future__ import annotations

import inspect
from typing import Any


def parameters(function: Any) -> dict[str, inspect.Parameter]:
    """`function`'s parameters in order; none for a signature inspect cannot read (a C function,
    a wrapper that hides it): a hook then leaves that function alone."""
    try:
        return dict(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return {}
