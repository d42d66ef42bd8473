"""The set-up's installer (scripts/_pip.py): pip's settings, passed to uv as the flags that mean
the same, or pip itself where a setting has no such flag. The set-up builds every CI leg's venv
with it; these tests pin what it passes and that its pip path installs what it is asked to."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "_pip.py"
_spec = importlib.util.spec_from_file_location("setup_pip", SCRIPT)
setup_pip = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(setup_pip)

# `pip config list` on this project's machines, with CI's PIP_NO_CACHE_DIR and the newest leg's
# PIP_CONSTRAINT (which lifts the machine's cap on torch)
CONFIG_LIST = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.constraint='/dev/null'
:env:.default-timeout='180'
:env:.disable-pip-version-check='1'
:env:.find-links='/opt/wheels'
:env:.no-cache-dir='1'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
"""


def test_a_pip_variable_wins_over_the_install_section_over_global():
    settings = setup_pip.pip_settings(CONFIG_LIST + "install.find-links='/srv/a /srv/b'\ninstall.index-url='https://i'\n")
    assert settings["constraint"] == "/dev/null"  # PIP_CONSTRAINT over the file's
    assert settings["find-links"] == "/opt/wheels"  # PIP_FIND_LINKS over the install section
    assert settings["index-url"] == "https://i"  # the install section where nothing else sets it
    assert settings["extra-index-url"] == "file:///opt/pypi/simple file:///opt/pypi-more/simple"


def test_each_setting_reaches_uv_as_the_flag_or_variable_that_means_the_same():
    flags, env = setup_pip.uv_options(setup_pip.pip_settings(CONFIG_LIST))
    line = setup_pip.command_line(flags, ["-q", "torch"])
    assert line == ["--index-strategy", "unsafe-best-match",  # the highest version anywhere, as pip picks
                    "--constraint", "/dev/null", "--find-links", "/opt/wheels", "--no-cache",
                    "--extra-index-url", "file:///opt/pypi/simple", "--extra-index-url", "file:///opt/pypi-more/simple",
                    "-q", "torch"], line
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt", "UV_HTTP_TIMEOUT": "180"}


@pytest.mark.parametrize("given", [["--index-url", "https://mine"], ["-i", "https://mine"], ["--index-url=https://mine"]])
def test_an_index_on_the_command_line_wins_over_the_configured_one(given: list[str]):
    """TORCH_PIP_ARGS="--index-url ..." (the set-up's way to pick torch's own index) over a
    pip.conf index: uv takes `--index-url` once, and pip lets the command line win."""
    flags, _ = setup_pip.uv_options({"index-url": "https://configured", "find-links": "/opt/wheels"})
    line = setup_pip.command_line(flags, [*given, "torch"])
    assert "https://configured" not in line and line[-len(given) - 1:] == [*given, "torch"], line
    assert line[line.index("--find-links") + 1] == "/opt/wheels"  # the rest of the settings stay


@pytest.mark.parametrize("key", ["trusted-host", "proxy", "pre", "only-binary"])
def test_a_setting_uv_would_not_follow_means_pip_installs(key: str):
    reason = setup_pip.uv_options({"find-links": "/opt/wheels", key: "x"})
    assert reason == f"pip's setting `{key}` has no uv counterpart here"


def _wheel(folder: Path) -> Path:
    """A one-module wheel, built by hand: something to install with no index and no network."""
    path = folder / "tinypkg_for_setup-1.0-py3-none-any.whl"
    files = {"tinypkg_for_setup.py": "",
             "tinypkg_for_setup-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tinypkg-for-setup\nVersion: 1.0\n",
             "tinypkg_for_setup-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        zf.writestr("tinypkg_for_setup-1.0.dist-info/RECORD", "".join(f"{n},,\n" for n in files)
                    + "tinypkg_for_setup-1.0.dist-info/RECORD,,\n")
    return path


def _dry_run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    _wheel(tmp_path)
    return subprocess.run([sys.executable, str(SCRIPT), "install", "--dry-run", "--no-index", "--find-links",
                           str(tmp_path), "tinypkg-for-setup"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_with_a_setting_uv_would_not_follow_pip_installs_and_says_why(tmp_path: Path):
    proc = _dry_run(tmp_path, PIP_TRUSTED_HOST="example.org")
    assert proc.returncode == 0, proc.stderr
    assert "[setup] pip's setting `trusted-host` has no uv counterpart here: installing with pip" in proc.stderr
    assert "Would install tinypkg-for-setup-1.0" in proc.stdout, proc.stdout  # pip's own words


def test_uv_installs_with_the_machines_settings(tmp_path: Path):
    """The venvs the set-up builds have uv beside their Python (it installs it there first)."""
    if shutil.which("uv", path=os.path.dirname(sys.executable)) is None:
        pytest.skip("this venv was built before the set-up used uv: `rm -r` it and run scripts/test.sh to rebuild")
    proc = _dry_run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "[setup]" not in proc.stderr and "+ tinypkg-for-setup==1.0" in proc.stderr, proc.stderr  # uv's words
