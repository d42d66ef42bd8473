"""The layer classes FSDP wraps by default: the classes the model declares in `_no_split_modules`
(or, where it declares none, its sub-models declare) that it has.

accelerate's TRANSFORMER_BASED_WRAP with no `fsdp_transformer_layer_cls_to_wrap` wraps every class
that `model._no_split_modules` names, and raises "Could not find the transformer layer class ...
in the model" if one of them is not in the model. transformers 5 builds that list in `post_init`
as the union of every sub-model's own list, and a sub-model class often names modules that only
its siblings build: Llava's CLIP vision tower brings `CLIPTextEmbeddings`, Gemma 3's and
PaliGemma's SigLIP bring `SiglipTextEmbeddings`. So stock accelerate refuses Llava, Gemma 3,
PaliGemma, Mllama and others out of the box: 38 of the 327 classes of transformers 5.24's
causal-LM, image-text and masked-LM auto classes, 19 of 220 on 4.57 (RoBERTa's MLM names
`RobertaSelfAttention`, which it no longer has). transformers 4.x has the opposite fault: a
composite (Llava, Mistral3, InternVL) declares nothing of its own, and accelerate wraps nothing
but the root, so the whole model is one FSDP unit, all-gathered whole for every forward.

What a user would write by hand is the declared classes the model builds, taken from its
sub-models where it declares none (transformers 5's rule, so both versions wrap the same), and
that is what this module gives accelerate, for the call only: rank 0 says what it chose. A model
whose own list names only classes it lacks is refused with the key to set and the classes it
repeats (verl took the same way out, verl #6289); one that declares nothing anywhere stays one
unit, with a warning. A list the user wrote is theirs: a class it names that is not in the model
still fails, as in accelerate, but with the key, where it was set, and the classes the model has.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from fsdp_offload_cfg._logging import get_logger, is_rank0

logger = get_logger(__name__)

_said: set[tuple[str, ...]] = set()  # what rank 0 has logged, per model class: once per process


@dataclass(frozen=True)
class DefaultLayers:
    """What TRANSFORMER_BASED_WRAP wraps when no class is listed. Names sorted: transformers 5
    keeps a set, whose order varies by process."""

    present: list[str]  # declared and built: wrapped
    absent: list[str]  # declared, not built: left out
    # The model declares none of its own, so these are its sub-models' (a transformers 4.x
    # composite such as Llava, Mistral3, InternVL: accelerate would wrap nothing but the root).
    # transformers 5 lists them on the model itself, so both wrap the same.
    inherited: bool


def transformers_model(model: nn.Module) -> nn.Module | None:
    """The transformers model inside `model` (itself, or under PEFT's, accelerate's and FSDP's
    wrappers); None for a model of other code. transformers is not imported for the question: a
    process that never imported it holds no such model."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    return next((m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)), None)


def default_layer_classes(model: nn.Module) -> DefaultLayers:
    own = set(getattr(model, "_no_split_modules", None) or [])
    declared = sorted(own or _sub_model_classes(model))
    built = _built(model)
    return DefaultLayers([n for n in declared if n in built], [n for n in declared if n not in built], not own)


def wrapped_by_default(model: nn.Module, source: str) -> DefaultLayers:
    """`default_layer_classes`, refused (`ValueError`, naming the key and `source`) where the
    model's own list names only classes it does not have: the run and the estimate alike."""
    layers = default_layer_classes(model)
    if layers.absent and not layers.present and not layers.inherited:
        raise ValueError(f"{type(model).__name__}: TRANSFORMER_BASED_WRAP has no layer class to wrap: the model's "
                         f"_no_split_modules names {', '.join(layers.absent)}, which it does not have. Set "
                         f"fsdp_transformer_layer_cls_to_wrap in {source} to its layer classes{_blocks_hint(model)}.")
    return layers


def listed_but_absent(model: nn.Module, names: list[str], where: str) -> str | None:
    """The refusal for a listed class the model lacks (None when it has them all): the run's and
    the estimate's. accelerate says only "Could not find the transformer layer class X in the
    model"; this names the key (`where`) and the classes the model has."""
    missing = [n for n in names if n not in _built(model)]
    if not missing:
        return None
    known = default_layer_classes(model).present or repeated_block_classes(model)
    return (f"{where} names {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not a module class "
            f"of {type(model).__name__}; its layer classes are {', '.join(known) or 'unknown'} (fix the list, or "
            "remove it to wrap those)")


def _built(model: nn.Module) -> set[str]:
    return {type(m).__name__ for m in model.modules()}


def _sub_model_classes(model: nn.Module) -> set[str]:
    found: set[str] = set()
    for module in model.modules():
        if module is not model:
            found.update(getattr(module, "_no_split_modules", None) or [])
    return found


def repeated_block_classes(model: nn.Module) -> list[str]:
    """Classes of the blocks a model stacks in an `nn.ModuleList` (its layers, as a user would
    list them for `fsdp_transformer_layer_cls_to_wrap`), in the order they first appear."""
    found: dict[str, None] = {}
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            found.update(dict.fromkeys(type(block).__name__ for block in module))
    return list(found)


