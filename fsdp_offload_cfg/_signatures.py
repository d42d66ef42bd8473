"""A function's parameters by name, for the hooks that read a forward's keywords (the KV cache's
`use_cache`, a VLM's `pixel_values`) and call a model's own methods with the ones they take; and
its qualified name, for the messages that say whose function replaced one of ours."""

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


def qualified_name(function: Any) -> str:
    """`module.qualname` of a function a framework put somewhere (a bound method, a classmethod or
    staticmethod object, by the function inside)."""
    function = getattr(function, "__func__", function)
    name = getattr(function, "__qualname__", type(function).__qualname__)
    module = getattr(function, "__module__", None)
    return f"{module}.{name}" if module else name
