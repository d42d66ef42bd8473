"""What a transformers model's forward returns, read by its current names.

transformers 5.24 renamed the cache of every `ModelOutput` from `past_key_values` (and
`cache_params`) to `cache`; the old names still read, through a property that logs a deprecation
warning, which an estimate would print to users who never wrote either name. The field present
decides, not a version.
"""

from __future__ import annotations

from typing import Any


def output_cache(output: Any) -> Any:
    """The cache the forward returned (None without one): `cache` where the output class has that
    field, else `past_key_values`."""
    fields = getattr(output, "__dataclass_fields__", {})
    return getattr(output, "cache" if "cache" in fields else "past_key_values", None)
