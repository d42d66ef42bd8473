"""`pip install` / `pip uninstall` for the set-up scripts, done by uv where pip's settings allow.

Why: building a venv is the set-up's longest wait, and a tenth of CI's. uv resolves and unpacks
in parallel: the axolotl-plugin leg's venv (axolotl 0.19, 244 packages) took 131 s with pip and
42 s with uv on this project's idle 2-core machine, the same versions from the same files
(docs/compatibility.md, runs 53 and 54).

Why not uv alone: uv reads none of pip's configuration, and that configuration is how a machine
says where its packages come from (a private index, wheels on disk, a constraints file: this
project's machines keep the CPU build of torch in a find-links folder, cap torch with a
constraints file and add two local indexes). So pip's own settings (`pip config list`: its files
and PIP_* variables, merged as pip merges them) are passed to uv as the flags that mean the same.

Where pip and uv choose differently, and what is done about it:
- pip takes the highest version from all sources together; uv, by default, from the first index
  that has the package: `--index-strategy unsafe-best-match` makes it pip's way.
- For one version found on several indexes, pip takes the file whose tags fit this Python best,
  from any of them; uv takes the first index's files only, and ranks `--extra-index-url` before
  `--index-url`. This machine's first extra index holds `multiprocess` 0.70.19 for Python 3.10
  only, beside PyPI's file for 3.11: uv installed the 3.10 one, and `axolotl train` failed
  (`fork_exec() takes exactly 23 arguments`, run 53). So the indexes go to uv in
  pip's order of trust: pip's `index-url` (PyPI unless set) first, then the extra ones.
- A pip setting with no uv flag here, or a venv where uv cannot be had, installs with pip,
  saying why: slower, the same packages.

The CPU build of torch: on Linux, PyPI's torch is the CUDA build, about 3 GB with the nvidia-*
wheels it pulls, for a set-up that runs on the CPU. PyTorch publishes the CPU build of each release
(`X+cpu`) on its own index. `torch-args torch==X` says how to ask for it: as given where the
sources pip is set to use already have `X+cpu` (this project's machines keep it on disk) or off
Linux (PyPI's torch is the CPU build there), else `X+cpu` with PyTorch's CPU index added.

Usage (in the venv's Python): `python scripts/_pip.py install|uninstall ARGS...`, ARGS as pip takes
them (the set-up passes -q, -e, --no-index, --find-links, --upgrade, --extra-index-url and
TORCH_PIP_ARGS); `python scripts/_pip.py torch-args torch==X` prints those for torch.
"""

from __future__ import annotations

import ast
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

PYPI = "https://pypi.org/simple"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # PyTorch's index of its CPU builds
# pip setting -> the environment variable uv reads for it
_AS_ENV = {"cert": "SSL_CERT_FILE", "default-timeout": "UV_HTTP_TIMEOUT", "timeout": "UV_HTTP_TIMEOUT"}
# settings that change how pip runs, not what it installs, or that uv already does its own way
_NOT_ABOUT_WHAT = {"disable-pip-version-check", "no-compile", "compile", "progress-bar", "root-user-action",
                   "quiet", "verbose", "no-input", "no-warn-script-location", "cache-dir", "retries",
                   "no-color", "require-virtualenv",
                   "config-file"}  # where the settings come from: `pip config list` has read it
_TRUE = {"1", "true", "yes", "on"}


@dataclass
class Sources:
    """Where pip would look, from its settings: what uv is told."""

    index: str = PYPI  # pip's index-url
    extra_indexes: list[str] = field(default_factory=list)
    find_links: list[str] = field(default_factory=list)
    constraints: list[str] = field(default_factory=list)
    no_index: bool = False
    no_cache: bool = False
    env: dict[str, str] = field(default_factory=dict)  # uv's variables for pip's cert and timeout


def pip_settings(config_list: str) -> dict[str, str]:
    """`pip config list` (lines `section.key='value'`) as one value a key, as pip would use it for
    `install`: a PIP_* variable (section `:env:`) over the `install` section over `global`."""
    ranked: dict[str, tuple[int, str]] = {}
    rank = {"global": 0, "install": 1, ":env:": 2}
    for line in config_list.splitlines():
        name, sep, value = line.partition("=")
        section, _, key = name.rpartition(".")
        if not sep or section not in rank:
            continue
        if key not in ranked or rank[section] >= ranked[key][0]:
            ranked[key] = (rank[section], ast.literal_eval(value))
    return {key: value for key, (_, value) in ranked.items()}


