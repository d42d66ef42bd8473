"""The set-up's installer (scripts/_pip.py): pip's settings, passed to uv as the flags that mean
the same, or pip itself where a setting has no such flag. The set-up builds every CI leg's venv
with it; these tests pin what it passes and that its pip path installs what it is asked to."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "_pip.py"
_spec = importlib.util.spec_from_file_location("setup_pip", SCRIPT)
setup_pip = sys.modules["setup_pip"] = importlib.util.module_from_spec(_spec)  # a dataclass looks itself up there
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
    found = setup_pip.sources(setup_pip.pip_settings(CONFIG_LIST))
    line = setup_pip.command_line(found, ["-q", "torch"])
    assert line == ["--index-strategy", "unsafe-best-match",  # the highest version anywhere, as pip picks
                    # pip's own index first (PyPI, unset), then the extra ones, and nothing behind them
                    "--index", "https://pypi.org/simple", "--index", "file:///opt/pypi/simple",
                    "--index", "file:///opt/pypi-more/simple", "--default-index", "https://pypi.org/simple",
                    "--find-links", "/opt/wheels", "--constraint", "/dev/null", "--no-cache", "-q", "torch"], line
    assert found.env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt", "UV_HTTP_TIMEOUT": "180"}


@pytest.mark.parametrize("given", [["--index-url", "https://mine"], ["-i", "https://mine"], ["--index-url=https://mine"]])
def test_an_index_on_the_command_line_wins_over_the_configured_one(given: list[str]):
    """TORCH_PIP_ARGS="--index-url ..." (the set-up's way to pick torch's own index) over a
    pip.conf index, as on pip's command line; the extra indexes stay behind it."""
    found = setup_pip.sources({"index-url": "https://configured", "extra-index-url": "https://extra"})
    line = setup_pip.command_line(found, [*given, "torch"])
    assert "https://configured" not in line and line[-1] == "torch", line
    assert line[2:8] == ["--index", "https://mine", "--index", "https://extra", "--default-index", "https://mine"], line


@pytest.mark.parametrize("key", ["trusted-host", "proxy", "pre", "only-binary"])
def test_a_setting_uv_would_not_follow_means_pip_installs(key: str):
    reason = setup_pip.sources({"find-links": "/opt/wheels", key: "x"})
    assert reason == f"pip's setting `{key}` has no uv counterpart here"


