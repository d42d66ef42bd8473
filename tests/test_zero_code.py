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

from _dist import free_port
from fsdp_offload_cfg.autopatch import PTH_NAME, SWITCH, is_launcher

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
    from _models import save_llama

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
    config = tmp_path / "fsdp2.yaml"
    config.write_text(YAML.format(extra=""))
    command = [str(BIN / "fsdp-offload-cfg"), "run", "--config", str(config), "--", sys.executable, "-m",
               "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), str(PROBE),
               checkpoint]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, env=_env(tmp_path / "probe"))
    results = _results(tmp_path / "probe")
    assert len(results) == 2 and all(r["patched"] and r["sharded"] for r in results), proc.stderr[-3000:]
    assert f"config from $FSDP_OFFLOAD_CFG={config}" in proc.stderr


@pytest.mark.distributed
def test_a_typo_stops_every_rank_with_status_1_naming_the_key(tmp_path: Path, checkpoint: str):
    config = tmp_path / "typo.yaml"
    config.write_text(YAML.format(extra="  fsdp_activaton_cpu_offload: true\n"))
    proc = _launch(config, checkpoint, tmp_path / "probe", str(BIN / "fsdp-offload-cfg"), "run", "--")
    assert proc.returncode != 0 and _results(tmp_path / "probe") == [], proc.stdout[-2000:]  # no rank trained
    # Each rank stops itself at start with the message; the launcher then stops the ranks still
    # starting (SIGTERM), so how many print before that is a race: at least one does.
    stopped = [r for r in (0, 1) if f"[fsdp_offload_cfg rank {r}] invalid config, stopping before anything runs"
               in proc.stderr]  # fmt: skip
    assert stopped, proc.stderr[-3000:]
    assert "activaton_cpu_offload" in proc.stderr and "did you mean" in proc.stderr


def test_run_refuses_a_bad_config_file_before_starting_anything(tmp_path: Path):
    config = tmp_path / "bad.yaml"
    config.write_text("distributed_type: FSDP\nfsdp_config:\n  load_strategy: scatter\n")
    proc = subprocess.run([str(BIN / "fsdp-offload-cfg"), "run", "--config", str(config), "--", "false"],
                          capture_output=True, text=True, timeout=60, env=_env())
    assert proc.returncode == 1 and "load_strategy" in proc.stderr, proc.stderr


def test_the_pth_switch_patches_only_when_set_and_chains_nothing_heavy(tmp_path: Path):
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    subprocess.run([str(BIN / "fsdp-offload-cfg"), "install-hook", "--target", str(site_dir)], check=True,
                   capture_output=True, timeout=60)  # fmt: skip
    assert (site_dir / PTH_NAME).exists()
    config = tmp_path / "f.yaml"
    config.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n")
    code = (f"import site, sys; site.addsitedir({str(site_dir)!r}); m = sys.modules.get('fsdp_offload_cfg'); "
            "print(m is not None and m.active_config() is not None, 'torch' in sys.modules)")
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                        env=_env(**{SWITCH: "1", "FSDP_OFFLOAD_CFG": str(config)}))
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
    assert on.stdout.split() == ["True", "True"], on.stderr[-2000:]
    assert off.stdout.split() == ["False", "False"], off.stderr[-2000:]  # nothing imported without the switch
    subprocess.run([str(BIN / "fsdp-offload-cfg"), "uninstall-hook", "--target", str(site_dir)], check=True,
                   capture_output=True, timeout=60)  # fmt: skip
    assert not (site_dir / PTH_NAME).exists()


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
