"""Zero-code activation: `patch()` first thing in every Python process a command starts.

For the framework CLIs people launch (`swift sft`, `llamafactory-cli train`, `trl sft`, `axolotl
train`, `accelerate launch train.py`) there is no line of user code to put `patch()` in. Two
entries, as `ddtrace-run` / `opentelemetry-instrument` and `coverage` do it:

- `fsdp-offload-cfg run [--config F] -- COMMAND ...` sets the switch below and puts the
  `_bootstrap` folder first on `PYTHONPATH`; its `sitecustomize.py` calls `activate()` and then
  the `sitecustomize` it shadows, if any. Every Python process the command starts (launchers,
  torchrun workers, the framework's own subprocesses) inherits both.
- `fsdp-offload-cfg install-hook` writes a `.pth` line into site-packages that imports this module
  only when `FSDP_OFFLOAD_CFG_AUTOPATCH` is set, for launchers the user does not control.

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
_TRUE = ("1", "true", "yes", "on")
# commands that only start other processes (matched on the script or module name)
_LAUNCHERS = ("torchrun", "accelerate-launch", "torch.distributed.run", "torch.distributed.launch")


def requested(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    return environ.get(SWITCH, "").strip().lower() in _TRUE


def is_launcher(argv: list[str]) -> bool:
    """`accelerate launch ...`, `torchrun ...`, `python -m torch.distributed.run ...` (the full
    command line: `sys.orig_argv`, which is all there is while `sitecustomize` runs)."""
    words = [os.path.basename(a) for a in argv[1:4]]
    if any(w in _LAUNCHERS for w in words):
        return True
    return "accelerate" in words and "launch" in argv[1:5]


def activate() -> None:
    """`patch()` (config discovery as usual) when the switch is set and this is not a launcher;
    on any failure print it, rank-prefixed, and end the process with status 1."""
    if not requested() or is_launcher(list(getattr(sys, "orig_argv", sys.argv))):
        return
    try:
        import fsdp_offload_cfg

        fsdp_offload_cfg.patch()
    except BaseException as exc:  # noqa: BLE001 - Python would swallow it and train without the plugin
        rank = os.environ.get("RANK", "0")
        kind = "invalid config" if type(exc).__name__ == "ConfigError" else type(exc).__name__
        print(f"[fsdp_offload_cfg rank {rank}] {kind}, stopping before anything runs "
              f"({SWITCH} is set):\n{exc}", file=sys.stderr)  # fmt: skip
        sys.stderr.flush()
        os._exit(1)


PTH_LINE = f"import os; os.environ.get({SWITCH!r}) and __import__('fsdp_offload_cfg.autopatch').autopatch.activate()\n"
PTH_NAME = "fsdp_offload_cfg_autopatch.pth"