def _wheel(folder: Path, tag: str = "py3", text: str = "", name: str = "tinypkg_for_setup", version: str = "1.0") -> Path:
    """A one-module wheel, built by hand (tagged `TAG-none-any`, its module holding `text`):
    something to install with no network."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-{tag}-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}.py": text,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n",
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: {tag}-none-any\n"}
    with zipfile.ZipFile(path, "w") as zf:
        for member, content in files.items():
            zf.writestr(member, content)
        zf.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n")
    return path


def _index(root: Path, *wheels: tuple[str, str], name: str = "tinypkg_for_setup", versions: tuple[str, ...] = ()) -> str:
    """A simple-API index on disk (as this machine's /opt/pypi) serving wheels (tag, module text),
    of `versions` where given (one a wheel), else 1.0."""
    page = root / "simple" / name.replace("_", "-") / "index.html"
    page.parent.mkdir(parents=True)
    links = [_wheel(root / "files", tag, text, name, version).name
             for (tag, text), version in zip(wheels, versions or ("1.0",) * len(wheels))]
    page.write_text("".join(f'<a href="../../files/{link}">{link}</a>\n' for link in links))
    return (root / "simple").as_uri()


def _run(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`argv` in this Python with pip's settings only those given (no machine's pip.conf)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120,
                          env={**clean, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_CACHE_DIR": "1", **env})


def _has_uv() -> None:
    if shutil.which("uv", path=os.path.dirname(sys.executable)) is None:
        pytest.skip("this venv was built before the set-up used uv: `rm -r` it and run scripts/test.sh to rebuild")


def test_uv_takes_the_file_pip_takes_where_two_indexes_have_the_version(tmp_path: Path):
    """This machine's first extra index has `multiprocess` 0.70.19 for Python 3.10 only, PyPI the
    3.11 file: pip took PyPI's (the best fit), uv told `--extra-index-url` took the extra index's,
    and `axolotl train` failed on it. The same here on disk, pip's own choice the measure."""
    _has_uv()
    this = f"py{sys.version_info.major}{sys.version_info.minor}"
    env = {"PIP_INDEX_URL": _index(tmp_path / "main", (this, "FROM = 'main'")),
           "PIP_EXTRA_INDEX_URL": _index(tmp_path / "extra", ("py30", "FROM = 'extra'"))}
    for installer, target in ((["-m", "pip"], "by-pip"), ([str(SCRIPT)], "by-setup")):
        proc = _run(*installer, "install", "-q", "--target", str(tmp_path / target), "tinypkg-for-setup", **env)
        assert proc.returncode == 0 and "[setup]" not in proc.stderr, proc.stderr  # the second by uv
    chosen = {t: (tmp_path / t / "tinypkg_for_setup.py").read_text() for t in ("by-pip", "by-setup")}
    assert chosen == {"by-pip": "FROM = 'main'", "by-setup": "FROM = 'main'"}, chosen


def test_with_a_setting_uv_would_not_follow_pip_installs_and_says_why(tmp_path: Path):
    _wheel(tmp_path)
    proc = _run(str(SCRIPT), "install", "--dry-run", "--no-index", "--find-links", str(tmp_path), "tinypkg-for-setup",
                PIP_TRUSTED_HOST="example.org")
    assert proc.returncode == 0, proc.stderr
    assert "[setup] pip's setting `trusted-host` has no uv counterpart here: installing with pip" in proc.stderr
    assert "Would install tinypkg-for-setup-1.0" in proc.stdout, proc.stdout  # pip's own words


# The CPU build of torch. PyPI's torch for Linux is the CUDA build (about 3 GB with its nvidia-*
# wheels); PyTorch's own index has `X+cpu`. These tests stand in for both with indexes on disk.

def _asked(sources_have_cpu: bool, spec: str = "torch==2.13.0", system: str = "Linux", no_index: bool = False):
    asked: list[str] = []
    request = setup_pip.torch_request(spec, system, no_index, lambda req: asked.append(req) or sources_have_cpu)
    return request, asked


def test_without_a_cpu_build_in_pips_sources_torch_comes_from_pytorchs_cpu_index():
    request, asked = _asked(sources_have_cpu=False)
    assert asked == ["torch==2.13.0+cpu"]
    assert request == ["--extra-index-url", "https://download.pytorch.org/whl/cpu", "torch==2.13.0+cpu"]


def test_where_pips_sources_have_the_cpu_build_torch_is_asked_for_as_pinned():
    assert _asked(sources_have_cpu=True) == (["torch==2.13.0"], ["torch==2.13.0+cpu"])


@pytest.mark.parametrize("spec, system, no_index", [
    ("torch==2.13.0", "Darwin", False),  # PyPI's torch is the CPU build there
    ("torch==2.13.0", "Windows", False),
    ("torch==2.13.0", "Linux", True),  # pip is set to read no index: none is added
    ("torch==2.13.0+cu128", "Linux", False),  # a build named: that one
    ("torch>=2.13", "Linux", False),  # not one release: as given
])
def test_off_linux_or_with_a_build_or_no_index_torch_is_asked_for_as_given(spec: str, system: str, no_index: bool):
    assert _asked(False, spec, system, no_index) == ([spec], [])


def test_an_extra_index_on_the_command_line_goes_after_the_configured_ones():
    """pip appends a command line's --extra-index-url to the configured ones; uv ranks the order given."""
    found = setup_pip.sources({"extra-index-url": "https://extra"})
    for given in (["--extra-index-url", "https://cpu"], ["--extra-index-url=https://cpu"]):
        line = setup_pip.command_line(found, [*given, "torch==2.13.0+cpu"])
        assert line[2:10] == ["--index", "https://pypi.org/simple", "--index", "https://extra", "--index", "https://cpu",
                              "--default-index", "https://pypi.org/simple"], line
        assert "--extra-index-url" not in " ".join(line) and line[-1] == "torch==2.13.0+cpu", line


@pytest.mark.skipif(platform.system() != "Linux", reason="the CPU index is asked for on Linux alone")
def test_the_set_up_asks_pips_sources_for_the_cpu_build_first(tmp_path: Path):
    """Against real sources: an index with the CUDA-like `2.13.0` alone means PyTorch's CPU index;
    a find-links folder holding `2.13.0+cpu` (as this project's machines keep it) means the pin."""
    _has_uv()
    pypi = {"PIP_INDEX_URL": _index(tmp_path / "pypi", ("py3", "BUILD = 'cuda'"), name="torch", versions=("2.13.0",))}
    proc = _run(str(SCRIPT), "torch-args", "torch==2.13.0", **pypi)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["--extra-index-url", "https://download.pytorch.org/whl/cpu", "torch==2.13.0+cpu"]
    assert "no CPU build of torch==2.13.0 in pip's sources" in proc.stderr, proc.stderr
    _wheel(tmp_path / "disk", text="BUILD = 'cpu'", name="torch", version="2.13.0+cpu")
    proc = _run(str(SCRIPT), "torch-args", "torch==2.13.0", PIP_FIND_LINKS=str(tmp_path / "disk"), **pypi)
    assert (proc.returncode, proc.stdout.split(), proc.stderr) == (0, ["torch==2.13.0"], ""), proc.stderr


def test_with_the_cpu_index_added_the_cpu_build_is_installed_beside_an_index_with_the_other(tmp_path: Path):
    _has_uv()
    pypi = _index(tmp_path / "pypi", ("py3", "BUILD = 'cuda'"), name="torch", versions=("2.13.0",))
    cpu = _index(tmp_path / "cpu", ("py3", "BUILD = 'cpu'"), name="torch", versions=("2.13.0+cpu",))
    proc = _run(str(SCRIPT), "install", "-q", "--target", str(tmp_path / "venv"), "--extra-index-url", cpu,
                "torch==2.13.0+cpu", PIP_INDEX_URL=pypi)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "venv" / "torch.py").read_text() == "BUILD = 'cpu'"
