"""The user's model, built on `meta` with its real class, and one batch of inputs for it.

Why the real class and not a formula: parameter counts of MoE models (shared and routed experts,
dense first layers), tied embeddings, vision towers and projectors come out right only from the
module tree `from_pretrained` would build. On `meta` that tree costs no memory, so an estimate of
a 70B model runs on a laptop. Nothing is downloaded: the model is a local directory with a
`config.json`, the `config.json` itself, or the Hub id the script passes to `from_pretrained`
when that model is in the local Hugging Face cache (the snapshot `from_pretrained` would read).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from fsdp_offload_cfg.compat.model_init import after_init, kept_in_float32, meta_init
from fsdp_offload_cfg.estimate.inputs import EstimateError
from fsdp_offload_cfg.estimate.source import ModelSourceError, model_config_file
from fsdp_offload_cfg.layer_classes import wrapped_by_default


@dataclass(frozen=True)
class ModelSource:
    """Where the model came from: its config, and the safetensors files next to it (if any)."""

    path: str  # as the user gave it: a directory, a config.json or a Hub id
    config: Any  # transformers PretrainedConfig
    checkpoint_files: tuple[str, ...]
    folder: str  # the directory that holds the config.json (a Hub id's cached snapshot)


def read_model(path: str) -> ModelSource:
    """Read `path` (a model directory, a `config.json`, or a cached Hub id) without touching any weight."""
    config_file = model_config_file(path)
    from transformers import AutoConfig

    try:  # as the script's from_pretrained reads it (transformers 5 writes an infinite float as {"__float__": ...})
        config = AutoConfig.from_pretrained(config_file)
    except Exception as exc:  # any refusal of the file, said with its path, never a traceback
        raise ModelSourceError(f"{config_file}: transformers cannot build this config "
                               f"({type(exc).__name__}: {exc})") from exc
    folder = os.path.dirname(os.path.abspath(config_file))
    files = tuple(sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors")))
    return ModelSource(path, config, files, folder)


def model_class(config: Any) -> type[nn.Module]:
    """The class `from_pretrained` would instantiate: the config's first `architectures` entry,
    else the causal-LM (then image-text) auto class for its model type."""
    import transformers

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    for auto in ("AutoModelForCausalLM", "AutoModelForImageTextToText"):
        mapping = getattr(getattr(transformers, auto, None), "_model_mapping", None)
        if mapping is not None and type(config) in mapping:
            return mapping[type(config)]
    raise ModelSourceError(f"no transformers model class for model_type {config.model_type!r} "
                           f"(architectures: {getattr(config, 'architectures', None)})")


def build_on_meta(source: ModelSource, dtype: torch.dtype, load_dtype: torch.dtype | None = None,
                  cls: type[nn.Module] | None = None) -> nn.Module:
    """The model skeleton on `meta` in `dtype`, built as `from_pretrained` builds it (as `cls`,
    default the class `from_pretrained` would pick); the parameters `from_pretrained(dtype=
    load_dtype)` keeps in float32 (a MoE router gate in a bf16 model, transformers >= 5.24) stay
    float32, so their bytes are counted as the run holds them."""
    cls = cls or model_class(source.config)
    try:
        with meta_init(cls, dtype):
            model = cls(source.config)
    except Exception as exc:  # the user's model code (a backend it needs, a key it lacks), said
        raise ModelSourceError(f"{source.path}: transformers cannot build {cls.__name__} from its config "
                               f"({type(exc).__name__}: {str(exc).strip()})") from exc
    after_init(model)
    if hasattr(model, "tie_weights"):  # from_pretrained ties after loading; the init context does not
        model.tie_weights()
    model.to(device="meta")  # transformers 4.x leaves buffers on the CPU
    kept = kept_in_float32(model, load_dtype or dtype)
    for name, p in model.named_parameters():  # buffers keep their own dtype (RoPE's inv_freq stays fp32)
        if p.is_floating_point():
            p.data = p.data.to(torch.float32 if kept(name) else dtype)
    return model


class ModelBytes(NamedTuple):
    whole: int  # parameters and buffers, loaded whole
    shard: int  # rank 0's share once sharded over the ranks: each parameter's dim-0 shard, buffers whole


def sequence_classifier_bytes(source: ModelSource, dtype: torch.dtype, world: int = 1) -> ModelBytes:
    """The bytes of `source` loaded as `AutoModelForSequenceClassification` with one label in
    `dtype` (how TRL loads a reward model: the checkpoint's head, or a causal LM's body under a
    new one-row `score`), built on `meta`: no weight is read; its shard over `world` ranks."""
    import copy

    import transformers

    config = copy.copy(source.config)
    config.num_labels = 1
    mapping = transformers.AutoModelForSequenceClassification._model_mapping
    if type(config) not in mapping:
        raise ModelSourceError(f"{source.path}: transformers has no sequence-classification class for model_type "
                               f"{config.model_type!r}, which TRL loads a reward model as")
    return whole_model_bytes(ModelSource(source.path, config, source.checkpoint_files, source.folder), dtype,
                             mapping[type(config)], world)


def whole_model_bytes(source: ModelSource, dtype: torch.dtype, cls: type[nn.Module] | None = None,
                      world: int = 1) -> ModelBytes:
    """The bytes of `source` loaded in `dtype` (as `cls`, default the class `from_pretrained`
    picks), built on `meta`: no weight is read; and its shard over `world` ranks."""
    from fsdp_offload_cfg.estimate.states import shard_numel

    model = build_on_meta(source, dtype, dtype, cls)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    params = list(model.parameters())
    return ModelBytes(whole=buffers + sum(p.numel() * p.element_size() for p in params),
                      shard=buffers + sum(shard_numel(p.shape, world) * p.element_size() for p in params))


def layer_class_names(model: nn.Module, configured: tuple[str, ...] | None, source: str = "your config") -> list[str]:
    """The FSDP unit classes a run wraps: `transformer_layer_cls_to_wrap`, else the declared
    classes the model has (`layer_classes.default_layer_classes`: what the run's prepare
    wraps); a model whose list names only classes it lacks is refused as the run refuses it."""
    if configured:
        return list(configured)
    try:
        return wrapped_by_default(model, source).present
    except ValueError as error:
        raise EstimateError(str(error)) from None


def image_tokens_per_image(config: Any) -> int | None:
    """Placeholder tokens one image takes in a Llava-family prompt; None for other models.

    Llava replaces each image token by one projected patch feature: (image_size/patch_size)^2,
    plus the CLS feature under `vision_feature_select_strategy: full`; InternVL's pixel shuffle
    keeps `downsample_ratio`^2 of them.
    """
    vision = getattr(config, "vision_config", None)
    strategy = getattr(config, "vision_feature_select_strategy", None)
    if vision is None or strategy is None or _image_token_id(config) is None:
        return None
    (height, width), (patch_h, patch_w) = _pair(vision.image_size), _pair(vision.patch_size)
    patches = (height // patch_h) * (width // patch_w)
    ratio = getattr(config, "downsample_ratio", None)  # InternVL's pixel shuffle merges patches
    if ratio:
        patches = int(patches * ratio**2)
    return patches + (1 if strategy == "full" else 0)


def _pair(size: int | list[int]) -> tuple[int, int]:
    """A vision config's size: one int, or [height, width] (InternVL's)."""
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[-1]))


def _image_token_id(config: Any) -> int | None:
    for name in ("image_token_id", "image_token_index"):  # transformers 5 / 4 names
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


@dataclass(frozen=True)
class ExampleImage:
    """The image each sample of the estimate's batch carries."""

    tokens: int  # placeholder tokens it takes in the prompt
    pixels: tuple[int, ...]  # one sample's `pixel_values` shape
    sizes: tuple[int, int] | None = None  # its (height, width), for models that take `image_sizes`


