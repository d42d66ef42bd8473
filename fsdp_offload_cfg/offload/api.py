"""`enable_activation_offload`: the one call that turns the offload on for a model.

Works on a plain model, after `fully_shard` (FSDP2), on an FSDP1-wrapped model, and after
`checkpoint_wrapper` (as accelerate's `fsdp2_apply_ac` applies it); nothing here needs
accelerate. The root's `forward` is wrapped (an instance attribute, like accelerate's own
autocast wrapper) so that every forward runs inside the saved-tensor hooks and a `finally`
clears all per-forward state, whatever the forward raises.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_offload_cfg import model_state
from fsdp_offload_cfg._logging import get_logger
from fsdp_offload_cfg._signatures import qualified_name
from fsdp_offload_cfg.offload.groups import GroupHooks, LayerClasses, find_units, lift_to_boundaries, own_class
from fsdp_offload_cfg.offload.handlers import AsyncHandler, OffloadHandler
from fsdp_offload_cfg.offload.options import ActivationOffloadConfig
from fsdp_offload_cfg.offload.pool import HostPool

logger = get_logger("fsdp_offload_cfg.offload")


class OffloadHandle:
    """What `enable_activation_offload` installed; `remove()` undoes all of it."""

    def __init__(self, model: nn.Module, config: ActivationOffloadConfig, groups: list[nn.Module],
                 handler: OffloadHandler | None) -> None:
        self.model = model
        self.config = config
        self.groups = groups
        self.handler = handler
        self.mode = "off" if handler is None else ("async" if isinstance(handler, AsyncHandler) else "sync")
        self._group_hooks: GroupHooks | None = None  # the boundaries' hooks, whose form follows compilation
        self._forward: Callable[..., Any] | None = None
        self._previous_forward: Any = None
        self._said_outside_pass = False  # the warning of `_layer_outside_pass`, once per handle

    @property
    def active(self) -> bool:
        return self.handler is not None

    @property
    def model_forward(self) -> Any:
        """The model's own instance `forward` beneath the one installed here (TRL's fused LM head
        patches one in; the activation budget looks for it), None where it had none."""
        return self._previous_forward

    def run_as_forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` as the model's forward runs under the offload (one forward pass
        of the handler): the root's forward installed here, and a method a trainer reroutes
        through the model's `__call__` in its place (TRL's `_ForwardRedirection`)."""
        if self.handler is None:  # removed while someone else's wrapper still calls us
            return fn(*args, **kwargs)
        if torch.compiler.is_compiling():
            # The whole model is being traced into compiled graphs (`model.compile()`). A graph
            # saves its activations only when it ends, so per-layer groups do not exist inside
            # it, and our hooks would split it (different kernels, different low bits). Step
            # aside: the compiled model stays exactly as without offload. Compile per layer
            # to offload. (Constant under tracing: this branch costs no graph break.)
            _whole_model_compile_notice()
            return fn(*args, **kwargs)
        hooks = self._group_hooks
        hooks.match_compilation(self.model)
        with self.handler.forward_pass():
            try:
                return fn(*args, **kwargs)
            except Exception as error:
                explained = hooks.explain_compile_error(error, self.model)
                if explained is None:
                    raise
                raise explained from error

    def _layer_outside_pass(self, layer: nn.Module) -> None:
        """A layer recorded a forward for backward outside the forward installed here: nothing of it
        moves, and the run would look offloaded while it is not (TRL's distillation trainers swap
        the model's forward so, until `trl-forward-redirection`). Said once per model on each rank,
        as the package's other run-time lines are (its rank named; a Python warning named none, and
        `-W error` would have ended the run), with the culprit where it can be named: a forward put
        on the model since the offload wrapped it."""
        if self._said_outside_pass:
            return
        self._said_outside_pass = True
        now = self.model.__dict__.get("forward")
        if now is not None and now is not self._forward:
            how = (f"the model's forward was replaced after the offload was enabled, by {qualified_name(now)}, "
                   "which does not call the forward the offload installed")
            fix = "Enable the offload after that replacement, or have the new forward call the one it replaced"
        else:
            how = ("the layers were called without the forward the offload installed (a trainer calling a submodule "
                   "such as model.model(...) directly, or swapping the model's forward for the length of a call)")
            fix = "Call the model itself"
        logger.warning(
            "activation offload: %s of %s ran a training forward outside the offload: %s. Its activations stay on the "
            "device. %s; where a framework does this, please report it to fsdp_offload_cfg.",
            own_class(layer).__name__, own_class(self.model).__name__, how, fix)

    def remove(self) -> None:
        """Unhook the groups, restore the root's forward, free the idle pool (idempotent)."""
        if self._group_hooks is not None:
            self._group_hooks.remove()
            self._group_hooks = None
        if self._forward is not None:
            _release_compile_notice()
            if self.model.__dict__.get("forward") is self._forward:
                if self._previous_forward is None:
                    del self.model.forward
                else:
                    self.model.forward = self._previous_forward
            # else: someone wrapped our wrapper; it stays in their chain but passes straight through
            self._forward = None
        if self.handler is not None:
            self.handler.pool.close()
            self.handler = None
        if model_state.get(self.model, "offload") is self:
            model_state.take(self.model, "offload")

    def __enter__(self) -> OffloadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _compute_device(model: nn.Module) -> torch.device:
    """The device the model computes on: where its (local) parameters live."""
    for p in model.parameters():
        device = p.device
        break
    else:
        device = torch.device("cpu")
    if device.type == "meta":
        raise ValueError("enable_activation_offload: the model is still on the meta device; materialise it first")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _resolve_mode(config: ActivationOffloadConfig, device: torch.device) -> str:
    mode = config.resolved_mode(device.type)
    if mode != config.mode and config.mode == "async":
        warnings.warn(f"async activation offload needs CUDA streams; using sync on {device.type}", stacklevel=3)
    return mode


