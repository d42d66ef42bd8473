"""Zero-code activation (`fsdp-offload-cfg run -- COMMAND`, the `.pth` switch): the plugin is on in
every worker of an unmodified script, and a bad config stops every rank with status 1 instead of
Python's "Error in sitecustomize" and a run without the plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_offload_cfg.autopatch import PTH_NAME, SWITCH, is_launcher
from fsdp_offload_cfg.testing.dist import free_port

pytestmark = pytest.mark.launches

HERE = Path(__file__).parent
PROBE = HERE / "scripts" / "unpatched_probe.py"
BIN = Path(sys.executable).parent

YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: 2
mixed_precision: 'no'
use_cpu: true
fsdp_config:
  fsdp_version: 2
  fsdp_cpu_ram_efficient_loading: true
  activation_cpu_offload:
    min_tensor_bytes: 0
{extra}"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    from fsdp_offload_cfg.testing.models import save_llama

    return save_llama(str(tmp_path_factory.mktemp("zero_code") / "llama"))


def _env(probe_dir: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_", SWITCH))}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", **extra)
    if probe_dir is not None:
        probe_dir.mkdir(exist_ok=True)
        env["PROBE_DIR"] = str(probe_dir)
    return env


def _results(probe_dir: Path) -> list[dict]:
    """What each rank of the probe wrote (nothing for a rank that never got there)."""
    return [json.loads(p.read_text()) for p in sorted(probe_dir.glob("rank*.json"))]


def _launch(config: Path, checkpoint: str, probe_dir: Path, *prefix: str) -> subprocess.CompletedProcess[str]:
    command = [*prefix, str(BIN / "accelerate"), "launch", "--config_file", str(config),
               "--main_process_port", str(free_port()), str(PROBE), checkpoint]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=_env(probe_dir))


@pytest.mark.distributed
@pytest.mark.own_code
def test_run_turns_the_plugin_on_in_an_unmodified_script(tmp_path: Path, checkpoint: str):
    config = tmp_path / "fsdp2.yaml"
    config.write_text(YAML.format(extra=""))
    _launch(config, checkpoint, tmp_path / "stock")  # the same launch without the plugin
    stock = _results(tmp_path / "stock")
    proc = _launch(config, checkpoint, tmp_path / "ours", str(BIN / "fsdp-offload-cfg"), "run", "--")
    ours = _results(tmp_path / "ours")
    assert [r["rank"] for r in ours] == [0, 1], proc.stdout[-2000:] + proc.stderr[-3000:]
    for r in ours:
        assert r["patched"] and r["sharded"] and r["offloaded_bytes"] > 0, r
    assert all(not r["patched"] and not r["sharded"] for r in stock), stock  # stock: plain data parallel on CPU
    # it says that it is on, and at the end what the offload moved (rank 0, once)
    line = f"[fsdp_offload_cfg rank 0] config from accelerate launch --config_file {config} (FSDP2, meta loading: " \
           "auto, activation offload: on); patches:"
    assert proc.stderr.count(line) == 1, proc.stderr[-3000:]
    assert proc.stderr.count("[fsdp_offload_cfg rank 0] activation offload moved") == 1, proc.stderr[-3000:]


@pytest.mark.distributed
def test_run_with_config_under_torchrun(tmp_path: Path, checkpoint: str):
    """torchrun exports nothing of the file: the file's `parallelism_config` reaches accelerate as
    `accelerate launch` hands it over (it ran as plain FSDP on an unnamed mesh without a word)."""
    config = tmp_path / "fsdp2.yaml"
    config.write_text(YAML.format(extra="parallelism_config:\n  parallelism_config_dp_shard_size: 2\n"))
    command = [str(BIN / "fsdp-offload-cfg"), "run", "--config", str(config), "--", sys.executable, "-m",
               "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), str(PROBE),
               checkpoint]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, env=_env(tmp_path / "probe"))
    results = _results(tmp_path / "probe")
    assert len(results) == 2 and all(r["patched"] and r["sharded"] for r in results), proc.stderr[-3000:]
    assert [r["mesh"] for r in results] == [{"dp_shard_cp": 2}] * 2, results
    assert f"config from $FSDP_OFFLOAD_CFG={config} (FSDP2, parallelism_config dp_shard_size 2," in proc.stderr


@pytest.mark.distributed
@pytest.mark.own_code
def test_a_typo_stops_every_rank_with_status_1_naming_the_key(tmp_path: Path, checkpoint: str):
    """The switch set and the bootstrap first on the path, as `install-hook`'s line or `run` leave
    them, with nothing checking the file first: each rank stops itself naming the key."""
    import fsdp_offload_cfg.autopatch as autopatch

    config = tmp_path / "typo.yaml"
    config.write_text(YAML.format(extra="  fsdp_activaton_cpu_offload: true\n"))
    bootstrap = str(Path(autopatch.__file__).parent / "_bootstrap")
    # torchrun's agent looks at its workers every `--monitor_interval` s (accelerate's default 0.1)
    # and SIGTERMs the others once one has failed: with 15 s, every rank stops on its own first.
    command = [str(BIN / "accelerate"), "launch", "--config_file", str(config), "--monitor_interval", "15",
               "--main_process_port", str(free_port()), str(PROBE), checkpoint]
    env = _env(tmp_path / "probe", **{SWITCH: "1"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [bootstrap, env.get("PYTHONPATH")]))
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode != 0 and _results(tmp_path / "probe") == [], proc.stdout[-2000:]  # no rank trained
    for rank in (0, 1):
        assert f"[fsdp_offload_cfg rank {rank}] invalid config, stopping before anything runs" in proc.stderr, (
            proc.stderr[-3000:])
    assert "activaton_cpu_offload" in proc.stderr and "did you mean" in proc.stderr


def test_run_checks_the_file_the_launch_names_before_starting_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """`run -- accelerate launch --config_file F`: a typo in F stops `run` itself, naming the key,
    before any launcher or rank starts (`run` returns instead of replacing itself)."""
    from fsdp_offload_cfg import cli

    config = tmp_path / "typo.yaml"
    config.write_text(YAML.format(extra="  fsdp_activaton_cpu_offload: true\n"))
    assert cli.main(["run", "--", "accelerate", "launch", "--config_file", str(config), "train.py"]) == 1
    err = capsys.readouterr().err
    assert f"{config}: fsdp_config.fsdp_activaton_cpu_offload: unknown key" in err, err


def test_run_refuses_a_bad_config_file_before_starting_anything(tmp_path: Path):
    config = tmp_path / "bad.yaml"
    config.write_text("distributed_type: FSDP\nfsdp_config:\n  load_strategy: scatter\n")
    proc = subprocess.run([str(BIN / "fsdp-offload-cfg"), "run", "--config", str(config), "--", "false"],
                          capture_output=True, text=True, timeout=60, env=_env())
    assert proc.returncode == 1 and "load_strategy" in proc.stderr, proc.stderr


def test_run_refuses_two_different_config_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from fsdp_offload_cfg import cli

    one, other = tmp_path / "one.yaml", tmp_path / "other.yaml"
    for path in (one, other):
        path.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n")
    command = ["--", "trl", "sft", "--accelerate_config", str(other), "--model_name_or_path", "m"]
    assert cli.main(["run", "--config", str(one), *command]) == 2
    err = capsys.readouterr().err
    assert f"--config {one} and the command's own config {other} are two files" in err, err


def _hook(site_dir: Path) -> None:
    from fsdp_offload_cfg import cli

    assert cli.main(["install-hook", "--target", str(site_dir)]) == 0
    assert (site_dir / PTH_NAME).exists()


def _start(site_dir: Path, code: str, value: str | None, isolated: bool = False,
           **extra: str) -> subprocess.CompletedProcess[str]:
    """A Python start that reads the hook in `site_dir`, with the switch at `value`; `isolated`:
    no site-packages, no current folder (the package is not importable, as after an uninstall)."""
    env = _env(**extra)
    env.pop(SWITCH, None)
    if value is not None:
        env[SWITCH] = value
    flags = ["-I", "-S"] if isolated else []
    return subprocess.run([sys.executable, *flags, "-c", f"import site, sys; site.addsitedir({str(site_dir)!r}); {code}"],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.own_code
def test_the_pth_switch_patches_only_when_on_and_imports_nothing_when_off(tmp_path: Path):
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    _hook(site_dir)
    config = tmp_path / "f.yaml"
    config.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n")
    code = ("m = sys.modules.get('fsdp_offload_cfg'); "
            "print(m is not None and m.active_config() is not None, 'torch' in sys.modules)")
    on = _start(site_dir, code, "On", FSDP_OFFLOAD_CFG=str(config))
    assert on.stdout.split() == ["True", "True"], on.stderr[-2000:]
    # the documented off-values: not even the package is imported (`=0` imported it and torch, 2.8 s)
    for value in (None, "", "0", "false", "No", "off"):
        off = _start(site_dir, "print(sorted(m for m in sys.modules if m.startswith(('fsdp_offload_cfg', 'torch'))))",
                     value)
        assert off.returncode == 0 and off.stdout.split() == ["[]"], (value, off.stdout, off.stderr[-2000:])


@pytest.mark.parametrize("value", ["maybe", "2", "enable"])
def test_a_switch_neither_on_nor_off_stops_naming_the_variable(tmp_path: Path, value: str):
    _hook(tmp_path)
    proc = _start(tmp_path, "print('ran')", value)
    assert proc.returncode == 1 and "ran" not in proc.stdout, proc
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{SWITCH}={value!r} is neither on (1, true, yes, on) nor off" in proc.stderr, proc.stderr


def test_a_hook_outliving_its_package_is_one_line_and_a_stop_when_on(tmp_path: Path):
    """After `pip uninstall` the hook printed two ModuleNotFoundError tracebacks and, with the
    switch on, the launcher trained without the plugin and exited 0."""
    _hook(tmp_path)
    on = _start(tmp_path, "print('ran')", "1", isolated=True)
    assert on.returncode == 1 and "ran" not in on.stdout, on
    assert on.stderr.count("\n") == 1 and "Traceback" not in on.stderr, on.stderr
    assert f"not installed for {sys.executable}" in on.stderr and str(tmp_path / PTH_NAME) in on.stderr, on.stderr
    off = _start(tmp_path, "print('ran')", None, isolated=True)
    assert (off.returncode, off.stdout, off.stderr) == (0, "ran\n", ""), off


def test_the_hook_is_listed_in_the_packages_record_so_pip_removes_it(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]):
    """pip uninstall removes the files the distribution's RECORD lists: the hook beside the
    `.dist-info` is added there (here a copy of this environment's own `.dist-info`) and taken out
    by uninstall-hook."""
    import shutil
    import sysconfig
    from importlib import metadata

    from fsdp_offload_cfg import cli

    site_packages = sysconfig.get_paths()["purelib"]
    installed = next(metadata.distributions(name="fsdp-offload-cfg", path=[site_packages]))
    record = next(f for f in installed.files if f.name == "RECORD")
    shutil.copytree(Path(str(record.locate())).parent, tmp_path / Path(str(record.locate())).parent.name)
    assert cli.main(["install-hook", "--target", str(tmp_path)]) == 0
    assert "removed by `pip uninstall fsdp-offload-cfg` with the package" in capsys.readouterr().out
    def listed() -> list:
        (copy,) = metadata.distributions(name="fsdp-offload-cfg", path=[str(tmp_path)])
        return [f for f in copy.files if f.name == PTH_NAME]

    assert [Path(str(f.locate())).resolve() for f in listed()] == [(tmp_path / PTH_NAME).resolve()]
    assert cli.main(["install-hook", "--target", str(tmp_path)]) == 0  # again: still one row
    assert len(listed()) == 1
    assert cli.main(["uninstall-hook", "--target", str(tmp_path)]) == 0
    assert not (tmp_path / PTH_NAME).exists()
    assert not listed()


def test_install_hook_refuses_a_missing_folder_and_says_whom_a_folder_reaches(tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture[str]):
    from fsdp_offload_cfg import cli

    assert cli.main(["install-hook", "--target", str(tmp_path / "missing")]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and f"{tmp_path / 'missing'} is not a folder" in captured.err, captured
    assert cli.main(["install-hook", "--target", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "every Python process of this environment" not in out, out
    assert f"adds {tmp_path} as a site folder (it is not one of this Python's)" in out, out
    assert f"fsdp-offload-cfg uninstall-hook --target {tmp_path}" in out, out


@pytest.mark.own_code
def test_run_keeps_the_users_own_sitecustomize(tmp_path: Path):
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITECUSTOMIZE_RAN'] = '1'\n")
    code = "import os, sys; print(os.environ.get('OWN_SITECUSTOMIZE_RAN'), 'fsdp_offload_cfg.autopatch' in sys.modules)"
    # the user's folder goes before whatever PYTHONPATH already holds: where the package itself is
    # reached through PYTHONPATH (an install with `pip --target`, as on the GPU machine), replacing
    # it would leave `fsdp-offload-cfg` unable to import its own package
    pythonpath = os.pathsep.join(filter(None, [str(own), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([str(BIN / "fsdp-offload-cfg"), "run", "--", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=120, env=_env(PYTHONPATH=pythonpath))
    assert proc.stdout.split() == ["1", "True"], proc.stderr[-2000:]


@pytest.mark.own_code
def test_run_stops_a_python_of_another_environment_with_one_line_saying_where_the_plugin_is(tmp_path: Path):
    """Every Python the command starts reads the bootstrap folder, also one of another environment
    (a command from another venv, or the CLI installed on its own with pipx), which cannot import
    the package: Python printed "Error in sitecustomize" with a ModuleNotFoundError and ran the
    script without the plugin."""
    import venv

    venv.create(tmp_path / "other", with_pip=False, symlinks=True)
    other = tmp_path / "other" / "bin" / "python"
    # only the bootstrap folder `run` puts first: whatever else PYTHONPATH holds (the package
    # itself, on a machine that installs it with `pip --target`) is not the other environment's
    command = ["sh", "-c", f'PYTHONPATH="${{PYTHONPATH%%{os.pathsep}*}}" exec {other} -c "print(\'ran\')"']
    proc = subprocess.run([str(BIN / "fsdp-offload-cfg"), "run", "--", *command],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 1 and "ran" not in proc.stdout, proc
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and "Error in" not in proc.stderr, proc
    assert f"{other} cannot import fsdp_offload_cfg, which is installed at" in proc.stderr, proc.stderr
    assert "install fsdp-offload-cfg into the environment that runs the command" in proc.stderr, proc.stderr
    off = subprocess.run([str(BIN / "fsdp-offload-cfg"), "run", "--", "env", f"{SWITCH}=0", *command],
                         capture_output=True, text=True, timeout=120, env=_env())
    assert (off.returncode, off.stdout, off.stderr) == (0, "ran\n", ""), off  # a process that turned it off


def test_the_bootstrap_reads_the_switch_as_autopatch_does():
    """The bootstrap holds its own copy of the switch's name and off values: it must read them
    where the package cannot be imported."""
    import ast

    from fsdp_offload_cfg import autopatch

    tree = ast.parse((Path(autopatch.__file__).parent / "_bootstrap" / "sitecustomize.py").read_text())
    values = {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
              if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)}  # fmt: skip
    assert (values["SWITCH"], values["OFF_VALUES"]) == (autopatch.SWITCH, autopatch.OFF_VALUES)


@pytest.mark.parametrize(
    "argv, launcher",
    [
        (["/venv/bin/python", "/venv/bin/accelerate", "launch", "--config_file", "f.yaml", "train.py"], True),
        (["/venv/bin/python", "/venv/bin/torchrun", "--nproc_per_node", "2", "train.py"], True),
        (["/venv/bin/python", "-m", "torch.distributed.run", "train.py"], True),
        (["/venv/bin/python", "-u", "train.py", "--launch"], False),
        (["/venv/bin/python", "/venv/bin/swift", "sft", "--fsdp", "f.json"], False),
    ],
)
def test_launcher_processes_are_left_alone(argv: list[str], launcher: bool):
    assert is_launcher(argv) is launcher
