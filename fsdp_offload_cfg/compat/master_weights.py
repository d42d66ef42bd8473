"""Which dtype accelerate's FSDP2 prepare keeps the sharded (master) parameters in under
`mixed_precision: bf16/fp16`: what the estimate counts for parameters, gradients and optimizer
state. It differs within the supported range, read off each release's `fsdp2_prepare_model` and
checked by a test that prepares a bf16 model with the installed accelerate:

- 1.10-1.12: `model = model.to(torch.float32)`: every parameter becomes float32;
- 1.13: a loop rebinds `param = param.to(torch.float32)`, which changes nothing (the warning
  still says it upcast): the masters stay in the dtype the model was loaded in;
- 1.14 on: `param.data = param.data.to(torch.float32)` for the parameters that require grad.

Decided from the installed function's code, not its version number, so a backport keeps working.
Code that matches none of the three is taken to upcast (the released behaviour since 1.14).
"""

from __future__ import annotations

import functools
import inspect
from typing import Literal

Upcast = Literal["all", "trainable", "none"]


@functools.cache
def accelerate_upcast() -> Upcast:
    """What `fsdp2_prepare_model` upcasts to float32 under mixed precision."""
    from accelerate.utils import fsdp_utils

    try:
        code = inspect.getsource(fsdp_utils.fsdp2_prepare_model)
    except (OSError, TypeError):  # no source shipped: assume the current release's behaviour
        return "trainable"
    if "param.data = param.data.to(torch.float32)" in code:
        return "trainable"
    if "model = model.to(torch.float32)" in code:
        return "all"
    if "param = param.to(torch.float32)" in code:
        return "none"
    return "trainable"