def example_image(config: Any, model: nn.Module | None = None) -> ExampleImage | None:
    """The image of the estimate's batch; None where this model's image inputs are not modelled
    (then the batch is text only). An 'anyres' model's image needs the model: its tokens are
    counted by the model's own code (`_anyres_image`)."""
    if getattr(config, "image_grid_pinpoints", None):
        return _anyres_image(config, model) if model is not None else None
    per_image = image_tokens_per_image(config)
    if per_image is None:
        return None
    return ExampleImage(per_image, (3, *_pair(config.vision_config.image_size)))


def _anyres_image(config: Any, model: nn.Module) -> ExampleImage | None:
    """LLaVA-NeXT and LLaVA-OneVision ('anyres'): the processor tiles an image over
    `image_grid_pinpoints` by its size, and the model packs the tiles' features with a newline
    feature per row, so an image's token count depends on its size and on the model's packing
    (OneVision's differs from NeXT's). The example image is a square of the vision tower's own
    size; its tiles are counted by the model module's own `image_size_to_num_patches` and its
    tokens by one `get_image_features` call (on `meta`: no memory), so the count follows the model
    code of the installed transformers instead of a copy of it here."""
    from fsdp_offload_cfg.layer_classes import transformers_model

    pretrained = transformers_model(model)
    count_tiles = getattr(sys.modules.get(type(pretrained).__module__), "image_size_to_num_patches", None)
    if count_tiles is None or not hasattr(pretrained, "get_image_features"):
        return None
    side = config.vision_config.image_size
    size = _pair(side)
    tiles = count_tiles(image_size=size, grid_pinpoints=config.image_grid_pinpoints, patch_size=side)
    parameter = next(pretrained.parameters())
    pixels = torch.zeros(1, tiles, 3, *size, dtype=parameter.dtype, device=parameter.device)
    with torch.no_grad():
        out = pretrained.get_image_features(pixel_values=pixels, image_sizes=torch.tensor([size]),
                                            vision_feature_layer=config.vision_feature_layer,
                                            vision_feature_select_strategy=config.vision_feature_select_strategy)
    features = getattr(out, "pooler_output", out)  # transformers 5.2x: a model output; before: the features
    if isinstance(features, torch.Tensor):
        features = [features.reshape(-1, features.shape[-1])]
    return ExampleImage(sum(f.shape[0] for f in features), (tiles, 3, *size), size)


def example_batch(source: ModelSource, batch_size: int, seq_len: int, dtype: torch.dtype,
                  image: ExampleImage | None) -> dict[str, torch.Tensor]:
    """One training batch per rank: token ids on the CPU (real values, so masks and routing
    bookkeeping that reads them work), images on `meta`. A model with an `image`
    (`example_image`) gets one per sample at the start of the sequence, which needs `seq_len` to
    hold its placeholder tokens."""
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    if image is not None and image.tokens <= seq_len:
        ids[:, :image.tokens] = _image_token_id(source.config)
        batch["pixel_values"] = torch.empty(batch_size, *image.pixels, dtype=dtype, device="meta")
        if image.sizes is not None:
            batch["image_sizes"] = torch.tensor([image.sizes] * batch_size)
    return batch
