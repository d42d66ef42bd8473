"""Zero-code activation: `patch()` first thing in every Python process a command starts.

For the framework CLIs people launch (`swift sft`, `llamafactory-cli train`, `trl sft`, `axolotl
train`, `accelerate launch train.py`) there is no line of user code to put `patch()` in. Two
entries, as `ddtrace-run` / `opentelemetry-instrument` and `coverage` do it:

- `fsdp-offload-cfg run [--config F] -- COMMAND ...` sets the switch below and puts the
  `_bootstrap` folder first on `PYTHONPATH`; its `sitecustomize.py` calls `activate()` and then
  the `sitecustomize` it shadows, if any. Every Python process the command starts (launchers,
  torchrun workers, the framework's own subprocesses) inherits both.
- `fsdp-offload-cfg install-hook` writes a `.pth` line into site-packages that imports this module
  only when `FSDP_OFFLOAD_CFG_AUTOPATCH` is on, for launchers the user does not control. The line
  is listed in the package's installed RECORD, so `pip uninstall fsdp-offload-cfg` removes it
  with the package; a line left behind anyway (another folder, a package removed by hand) stops
  a process that has the switch on with one line saying so, and does nothing without it.

The switch takes 1, true, yes, on (any case) to turn the plugin on and 0, false, no, off or
nothing to leave it off; any other value is a mistake that stops the process naming the variable,
since guessing either way would train in a way the user did not ask for.

Launcher processes (`accelerate launch`, `torchrun`) are skipped: they start the ranks and never
build a model, and a patch there would only export its variables ahead of the launcher's own.
Python swallows exceptions raised in `sitecustomize` and `.pth` lines ("Error in sitecustomize")
and goes on, which would train without the plugin and exit 0: any failure here ends the process
with status 1, the problem on stderr prefixed with the rank.
"""

from __future__ import annotations

import os
import sys

SWITCH = "FSDP_OFFLOAD_CFG_AUTOPATCH"
ON_VALUES = ("1", "true", "yes", "on")
OFF_VALUES = ("", "0", "false", "no", "off")
# commands that only start other processes (matched on the script or module name)
_LAUNCHERS = ("torchrun", "accelerate-launch", "torch.distributed.run", "torch.distributed.launch")


class SwitchError(ValueError):
    """The switch holds a value that is neither on nor off."""


def requested(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether the switch is on; SwitchError naming the variable for a value that is neither."""
    value = environ.get(SWITCH, "")
    if value.strip().lower() in ON_VALUES:
        return True
    if value.strip().lower() in OFF_VALUES:
        return False
    raise SwitchError(f"{SWITCH}={value!r} is neither on ({', '.join(ON_VALUES)}) nor off "
                      f"({', '.join(v for v in OFF_VALUES if v)}, or unset): set one of those")


def is_launcher(argv: list[str]) -> bool:
    """`accelerate launch ...`, `torchrun ...`, `python -m torch.distributed.run ...` (the full
    command line: `sys.orig_argv`, which is all there is while `sitecustomize` runs)."""
    words = [os.path.basename(a) for a in argv[1:4]]
    if any(w in _LAUNCHERS for w in words):
        return True
    return "accelerate" in words and "launch" in argv[1:5]


def activate() -> None:
    """`patch()` (config discovery as usual) when the switch is on and this is not a launcher;
    on any failure (a switch value that is neither on nor off included) print it, rank-prefixed,
    and end the process with status 1."""
    try:
        if not requested() or is_launcher(list(getattr(sys, "orig_argv", sys.argv))):
            return
        import fsdp_offload_cfg

        fsdp_offload_cfg.patch()
    except BaseException as exc:  # noqa: BLE001 - Python would swallow it and train without the plugin
        rank = os.environ.get("RANK", "0")
        if isinstance(exc, SwitchError):
            print(f"[fsdp_offload_cfg rank {rank}] {exc}", file=sys.stderr)
        else:
            kind = "invalid config" if type(exc).__name__ == "ConfigError" else type(exc).__name__
            print(f"[fsdp_offload_cfg rank {rank}] {kind}, stopping before anything runs "
                  f"({SWITCH} is set):\n{exc}", file=sys.stderr)  # fmt: skip
        sys.stderr.flush()
        os._exit(1)


PTH_NAME = "fsdp_offload_cfg_autopatch.pth"

# What the `.pth` line runs once the switch is not off: Python swallows an exception from a `.pth`
# line (two tracebacks, then the process goes on without the plugin), so a package that is gone
# is one line and status 1 instead.
_PTH_BODY = """try:
    import fsdp_offload_cfg.autopatch as autopatch
except ModuleNotFoundError as error:
    if not (error.name or '').startswith('fsdp_offload_cfg'):
        raise
    import sys
    sys.stderr.write('[fsdp_offload_cfg] {switch} is set but fsdp_offload_cfg is not installed for '
                     + sys.executable + '; remove the hook it left, ' + {path} + ', or unset {switch}\\n')
    os._exit(1)
autopatch.activate()
"""


def pth_line(path: str) -> str:
    """The one line of the hook at `path`: reads the switch itself, and imports nothing while it is
    off (unset, 0, false, no, off), so that every other Python process starts as before."""
    body = _PTH_BODY.format(switch=SWITCH, path=repr(path))
    return (f"import os; os.environ.get({SWITCH!r}, '').strip().lower() not in {OFF_VALUES!r} "
            f"and exec({body!r})\n")
