"""Two activation offloaders on one model: refused, naming both, instead of one moving nothing.

Every activation offloader works through `torch.autograd.graph.saved_tensors_hooks`, and autograd
calls only the innermost pair. With ms-swift's own `activation_cpu_offload` callback (which reads
the unprefixed key this plugin also reads), TRL's `OffloadActivations`, axolotl's
`activation_offloading` or `save_on_cpu` around our layers, one of the two offloaders sees no
tensor at all, silently (seen with ms-swift: its hooks took every activation, ours moved 0 bytes).

How: when a forward starts and when each offload group is entered, the innermost saved-tensor
hooks must be ours, none (at the start), or those of activation checkpointing (which composes
with the offload by design). Anything else is another offloader; it is named by the module of
its pack function.
"""

from __future__ import annotations

import torch

# hooks that compose with ours: checkpointing's, and ours
_COMPATIBLE = ("torch.utils.checkpoint", "fsdp_offload_cfg.")
_KNOWN = {  # module prefix of a pack function -> what the user turned on, and where to turn it off
    "torch.autograd.graph": "torch.autograd.graph.save_on_cpu (accelerate's fsdp_activation_checkpointing_offload "
                            "uses it)",
    "trl.": "TRL's OffloadActivations (activation_offloading: true in TRL or axolotl)",
    "swift": "ms-swift's activation_cpu_offload callback (the unprefixed activation_cpu_offload key in its "
             "--fsdp JSON turns it on)",
    "axolotl": "axolotl's activation_offloading",
}


class OffloaderCollisionError(RuntimeError):
    """Another activation offloader is active on a model this plugin offloads."""


def foreign_hooks() -> str | None:
    """What installed the innermost saved-tensor hooks, if they are neither ours, checkpointing's,
    nor absent."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:
        return None
    pack = top[0]
    module = getattr(pack, "__module__", None) or type(pack).__module__ or "?"
    if module.startswith(_COMPATIBLE):
        return None
    known = next((what for prefix, what in _KNOWN.items() if module.startswith(prefix)), None)
    return known or f"saved-tensor hooks from {module}.{getattr(pack, '__qualname__', type(pack).__name__)}"


def refuse_other_offloader(where: str) -> None:
    """Raise `OffloaderCollisionError` if another offloader's hooks are the innermost now."""
    other = foreign_hooks()
    if other is not None:
        raise OffloaderCollisionError(
            f"fsdp_offload_cfg's activation offload and {other} are both active on this model ({where}): "
            "autograd hands each saved tensor to one of them only, so the other would move nothing. Turn one "
            "off: remove that option, or this plugin's activation_cpu_offload (spelled fsdp_activation_cpu_offload, "
            "only this plugin reads it)."
        )
