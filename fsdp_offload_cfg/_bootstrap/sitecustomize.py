"""Put first on PYTHONPATH by `fsdp-offload-cfg run`: the `sitecustomize` this one shadows runs
first (a user's or a distribution's), then `fsdp_offload_cfg.autopatch.activate()`."""

import importlib.util
import os
import sys

# `autopatch.SWITCH` and `OFF_VALUES`, for a Python that cannot import the package
# (`tests/test_zero_code.py` checks they agree)
SWITCH = "FSDP_OFFLOAD_CFG_AUTOPATCH"
OFF_VALUES = ("", "0", "false", "no", "off")


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


def _stop_without_the_package(error: ModuleNotFoundError) -> None:
    """This folder is inherited by every Python the command starts, also one of another
    environment, which cannot import the package (a command from another venv or conda env, or
    the CLI installed on its own with pipx). Python would print "Error in sitecustomize" and run
    the script without the plugin the user asked for: one line and status 1 instead, as the
    `.pth` hook does."""
    if not (error.name or "").startswith("fsdp_offload_cfg"):
        raise error
    if os.environ.get(SWITCH, "").strip().lower() in OFF_VALUES:  # a process that turned it off: nothing to do
        return
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.stderr.write(
        f"[fsdp_offload_cfg] fsdp-offload-cfg run: {sys.executable} cannot import fsdp_offload_cfg, which is "
        f"installed at {package} for another Python; install fsdp-offload-cfg into the environment that runs "
        "the command (pip install fsdp-offload-cfg there), or run the command from the environment that has it\n")
    sys.stderr.flush()
    os._exit(1)


_run_shadowed()

try:
    from fsdp_offload_cfg.autopatch import activate  # after the shadowed one, which may set paths
except ModuleNotFoundError as missing:
    _stop_without_the_package(missing)
else:
    activate()
