"""How transformers builds a model skeleton on `meta`, across transformers 4.57 to 5.x.

transformers 5 has `PreTrainedModel.get_init_context(dtype, is_quantized, ds_init_called,
allow_all_kernels)` (dtype, `no_tie_weights`, meta device, meta-safe creation ops) and patches
output recorders after `__init__`. transformers 4.57 has `get_init_context(is_quantized,
ds_init_called)` (`no_init_weights` + `init_empty_weights`: parameters on meta, buffers on the
CPU) and sets the default dtype around the call instead. The loader rebuilds every tensor on meta
from rank 0's spec afterwards, so both end in the same place.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import nn

T = TypeVar("T")


def config_base_class() -> type:
    """`PretrainedConfig` (4.x name; 5.x keeps it as an alias of `PreTrainedConfig`)."""
    from transformers import PretrainedConfig

    return PretrainedConfig


def _new_init_context_signature(cls: type) -> bool:
    return "dtype" in inspect.signature(cls.get_init_context).parameters


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextmanager
def meta_init(cls: type, dtype: torch.dtype, allow_all_kernels: bool = False, config: Any = None) -> Iterator[None]:
    """The contexts `cls.from_pretrained` constructs its model under (no weight init, meta).
    `config`: the model's, where transformers takes it (5.25: a `fusion_config` in it swaps
    module classes during `__init__`)."""
    from transformers.utils import ContextManagers

    if _new_init_context_signature(cls):
        takes_config = "config" in inspect.signature(cls.get_init_context).parameters
        contexts = cls.get_init_context(dtype, False, False, allow_all_kernels, *([config] if takes_config else []))
    else:
        contexts = [_default_dtype(dtype), *cls.get_init_context(False, False)]
    with ContextManagers(contexts):
        yield


def after_init(model: nn.Module) -> None:
    """What `from_pretrained` does right after `__init__` (5.x: patch output recorders)."""
    try:
        from transformers.monkey_patching import patch_output_recorders
    except ImportError:  # transformers 4.x: nothing to do
        return
    patch_output_recorders(model)


@contextmanager
def meta_safe_creation() -> Iterator[None]:
    """Meta device for `_from_config`, with transformers' meta-safe creation ops where it has them
    (5.x: `torch.linspace` etc. stay on the CPU so `__init__` can call `.item()`)."""
    try:
        from transformers.initialization import meta_device_safe_creation_ops
    except ImportError:
        meta_device_safe_creation_ops = None
    with torch.device("meta"):
        if meta_device_safe_creation_ops is None:
            yield
        else:
            with meta_device_safe_creation_ops():
                yield


def kernelized_for_the_run_device(load: Callable[[], T]) -> T:
    """`load()` (a `from_pretrained` / `_from_config`) with its kernels chosen for the device the
    run computes on. transformers 5.25 kernelizes every model in `from_pretrained` where the
    kernels library is installed, for `model._kernels_device` or else `model.device`, and again
    whenever `train()`/`eval()` changes the kernels' mode. A model the loader builds on meta got
    "meta", which the kernels library refuses ("Unsupported device type 'meta'"), on every
    strategy: in the call, and in the user's `model.train()` before `prepare`. As transformers
    itself does for a model offloaded to meta (`_kernels_device` from its device map), the run's
    device is given for the call (on the class: the model does not exist yet) and kept on every
    model the call returns, for the kernelizations after it. Older transformers never read it."""
    from transformers import PreTrainedModel

    device = _run_device_type()
    own = vars(PreTrainedModel).get("_kernels_device")
    PreTrainedModel._kernels_device = device
    try:
        model = load()
    finally:
        if own is None:
            del PreTrainedModel._kernels_device
        else:
            PreTrainedModel._kernels_device = own
    if isinstance(model, nn.Module):
        _keep_kernels_device(model, device)
    return model


def _keep_kernels_device(model: nn.Module, device: str) -> None:
    """The device every later kernelization of `model` and its sub-models (a VLM's) is for."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module._kernels_device = device


def kernels_chosen(model: nn.Module) -> tuple[Any, Any] | None:
    """How `from_pretrained` kernelized `model` (transformers 5.25: its kernel config and mode), or
    None where it did not (older transformers, no `kernels` library, `use_kernels=False`,
    `USE_HUB_KERNELS=0`). Small and picklable: rank 0 sends it with its description."""
    if not getattr(model, "use_kernels", False):
        return None
    return getattr(model, "kernel_config", None), getattr(model, "kernels_mode", None)


def kernelize_as_chosen(model: nn.Module, chosen: tuple[Any, Any] | None) -> None:
    """Kernelize a model built from rank 0's description as `from_pretrained` kernelized rank 0's
    (`kernels_chosen`), for the run's device: without it the ranks that did not load ran other
    layer implementations than rank 0 (hub kernels there, torch's here) and were never
    re-kernelized at `train()`/`eval()`, where a plain load on every rank runs the same."""
    if chosen is None:
        return
    _keep_kernels_device(model, _run_device_type())
    kernel_config, mode = chosen
    if hasattr(model, "set_use_kernels"):
        model.set_use_kernels(True, kernel_config, mode)
    else:  # transformers 4.x: `use_kernels=True` is opt-in and kernelizes for the model's mode
        model.use_kernels = True


def _run_device_type() -> str:
    """The device type this process computes on: accelerate's, once its state exists."""
    from accelerate.state import PartialState

    if PartialState._shared_state:
        return PartialState().device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def kept_in_float32(model: nn.Module, dtype: torch.dtype) -> Callable[[str], bool]:
    """Which parameter names `from_pretrained(dtype=dtype)` keeps in float32 (the model's
    `_keep_in_fp32_modules_strict` for bf16/fp16, `_keep_in_fp32_modules` for fp16), matched the
    way the installed transformers matches them: 5.x globs from `_get_dtype_plan`, 4.x a regex
    over whole module names built inside `from_pretrained`."""
    get_plan = getattr(model, "_get_dtype_plan", None)
    if get_plan is not None:
        plan = [name for name, kept in get_plan(dtype).items() if kept == torch.float32]
        if not plan:
            return lambda name: False
        from transformers.core_model_loading import build_glob_alternation

        pattern = build_glob_alternation(plan)[0]
        return lambda name: pattern.search(name) is not None
    modules = list(getattr(model, "_keep_in_fp32_modules_strict", None) or []) if dtype in (
        torch.float16, torch.bfloat16) else []
    if dtype == torch.float16:
        modules += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    if not modules:
        return lambda name: False
    pattern = re.compile("|".join(rf"((^|\.){m}($|\.))" for m in modules))
    return lambda name: pattern.search(name) is not None


def is_config(value: Any) -> bool:
    return isinstance(value, config_base_class())


class _AutocastAcceptingMeta(torch.autocast):
    """`torch.autocast` that treats device type "meta" as "cpu" (there is no meta autocast)."""

    def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
        super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)