def enable_activation_offload(
    model: nn.Module,
    config: ActivationOffloadConfig | None = None,
    *,
    layer_classes: LayerClasses | None = None,
    groups: Sequence[nn.Module] | None = None,
) -> OffloadHandle:
    """Offload the activations saved by `model`'s groups to host memory during forward.

    `config=None` means the defaults with `enabled=True`; a config with `enabled=False` returns an
    inactive handle (so callers may call this unconditionally). Groups: explicit `groups` (in
    forward order), else modules of `layer_classes` (types or class names), else detected (FSDP2
    units, FSDP1 units, transformers `_no_split_modules`). Raises if no group is found, or if
    offload is already enabled on `model`.
    """
    config = config if config is not None else ActivationOffloadConfig(enabled=True)
    if get_offload_handle(model) is not None:
        raise RuntimeError("activation offload is already enabled on this model; call handle.remove() first")
    if not config.enabled:
        return OffloadHandle(model, config, [], None)
    boundaries = _pick_groups(model, layer_classes, groups)
    handler = _make_handler(model, config, len(boundaries))
    handle = OffloadHandle(model, config, boundaries, handler)
    handle._group_hooks = GroupHooks(boundaries, handler.enter_group, handler.exit_group)
    handler.on_layer_outside_pass = handle._layer_outside_pass
    _wrap_forward(handle, handler)
    model_state.put(model, "offload", handle)
    return handle


def _pick_groups(model: nn.Module, layer_classes: LayerClasses | None,
                 groups: Sequence[nn.Module] | None) -> list[nn.Module]:
    if groups is not None:
        inside = {id(m) for m in model.modules() if m is not model}
        if any(id(g) not in inside for g in groups):
            raise ValueError("every module in groups= must be a submodule of the model (not the model itself)")
        boundaries = list(groups)
    else:
        boundaries = lift_to_boundaries(model, find_units(model, layer_classes))
    if not boundaries:
        raise ValueError("enable_activation_offload found no groups: pass layer_classes=[YourDecoderLayer] or groups=")
    return boundaries


def _make_handler(model: nn.Module, config: ActivationOffloadConfig, n_groups: int) -> OffloadHandler:
    device = _compute_device(model)
    mode = _resolve_mode(config, device)
    pool = HostPool(pinned=device.type == "cuda", max_bytes=config.max_pinned_bytes)
    common: dict[str, Any] = {
        "min_tensor_bytes": config.min_tensor_bytes,
        "offload_last_group": config.offload_last_group,
    }
    if mode == "async":
        return AsyncHandler(model, device, n_groups, pool, prefetch_groups=config.prefetch_groups, **common)
    return OffloadHandler(model, device, n_groups, pool, **common)


def _wrap_forward(handle: OffloadHandle, handler: OffloadHandler) -> None:
    _hold_compile_notice()
    model = handle.model
    handle._previous_forward = model.__dict__.get("forward")
    inner = model.forward

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if handle.handler is not None and torch.compiler.is_compiling():
            # said here, in the frame dynamo traces from the root: its reordering of the notice to
            # after the graph did not reach the call one method deeper (the notice was lost)
            _whole_model_compile_notice()
            return inner(*args, **kwargs)
        return handle.run_as_forward(inner, *args, **kwargs)

    bound = types.MethodType(forward, model)
    model.forward = bound
    handle._forward = bound


def _whole_model_compile_notice() -> None:
    """Logged once; dynamo moves the call after the graph (`reorderable_logging_functions`)."""
    global _noticed_whole_model_compile
    if not _noticed_whole_model_compile:
        _noticed_whole_model_compile = True
        warnings.warn(
            "activation offload is inactive for a model compiled whole (model.compile() / torch.compile(model)): "
            "a single compiled graph has no layer boundaries to offload at. Compile each decoder layer "
            "instead (for layer in model.model.layers: layer.compile()) to combine offload with torch.compile.",
            stacklevel=2,
        )


_noticed_whole_model_compile = False
# Live handles whose forward wrapper may call the notice: it is registered with dynamo (traced,
# the notice would break the graph; registered, dynamo calls it after the graph) exactly while
# one exists, so that removing the last handle leaves dynamo's config as it found it.
_notice_holders = 0


def _hold_compile_notice() -> None:
    global _notice_holders
    import torch._dynamo  # here, not at import: `import fsdp_offload_cfg` stays light

    if _notice_holders == 0:
        torch._dynamo.config.reorderable_logging_functions.add(_whole_model_compile_notice)
    _notice_holders += 1


def _release_compile_notice() -> None:
    global _notice_holders
    import torch._dynamo

    _notice_holders -= 1
    if _notice_holders == 0:
        torch._dynamo.config.reorderable_logging_functions.discard(_whole_model_compile_notice)


def get_offload_handle(model: nn.Module) -> OffloadHandle | None:
    """The active handle of `model`, if offload is enabled on it."""
    return model_state.get(model, "offload")
