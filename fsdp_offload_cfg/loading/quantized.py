"""A quantized model under meta loading: refused before any rank reads, with the fix.

The loader builds each rank's model on `meta` and fills its shards at prepare from the
checkpoint's tensors. A quantized model's weights are not the checkpoint's tensors: transformers
makes them while it loads (bitsandbytes' 4-bit `Params4bit` with its quant state, torchao's
tensor subclasses, a GPTQ or FP8 layer's packed weights and scales), so no rank can build them
on meta and fill them later. Before this check, rank 0 loaded the whole model, quantizing every
layer (minutes for a 70B), and only then refused with "turn it off", naming no key.

Every rank decides from its own arguments and the checkpoint's config.json, the same on every
rank, so all refuse alike, before any collective and before any weight is read. Only methods that
always keep their weights quantized are refused so: a method whose config has a switch that
loads the weights plain (FP8's and MXFP4's `dequantize`, which transformers also turns on where
the kernels are missing; compressed-tensors' `run_compressed`) may give a plain model (gpt-oss's
MXFP4 checkpoint loaded with `dequantize=True`), which goes on as any load that cannot be read
slice by slice: rank 0 loads it whole and sends it, as before this check.
Where a load still comes out quantized, or config.json cannot be read here, `refusal` is said
after rank 0's load (`meta._summarize`), as before but in these words.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

from fsdp_offload_cfg.loading.local import LOCAL_LOADING_HINT

# the quantization configs' switches that load the weights plain: `dequantize` (FP8, MXFP4, GGUF),
# compressed-tensors' `run_compressed` (false: decompressed on load)
_PLAIN_SWITCHES = ("dequantize", "run_compressed")
# `from_pretrained` keywords that say where config.json is, passed on to read it as the load would
_CONFIG_LOOKUP = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")


def refuse_quantized(source: Any, kwargs: Mapping[str, Any], config_source: str) -> None:
    """Raise `NotImplementedError` where `from_pretrained(source, **kwargs)` loads a quantized
    model; `config_source`: where the config came from (the file, as a rule), for the fix."""
    how = quantization_of(source, kwargs)
    if how is not None:
        raise NotImplementedError(refusal(source, how, config_source))


def quantization_of(source: Any, kwargs: Mapping[str, Any]) -> str | None:
    """How the call quantizes, in words (`quantization_config=BitsAndBytesConfig (bitsandbytes)`,
    `the model config's quantization_config (gptq)`); None where it does not, where its method may
    load the weights plain (`_stays_quantized`), or where config.json cannot be read here (the load
    then reads it and says so itself)."""
    given = kwargs.get("quantization_config")
    if given is not None:
        named = "" if isinstance(given, Mapping) else f"={type(given).__name__}"
        return f"quantization_config{named} ({_method(given)})" if _stays_quantized(given) else None
    config = kwargs.get("config")
    if config is not None and not isinstance(config, (str, os.PathLike)):
        stored = getattr(config, "quantization_config", None)
    else:
        stored = _stored_quantization(config if config is not None else source, kwargs)
    if stored is None or not _stays_quantized(stored):
        return None
    return f"the model config's quantization_config ({_method(stored)})"


def refusal(source: Any, how: str, config_source: str | None = None) -> str:
    """The message: what cannot be done, why, and the setting that runs the model as without the
    plugin, in the file the config came from (`config_source`, where the caller knows it); and for
    a quantized model the run never prepares (a 4-bit teacher), the block that loads it whole
    without turning meta loading off for the model it trains."""
    where = ""
    if config_source:
        where = f" in {config_source}" if os.path.isfile(config_source) else f" (the config came from {config_source})"
    return (f"{source} loads quantized ({how}), which meta loading cannot build: each rank's model is built on meta "
            "and its shards filled at prepare from the checkpoint's tensors, while a quantized model's weights are "
            f"made by transformers as it loads. For this run set fsdp_cpu_ram_efficient_loading: false{where}: every "
            "rank then loads the model as transformers does, and accelerate's prepare shards it as without the plugin. "
            + LOCAL_LOADING_HINT)


def _method(quantization: Any) -> str:
    """The quantization's method (`bitsandbytes`, `fp8`, `gptq`), from a config object or its dict."""
    method = _field(quantization, "quant_method")
    return str(getattr(method, "value", method) or "method not named")


def _stays_quantized(quantization: Any) -> bool:
    """The method always keeps its weights quantized: its config class (transformers' own, by
    `quant_method`) has no switch that loads them plain, and none is on. A method transformers
    does not know is left to the load, which says so."""
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    if _field(quantization, "dequantize"):
        return False
    method = _method(quantization)
    config_class = AUTO_QUANTIZATION_CONFIG_MAPPING.get(method) or \
        AUTO_QUANTIZATION_CONFIG_MAPPING.get(f"{method}_4bit")  # bitsandbytes' two keys, by their bits
    if config_class is None:
        return False
    return not set(_PLAIN_SWITCHES) & set(inspect.signature(config_class.__init__).parameters)


def _field(quantization: Any, name: str) -> Any:
    return quantization.get(name) if isinstance(quantization, Mapping) else getattr(quantization, name, None)


def _stored_quantization(source: Any, kwargs: Mapping[str, Any]) -> Any:
    """config.json's `quantization_config` (a pre-quantized checkpoint quantizes without being
    asked), read as the load will read it; None where it has none or cannot be read."""
    if source is None:
        return None
    from transformers import PretrainedConfig

    lookup = {key: kwargs[key] for key in _CONFIG_LOOKUP if key in kwargs}
    try:
        config, _ = PretrainedConfig.get_config_dict(source, **lookup)
    except Exception:  # noqa: BLE001 - not found, offline, not a model: the load says it in its own words
        return None
    return config.get("quantization_config")
