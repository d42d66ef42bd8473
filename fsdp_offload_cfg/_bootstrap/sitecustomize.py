"""Put first on PYTHONPATH by `fsdp-offload-cfg run`: the `sitecustomize` this one shadows runs
first (a user's or a distribution's), then `fsdp_offload_cfg.autopatch.activate()`."""

import importlib.util
import os
import sys


def _run_shadowed() -> None:
    """The next `sitecustomize.py` on `sys.path` after this folder, if any."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_fsdp_offload_cfg_shadowed_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_run_shadowed()

from fsdp_offload_cfg.autopatch import activate  # noqa: E402 - after the shadowed one, which may set paths

activate()
