"""The package as a user installs it: a wheel built from the checkout, not the editable install
every CI leg runs. A file the wheel leaves out (the bootstrap `run` puts first on the path, the
ms-swift plugin file `swift-plugin` names, the schema shipped for editors) is missing for `pip
install` users alone, and no other test would see it.

The wheel is built from a copy of the tracked files: pip builds in the source tree (`build/`, the
egg-info), where another leg's editable install may be writing at the same time."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.own_code


def _tracked() -> list[str]:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout: the tracked files are unknown")
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True)
    return [name for name in out.stdout.decode().split("\0") if name]


def _package_files(tracked: list[str]) -> set[str]:
    """The files under fsdp_offload_cfg/ as installed: a tracked link to a folder (schemas) as the
    files in it."""
    found = set()
    for name in tracked:
        if not name.startswith("fsdp_offload_cfg/"):
            continue
        path = ROOT / name
        if path.is_dir():
            found |= {f"{name}/{p.relative_to(path).as_posix()}" for p in path.rglob("*") if p.is_file()}
        else:
            found.add(name)
    return found


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str]]:
    tracked = _tracked()
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_symlink():
            os.symlink(os.readlink(ROOT / name), source / name)
        else:
            shutil.copy2(ROOT / name, source / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("fsdp_offload_cfg-*.whl")
    return wheel, _package_files(tracked)


def test_the_wheel_holds_every_file_of_the_package(built: tuple[Path, set[str]]):
    wheel, expected = built
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "fsdp_offload_cfg/schemas/fsdp_config.schema.json" in expected  # the link was followed
    missing = sorted(expected - names)
    assert not missing, f"{wheel.name} leaves out {missing}: list them in pyproject.toml's package-data"


def test_the_installed_wheel_validates_runs_and_patches_from_its_own_files(built: tuple[Path, set[str]],
                                                                            tmp_path: Path):
    wheel, _ = built
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    env = {**os.environ, "PYTHONPATH": str(site)}  # before the venv's editable install
    env.pop("FSDP_OFFLOAD_CFG", None)
    cli = [sys.executable, str(site / "bin" / "fsdp-offload-cfg")]

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *argv], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)

    checked = run("validate", str(ROOT / "examples" / "fsdp2.yaml"))
    assert (checked.returncode, checked.stdout.strip()) == (0, f"{ROOT / 'examples' / 'fsdp2.yaml'}: OK"), checked.stderr
    schema = run("schema")
    assert schema.returncode == 0 and json.loads(schema.stdout)["type"] == "object", schema.stderr
    plugin = run("swift-plugin")
    assert plugin.returncode == 0 and Path(plugin.stdout.strip()).is_file(), plugin.stdout + plugin.stderr
    assert Path(plugin.stdout.strip()).is_relative_to(site), plugin.stdout
    # `run`: its bootstrap, from the wheel, patches the child before its own code
    probe = "import sys, fsdp_offload_cfg; print(fsdp_offload_cfg.__file__); print(fsdp_offload_cfg.active_config() is not None)"
    child = run("run", "--config", str(ROOT / "examples" / "fsdp2_cpu.yaml"), "--", sys.executable, "-c", probe)
    assert child.returncode == 0, child.stderr
    where, patched = child.stdout.split()
    assert Path(where).is_relative_to(site) and patched == "True", child.stdout + child.stderr
