"""`pip install` / `pip uninstall` for the set-up scripts, done by uv where pip's settings allow.

Why: building a venv is the set-up's longest wait and a sixth of CI's time. uv resolves and
unpacks in parallel: axolotl's venv took 131 s with pip and 42 s with uv on this project's 2-core
machine, the same 244 packages at the same versions (docs/compatibility.md, run 53).

Why not uv alone: uv reads none of pip's configuration, and that configuration is how a machine
says where its packages come from (a private index, wheels on disk, a constraints file: this
project's machines keep the CPU build of torch in a find-links folder and cap torch with a
constraints file). So pip's own settings (`pip config list`: its files and PIP_* variables, the
same merge pip does) are passed to uv as the flags that mean the same thing, and uv chooses
among all sources as pip does (`--index-strategy unsafe-best-match`: the highest version
anywhere, not the first source that has the package). A setting with no such flag here, or a
venv where uv cannot be had, installs with pip instead, saying why: slower, never different.

Usage (in the venv's Python): `python scripts/_pip.py install|uninstall ARGS...`, ARGS as pip takes
them (the set-up passes -q, -e, --no-index, --find-links, --upgrade and TORCH_PIP_ARGS).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

# pip setting -> the uv flag that means the same; the value is split on whitespace as pip splits it
_AS_FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
             "find-links": "--find-links", "constraint": "--constraint"}
# pip setting -> the environment variable uv reads for it
_AS_ENV = {"cert": "SSL_CERT_FILE", "default-timeout": "UV_HTTP_TIMEOUT", "timeout": "UV_HTTP_TIMEOUT"}
# settings that change how pip runs, not what it installs, or that uv already does its own way
_NOT_ABOUT_WHAT = {"disable-pip-version-check", "no-compile", "compile", "progress-bar", "root-user-action",
                   "quiet", "verbose", "no-input", "no-warn-script-location", "cache-dir", "retries",
                   "no-color", "require-virtualenv"}
_TRUE = {"1", "true", "yes", "on"}
_ONE_VALUE = {"--index-url", "--no-index", "--index-strategy"}  # flags uv takes once


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


def uv_options(settings: dict[str, str]) -> tuple[list[tuple[str, str | None]], dict[str, str]] | str:
    """uv's flags (flag, value or None) and environment for pip's settings, or why there are none
    (a setting uv would not follow the same way: then pip installs)."""
    flags: list[tuple[str, str | None]] = [("--index-strategy", "unsafe-best-match")]
    env: dict[str, str] = {}
    for key, value in settings.items():
        if key in _AS_FLAGS:
            flags += [(_AS_FLAGS[key], item) for item in value.split()]
        elif key in _AS_ENV:
            env[_AS_ENV[key]] = value
        elif key == "no-cache-dir":  # pip takes any value of PIP_NO_CACHE_DIR as "no cache" (kept)
            flags.append(("--no-cache", None))
        elif key == "no-index":
            flags += [("--no-index", None)] if value.lower() in _TRUE else []
        elif key not in _NOT_ABOUT_WHAT:
            return f"pip's setting `{key}` has no uv counterpart here"
    return flags, env


def command_line(flags: list[tuple[str, str | None]], args: list[str]) -> list[str]:
    """The settings' flags, then the command's own arguments; a one-value flag the command gives
    too is the command's, as with pip (`TORCH_PIP_ARGS="--index-url ..."` over a configured index)."""
    given = {"--index-url" if a == "-i" else a.split("=")[0] for a in args}
    kept = [(flag, value) for flag, value in flags if not (flag in _ONE_VALUE and flag in given)]
    return [part for flag, value in kept for part in (flag, value) if part is not None] + args


def _uv() -> str | None:
    """The venv's uv, installed into it by pip (with pip's settings) the first time."""
    found = shutil.which("uv", path=os.path.dirname(sys.executable))
    if found is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "uv"], check=False)
        found = shutil.which("uv", path=os.path.dirname(sys.executable))
    return found


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    options = uv_options(pip_settings(config.stdout)) if config.returncode == 0 else "`pip config list` failed"
    uv = None if isinstance(options, str) else _uv()
    if isinstance(options, str) or uv is None:
        reason = options if isinstance(options, str) else "uv could not be installed"
        print(f"[setup] {reason}: installing with pip (slower, the same packages)", file=sys.stderr)
        return subprocess.run([sys.executable, "-m", "pip", command, *args]).returncode
    flags, env = options
    if command == "uninstall":  # uv asks nothing, and takes no index flags
        flags, args = [], [a for a in args if a not in ("-y", "--yes")]
    return subprocess.run([uv, "pip", command, "--python", sys.executable, *command_line(flags, args)],
                          env={**os.environ, **env}).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