def _one_sequence_per_row(find: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """`find_packed_sequence_indices` answering for position ids that pack nothing (0..T-1 in
    every row) without reading them: the installed version's own answer for such ids (5.x: None;
    4.57: a tensor of zeros, which then shapes its mask), on the ids' device."""

    def unpacked(position_ids: torch.Tensor) -> Any:
        answer = find(torch.arange(position_ids.shape[-1]).expand(position_ids.shape))
        return answer.to(position_ids.device) if isinstance(answer, torch.Tensor) else answer

    return unpacked


@contextmanager
def meta_forward() -> Iterator[None]:
    """What a forward on `meta` needs across the range, without changing what it computes:

    - transformers 4.x RoPE opens `torch.autocast(device_type=x.device.type, enabled=False)`,
      which raises for "meta" (5.x checks the device type first). Only the device name is
      mapped; `enabled=False` still disables autocast.
    - without a cache (`use_cache: false`, as training checkpoints often say) transformers looks
      for packed sequences in the position ids (`masking_utils.find_packed_sequence_indices`),
      a data-dependent `.all()` that cannot run on meta. The estimate's batch holds one sequence
      per row: the check gets the answer it gives for such ids, without reading them.
    - transformers 5's MoE experts (`integrations.moe`) call `torch._grouped_mm` wherever it
      exists, on meta too, and torch's meta kernel of it takes bfloat16 only (a Hopper limit of
      old), so a float32 or float16 MoE failed on meta though it runs on the CPU and on CUDA.
      On meta, outside bfloat16, the experts take transformers' own fallback op instead, which
      has a meta kernel and saves the same tensors for backward (input, weight, offsets).
    All are put back when the block ends, whatever it raises (not thread-safe: process-wide)."""
    original = torch.autocast
    torch.autocast = _AutocastAcceptingMeta  # type: ignore[misc]
    masking = _masking_utils()
    packed = getattr(masking, "find_packed_sequence_indices", None)
    if packed is not None:
        masking.find_packed_sequence_indices = _one_sequence_per_row(packed)
    moe = _moe_integration()
    grouped = getattr(moe, "_can_use_grouped_mm", None)
    if grouped is not None:
        moe._can_use_grouped_mm = _grouped_mm_in_bfloat16_only_on_meta(grouped)
    try:
        yield
    finally:
        torch.autocast = original  # type: ignore[misc]
        if packed is not None:
            masking.find_packed_sequence_indices = packed
        if grouped is not None:
            moe._can_use_grouped_mm = grouped


def _moe_integration() -> Any:
    try:
        from transformers.integrations import moe
    except ImportError:  # transformers 4.x: a module per expert, no grouped matmul
        return None
    return moe


def _grouped_mm_in_bfloat16_only_on_meta(can_use: Callable[..., bool]) -> Callable[..., bool]:
    def can_use_grouped_mm(input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        if weight.device.type == "meta" and weight.dtype != torch.bfloat16:
            return False
        return can_use(input, weight, *args, **kwargs)

    return can_use_grouped_mm


def _masking_utils() -> Any:
    try:
        from transformers import masking_utils
    except ImportError:  # a transformers without it has no packed-sequence check
        return None
    return masking_utils
