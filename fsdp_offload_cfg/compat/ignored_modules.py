"""Whether the installed accelerate's FSDP2 prepare keeps the modules `fsdp_ignored_modules` names
whole (unsharded on every rank).

accelerate 1.11 added it: `get_parameters_from_modules` collects the named modules' parameters and
`fsdp2_prepare_model` hands them to `fully_shard` as `ignored_params`. accelerate 1.10 takes the key
and shards those modules like the rest, without a word; `validate` and the first `prepare` say so
(`cli.file_warnings`, `integrations.accelerate`). Decided by the function's presence, not by a
version string (`compat/__init__.py`).
"""

from __future__ import annotations


def fsdp2_keeps_ignored_modules_whole() -> bool:
    from accelerate.utils import fsdp_utils

    return hasattr(fsdp_utils, "get_parameters_from_modules")


def ignored_modules_sharded_anyway(key: str = "fsdp_config.fsdp_ignored_modules") -> str | None:
    """What to tell a user whose `key` the installed accelerate does not honour under FSDP2; None
    where it does."""
    if fsdp2_keeps_ignored_modules_whole():
        return None
    from importlib.metadata import version

    return (f"{key} does nothing under FSDP2 with the installed accelerate {version('accelerate')}: it shards "
            "the modules it names like the rest (accelerate 1.11 and later keep them whole); upgrade accelerate, "
            "or remove the key")