def _blocks_hint(model: nn.Module) -> str:
    blocks = repeated_block_classes(model)
    return f" (it repeats {', '.join(blocks)})" if blocks else ""


def transformer_based(policy: Any) -> bool:
    """The plugin's `auto_wrap_policy` is TRANSFORMER_BASED_WRAP (the function, or accelerate's
    partial of it once set)."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    return getattr(policy, "func", policy) is transformer_auto_wrap_policy


@contextmanager
def present_classes_only(plugin: Any, model: nn.Module, source: str,
                         configured: tuple[str, ...] | None = None) -> Iterator[None]:
    """While accelerate reads the default layer classes, `model._no_split_modules` holds the
    classes `default_layer_classes` gives. Classes the user named are checked (`check_listed`)
    and otherwise left as they are; nothing changes where the policy is not transformer-based or
    where the model's own list is all built. `configured`: the config file's
    `fsdp_transformer_layer_cls_to_wrap`, to tell its names from the plugin's own."""
    if not transformer_based(plugin.auto_wrap_policy):
        yield
        return
    if plugin.transformer_cls_names_to_wrap is not None:
        check_listed(plugin, model, source, configured)
        yield
        return
    layers = wrapped_by_default(model, source)
    if not layers.present:
        _say_once(model, (), logger.warning, "%s: TRANSFORMER_BASED_WRAP finds no layer class to wrap (the model "
                  "declares none): the whole model is one FSDP unit, gathered whole for every forward; set "
                  "fsdp_transformer_layer_cls_to_wrap in %s%s", type(model).__name__, source, _blocks_hint(model))
        yield
        return
    if not layers.absent and not layers.inherited:
        yield
        return
    if layers.inherited:
        _say_once(model, layers.present, logger.info, "%s declares no layer classes: wrapping its sub-models' %s, "
                  "as transformers 5 does; set fsdp_transformer_layer_cls_to_wrap to choose",
                  type(model).__name__, ", ".join(layers.present))
    else:
        _say_once(model, layers.absent, logger.info, "%s: wrapping %s; its _no_split_modules also names %s, "
                  "which it does not have (transformers lists every sub-model's classes); set "
                  "fsdp_transformer_layer_cls_to_wrap to choose", type(model).__name__, ", ".join(layers.present),
                  ", ".join(layers.absent))
    with _instance_attribute(model, "_no_split_modules", layers.present):
        yield


# On the plugin, the list accelerate set from a model's defaults (`set_auto_wrap_policy` writes
# them where the user's list goes): the same object still there means no one has listed classes
# since, so the next model gets its own defaults. An attribute, as the plugin (a dataclass with
# `eq`) is not hashable; it lives as long as the plugin, which is as long as the list.
_DEFAULTED = "_fsdp_offload_cfg_defaulted_layer_classes"


@contextmanager
def defaults_per_model(plugin: Any) -> Iterator[None]:
    """Each model gets its own default classes. accelerate writes the first model's defaults onto
    the plugin, so a second model of another class prepared by the same Accelerator (a teacher or
    reference model of another architecture) was refused under FSDP2 ("Could not find the
    transformer layer class ...") and under FSDP1 kept the first model's policy, which matches
    none of its layers: one unit. A list accelerate defaulted is cleared before the call (and
    FSDP1's policy unbound from its classes); a list the user set is left as it is."""
    if transformer_based(plugin.auto_wrap_policy) and plugin.transformer_cls_names_to_wrap is not None \
            and plugin.transformer_cls_names_to_wrap is getattr(plugin, _DEFAULTED, None):
        plugin.transformer_cls_names_to_wrap = None
        plugin.auto_wrap_policy = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy)
    defaulting = plugin.transformer_cls_names_to_wrap is None
    yield
    if defaulting and plugin.transformer_cls_names_to_wrap is not None:
        object.__setattr__(plugin, _DEFAULTED, plugin.transformer_cls_names_to_wrap)


def check_listed(plugin: Any, model: nn.Module, source: str, configured: tuple[str, ...] | None) -> None:
    """Refuses a class the user listed that the model lacks (`listed_but_absent`), saying where the
    list was set. (A config file's list is checked for form when it is read.)"""
    names = list(plugin.transformer_cls_names_to_wrap)
    where = (f"{source}: fsdp_transformer_layer_cls_to_wrap" if configured is not None and list(configured) == names
             else "transformer_cls_names_to_wrap on accelerate's FSDP plugin (set in code)")
    refusal = listed_but_absent(model, names, where)
    if refusal:
        raise ValueError(refusal)


def _say_once(model: nn.Module, names: Any, log: Any, message: str, *args: Any) -> None:
    key = (type(model).__name__, *names)
    if is_rank0() and key not in _said:
        _said.add(key)
        log(message, *args)


@contextmanager
def _instance_attribute(obj: Any, name: str, value: Any) -> Iterator[None]:
    """`obj.name = value` for the block; then as before: the old instance value, or none (the
    class attribute shows again, as transformers 4.x keeps `_no_split_modules`)."""
    had, old = name in vars(obj), vars(obj).get(name)
    object.__setattr__(obj, name, value)
    try:
        yield
    finally:
        if had:
            object.__setattr__(obj, name, old)
        else:
            object.__delattr__(obj, name)

