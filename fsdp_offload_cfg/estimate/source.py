"""Where the model's `config.json` is, and what it says, read without torch or transformers.

A model that is not there (a path mistyped, a Hub id not in the cache) is the estimate's most
common first error; found here, it is said in the second a `validate` takes instead of after the
seconds torch's import costs (`estimate/model.py` builds the model from what this reads).
"""

from __future__ import annotations

import json
import os


class ModelSourceError(ValueError):
    """The model path cannot be read as a transformers config; the message names the path."""


def _cached_config_file(repo_id: str) -> str | None:
    """The cached `config.json` of Hub model `repo_id` (its `main` snapshot), or None when the
    cache has none or `repo_id` is not a Hub id. Only the cache is read: the estimate runs offline."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except (HFValidationError, ValueError):
        return None
    return found if isinstance(found, str) else None


def _config_file(path: str) -> str:
    """`path`'s config.json: in the directory, the file itself, or the cached Hub snapshot."""
    if os.path.isdir(path):
        return os.path.join(path, "config.json")
    if os.path.exists(path) or os.path.isabs(path) or path.startswith("."):
        return path
    cached = _cached_config_file(path)
    if cached is None:
        raise ModelSourceError(f"{path}: no such file or directory, and no model {path!r} in the local Hugging Face "
                               "cache (nothing is downloaded); pass a model directory with a config.json, or fetch "
                               f"the config first: hf download {path} config.json")
    return cached


def model_config_file(path: str) -> str:
    """`path`'s config.json (a model directory, the file itself, or a cached Hub id), checked to
    be a transformers config: JSON that names a `model_type`."""
    config_file = _config_file(path)
    try:
        with open(config_file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"{config_file}: cannot read the model config ({exc}); pass a model directory "
                               "with a config.json, or the config.json itself") from exc
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelSourceError(f"{config_file}: no 'model_type' key; is this a transformers config.json?")
    return config_file
