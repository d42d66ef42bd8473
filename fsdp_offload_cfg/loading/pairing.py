"""Which load on rank 0 a load on another rank pairs with: the call itself, not its position.

Why: under "broadcast" a rank other than 0 builds its meta model from what rank 0's matching
call posted (config, dtypes, ties). Pairing the n-th load on each rank with rank 0's n-th load
broke as soon as rank 0 loaded something alone (an eval copy with `rms_norm_eps=0.5`): every
later pair was shifted and rank 1 silently took the other call's config. So a load pairs with
rank 0's load *of the same call*: class, checkpoint and every keyword argument that can change
the model (dtype, config overrides, revision, ...), digested the same way on every rank. Only
repeats of one identical call are told apart by their order.

What cannot be decided at load time (there is no collective in `from_pretrained`) is checked
when the model is prepared: every model the loader built carries its `LoadCall`; prepare
compares each rank's with rank 0's in its first agreement step and raises on every rank, naming
both calls, when they are not the same call. Repeats of one call paired out of order (rank 0
loaded the same checkpoint alone first) give the same model, so they only get a warning.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

# Keyword arguments that change where or how files are fetched or placed, never the model built.
_NOT_SHAPING = frozenset(
    {
        "device_map", "max_memory", "offload_folder", "offload_buffers", "offload_state_dict", "proxies",
        "tqdm_class", "_commit_hash", "_from_auto", "_from_pipeline", "cache_dir", "token", "use_auth_token",
        "force_download", "local_files_only", "resume_download", "low_cpu_mem_usage", "_fast_init",
        "trust_remote_code", "mirror",
    }
)  # fmt: skip
_MAX_SHOWN = 60  # characters of one argument in a message


@dataclass(frozen=True)
class LoadCall:
    """One load as every rank can name it: a readable description and a digest of what shapes it."""

    description: str  # e.g. "LlamaForCausalLM.from_pretrained('/ckpt', config=LlamaConfig(...))"
    arguments: str  # the shaping arguments, canonically written (JSON): what the digest is of
    digest: str  # sha1 of the class, the method and `arguments`
    repeat: int | None = None  # how many identical calls this rank made before (broadcast pairing); None: unpaired


def load_call(cls: type, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> LoadCall:
    """The `LoadCall` of `cls.method(*args, **kwargs)`. (Auto classes hand `from_pretrained` a
    `config=` that already holds keyword overrides such as `rms_norm_eps=0.5`: the config's
    values are part of the digest, so such overrides are too.)"""
    shaping = {k: v for k, v in sorted(kwargs.items()) if k not in _NOT_SHAPING}
    arguments = json.dumps({"args": [_canonical(a) for a in args], **{k: _canonical(v) for k, v in shaping.items()}},
                           sort_keys=True)  # fmt: skip
    shown = [_shown(a) for a in args] + [f"{k}={_shown(v)}" for k, v in shaping.items() if not _unset(v)]
    description = f"{cls.__name__}.{method}({', '.join(shown)})"
    whole = f"{cls.__module__}.{cls.__qualname__}.{method}:{arguments}"
    return LoadCall(description, arguments, hashlib.sha1(whole.encode()).hexdigest())


def _canonical(value: Any) -> Any:
    """A JSON-able form of an argument that is the same on every rank for the same meaning."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.Tensor):  # e.g. a `state_dict=` argument: its layout, not its bytes
        return [str(value.dtype), list(value.shape)]
    to_json = getattr(value, "to_json_string", None)  # a config object
    if callable(to_json):
        try:
            return json.loads(to_json(use_diff=False))
        except TypeError:
            return json.loads(to_json())
    to_dict = getattr(value, "to_dict", None)  # quantization configs and the like
    if callable(to_dict):
        return _canonical(to_dict())
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _unset(value: Any) -> bool:
    """None, or a mapping of Nones (transformers' own `adapter_kwargs={'revision': None}`)."""
    return value is None or (isinstance(value, dict) and all(v is None for v in value.values()))


def _shown(value: Any) -> str:
    if callable(getattr(value, "to_json_string", None)):  # a config: its differences are shown separately
        return f"{type(value).__name__}(...)"
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where two canonical argument trees differ, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for key in sorted(a.keys() | b.keys()) for d in _differences(a.get(key), b.get(key),
                                                                                f"{path}.{key}" if path else key)]
    if a == b:
        return []
    return [f"{path}: {_shown(a)} vs {_shown(b)}"]


def pair_problem(own: LoadCall | None, rank0: LoadCall | None, rank: int) -> str | None:
    """Why this rank's model cannot be prepared together with rank 0's (None: it can)."""
    if own is None or rank0 is None or own.digest == rank0.digest:
        return None
    differ = _differences(json.loads(own.arguments), json.loads(rank0.arguments))
    shown = "; ".join(differ[:5]) + (f"; ... ({len(differ) - 5} more)" if len(differ) > 5 else "")
    return (
        f"rank {rank} prepares the model of {own.description}, rank 0 the model of {rank0.description}, "
        f"which differ in {shown or 'the class or method'} (rank {rank}'s value first): every rank must "
        "prepare the model of the same call. A model only some ranks use (an eval copy, a teacher) belongs "
        "inside `with fsdp_offload_cfg.local_loading():`"
    )


def repeat_shift(own: LoadCall | None, rank0: LoadCall | None) -> bool:
    """The same call, but paired with another repeat of it (rank 0 made it alone before)."""
    return (own is not None and rank0 is not None and own.digest == rank0.digest
            and None not in (own.repeat, rank0.repeat) and own.repeat != rank0.repeat)  # fmt: skip
