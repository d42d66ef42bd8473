"""The CUDA caching allocator's expandable segments: how torch is told, and what the user said.

Why the offload wants them: each step allocates and frees blocks of many sizes (every layer's
reloads beside the gradients), and the default allocator carves them from fixed segments it keeps
reserved. On an H100 (docs/benchmarks.md, 2026-11-27) the offload reserved 1.21x its allocated
peak in one process and 1.33x under FSDP2 that way, against 1.02x and 1.12x with expandable
segments (one growing mapping instead of fixed segments), at the same step time. Users run out of
memory at the reserved bytes.

How torch is told: `torch._C._accelerator_setAllocatorSettings` (torch 2.9 on; the deprecated
`torch.cuda.memory._set_allocator_settings` calls it). It applies to the segments made from then
on, in this process only. Not the variable: every process this one starts would inherit it (a
vLLM engine, which refused it under sleep mode until its April 2026 release), and an allocator
already configured would not read it again.

What the user said wins: either allocator variable set means the allocator is theirs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# torch's variables for the allocator: the device-neutral name (torch 2.9 on) and the CUDA one
USER_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
_SETTING = re.compile(r"expandable_segments\s*:\s*(\w+)", re.IGNORECASE)


def user_variable(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(name, value) of the first allocator variable the user set, or None."""
    for name in USER_VARIABLES:
        if environ.get(name):
            return name, environ[name]
    return None


def stated_expandable(settings: str) -> bool | None:
    """What an allocator settings text says of expandable segments (the last mention), or None."""
    found = _SETTING.findall(settings)
    return found[-1].lower() == "true" if found else None


def cuda_allocator_here() -> bool:
    """torch's CUDA caching allocator is the one this process would use: a CUDA build (not ROCm,
    whose allocator this was not measured on), whether or not a GPU is visible yet."""
    import torch

    return torch.version.cuda is not None and torch.version.hip is None


def set_expandable(on: bool) -> None:
    """Make the segments the allocator creates from now on expandable (or not)."""
    import torch

    torch._C._accelerator_setAllocatorSettings(f"expandable_segments:{on}")  # torch 2.11 (the oldest supported) has it


def settings_now() -> str | None:
    """The allocator settings torch reports (torch 2.13 on), or None where it has no getter."""
    import torch

    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return None if getter is None else getter()
