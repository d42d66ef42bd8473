"""TRL's defaults that differ between the TRL versions this package supports (0.24 to 1.16),
as the installed TRL has them: the one place those version differences live. Without TRL
installed (an estimate on a laptop), the newest's.

Read from TRL's own code at each version (`pip download --no-deps trl==X`, checked against the
installed TRL by `tests/test_launch_command.py`):
- the dtype a trainer loads a model given by name in, where `model_init_kwargs` names none
  (`create_model_from_path`): float32 from 0.27; 0.26 passes "auto"; 0.24 and 0.25 pass nothing,
  transformers' own default (5.x: the checkpoint's);
- GRPO's and RLOO's `vllm_mode` where `use_vllm` is on and the mode unset: `colocate` from 1.0
  (vLLM in the training processes, on their GPUs), `server` before (a server on GPUs of its own).
"""

from __future__ import annotations

from importlib import metadata


def _installed() -> tuple[int, int] | None:
    """The installed TRL's (major, minor); None where it is not installed."""
    from packaging.version import Version

    try:
        release = Version(metadata.version("trl")).release
    except metadata.PackageNotFoundError:
        return None
    return release[0], release[1] if len(release) > 1 else 0


def named_model_dtype() -> str | None:
    """The dtype a TRL trainer loads a model given by name in; None: the checkpoint's own (the
    estimate's default)."""
    installed = _installed()
    return "float32" if installed is None or installed >= (0, 27) else None


def vllm_mode() -> str:
    """GRPO's and RLOO's `vllm_mode` unset."""
    installed = _installed()
    return "colocate" if installed is None or installed >= (1, 0) else "server"