def sources(settings: dict[str, str]) -> Sources | str:
    """pip's settings as uv will be told them, or why they cannot be (then pip installs)."""
    found = Sources()
    for key, value in settings.items():
        if key == "index-url":
            found.index = value
        elif key in ("extra-index-url", "find-links", "constraint"):
            {"extra-index-url": found.extra_indexes, "find-links": found.find_links,
             "constraint": found.constraints}[key].extend(value.split())  # split on whitespace, as pip does
        elif key in _AS_ENV:
            found.env[_AS_ENV[key]] = value
        elif key == "no-cache-dir":  # pip takes any value of PIP_NO_CACHE_DIR as "no cache" (kept)
            found.no_cache = True
        elif key == "no-index":
            found.no_index = value.lower() in _TRUE
        elif key not in _NOT_ABOUT_WHAT:
            return f"pip's setting `{key}` has no uv counterpart here"
    return found


def command_line(found: Sources, args: list[str]) -> list[str]:
    """uv's flags, then the command's own arguments. An index the command gives (`-i`,
    `--index-url`: TORCH_PIP_ARGS) replaces pip's index-url, as on pip's command line; an
    `--extra-index-url` it gives goes after the configured ones, as pip appends it to them."""
    index, extra, rest, i = found.index, list(found.extra_indexes), [], 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        if name in ("-i", "--index-url", "--extra-index-url") and not eq:
            value, i = args[i + 1], i + 1
        if name in ("-i", "--index-url"):
            index = value
        elif name == "--extra-index-url":
            extra.append(value)
        else:
            rest.append(args[i])
        i += 1
    flags = ["--index-strategy", "unsafe-best-match"]
    for url in (index, *extra):  # earlier first: pip's own index before the extra ones
        flags += ["--index", url]
    flags += ["--default-index", index]  # or uv would add PyPI behind them, which pip would not ask
    for path in found.find_links:
        flags += ["--find-links", path]
    for path in found.constraints:
        flags += ["--constraint", path]
    flags += ["--no-index"] * (found.no_index and "--no-index" not in rest) + ["--no-cache"] * found.no_cache
    return flags + rest


def torch_request(spec: str, system: str, no_index: bool, sources_have: Callable[[str], bool]) -> list[str]:
    """The install arguments that ask for `spec` (the set-up's `torch==X`) as the CPU build: see the
    module's docstring. `no_index`: pip is set to read no index (then no index is added);
    `sources_have(requirement)`: whether pip's sources can install it."""
    name, _, release = spec.partition("==")
    if system != "Linux" or no_index or name != "torch" or not release or "+" in release:
        return [spec]
    cpu = f"torch=={release}+cpu"
    return [spec] if sources_have(cpu) else ["--extra-index-url", CPU_INDEX, cpu]


def _uv() -> str | None:
    """The venv's uv, installed into it by pip (with pip's settings) the first time."""
    found = shutil.which("uv", path=os.path.dirname(sys.executable))
    if found is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "uv"], check=False)
        found = shutil.which("uv", path=os.path.dirname(sys.executable))
    return found


def _settings() -> dict[str, str] | None:
    """pip's settings for `install` in this venv (None where `pip config list` fails)."""
    config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    return pip_settings(config.stdout) if config.returncode == 0 else None


def _installer(command: str, args: list[str], settings: dict[str, str] | None) -> tuple[list[str], dict[str, str]]:
    """The command line (and environment) that runs pip's `command` with `args`: uv's where pip's
    `settings` allow, else pip's, saying why."""
    found = sources(settings) if settings is not None else "`pip config list` failed"
    uv = None if isinstance(found, str) else _uv()
    if isinstance(found, str) or uv is None:
        reason = found if isinstance(found, str) else "uv could not be installed"
        print(f"[setup] {reason}: installing with pip (slower, the same packages)", file=sys.stderr)
        return [sys.executable, "-m", "pip", command, *args], dict(os.environ)
    # uninstall: uv asks nothing, and takes no index flags
    line = [a for a in args if a not in ("-y", "--yes")] if command == "uninstall" else command_line(found, args)
    return [uv, "pip", command, "--python", sys.executable, *line], {**os.environ, **found.env}


def _sources_have(requirement: str, settings: dict[str, str] | None) -> bool:
    """Whether pip's sources can install `requirement`: a dry run into an empty folder (what the
    venv has already is not a source), its output kept back."""
    with tempfile.TemporaryDirectory() as empty:
        line, env = _installer("install", ["--dry-run", "--no-deps", "-q", "--target", empty, requirement], settings)
        return subprocess.run(line, env=env, capture_output=True).returncode == 0


def main(argv: list[str]) -> int:
    command, args, settings = argv[0], argv[1:], _settings()
    if command == "torch-args":
        no_index = (settings or {}).get("no-index", "").lower() in _TRUE
        request = torch_request(args[0], platform.system(), no_index, lambda req: _sources_have(req, settings))
        if CPU_INDEX in request:
            print(f"[setup] no CPU build of {args[0]} in pip's sources (PyPI's is the CUDA build on Linux, about "
                  f"3 GB): {request[-1]} from {CPU_INDEX} (TORCH_SPEC and TORCH_PIP_ARGS choose otherwise)",
                  file=sys.stderr)
        print(" ".join(request))
        return 0
    line, env = _installer(command, args, settings)
    return subprocess.run(line, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
