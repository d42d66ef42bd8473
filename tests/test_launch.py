"""End to end through the real launchers: `accelerate launch` and `torchrun`, 2 gloo ranks on the CPU.

These are the user's paths: a config file they already launch with, `patch()` with no argument,
stock `Accelerator()` / `from_pretrained` / `prepare`. Every run is bounded by a timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from fsdp_offload_cfg.testing.dist import free_port
from fsdp_offload_cfg.testing.models import (
    save_deepseek_v3,
    save_llama,
    save_qwen2_tied,
)

pytestmark = [pytest.mark.distributed, pytest.mark.launches]

HERE = Path(__file__).parent
PROBE = HERE / "scripts" / "launch_probe.py"
TRAINER_PROBE = HERE / "scripts" / "trainer_probe.py"
EXIT_RACE_PROBE = HERE / "scripts" / "exit_race_probe.py"
BIN = Path(sys.executable).parent

CPU_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
machine_rank: 0
num_processes: 2
mixed_precision: 'no'
use_cpu: {use_cpu}
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_cpu_ram_efficient_loading: {loading}
{extra}"""


@dataclass
class Launch:
    proc: subprocess.CompletedProcess[str]
    out_dir: Path

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr


def _run(cmd: list[str], timeout: float = 240, **extra_env: str) -> Launch:
    out_dir = Path(tempfile.mkdtemp(prefix="probe_", dir=os.environ["TMPDIR"]))  # the suite's scratch (conftest.py)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    # CPU launches (gloo) whatever the machine has: a visible GPU would give every rank a CUDA device
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PROBE_DIR=str(out_dir),
               CUDA_VISIBLE_DEVICES="")
    env.update(extra_env)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=HERE.parent)
    return Launch(proc, out_dir)


def _reports(launch: Launch) -> list[dict]:
    if launch.proc.returncode != 0:
        lines = launch.output.splitlines()
        causes = [line for line in lines if "Error" in line or "terminate" in line or "Traceback" in line]
        pytest.fail(f"launch exited {launch.proc.returncode}; error lines:\n" + "\n".join(causes[:40])
                    + "\n--- output tail ---\n" + "\n".join(lines[-60:]))
    reports = [json.loads((launch.out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in reports] == [0, 1]
    return reports


def _accelerate_launch(config: Path, *script_args: str, flags: tuple[str, ...] = (), **env: str) -> Launch:
    return _run([str(BIN / "accelerate"), "launch", "--config_file", str(config), *flags,
                 "--main_process_port", str(free_port()), str(PROBE), *script_args], **env)


# [launch] is accelerate's (what its command line exports, at each leg's accelerate); the file
# named to `patch()` or in $FSDP_OFFLOAD_CFG is this package's route alone
@pytest.mark.parametrize("named", ["launch", pytest.param("argument", marks=pytest.mark.own_code),
                                   pytest.param("env", marks=pytest.mark.own_code)])
def test_launch_command_line_overrides_win_over_the_file(tmp_path: Path, checkpoint: str, named: str) -> None:
    """`patch()` used to re-export every value of the file, undoing the command line: the run had
    mixed precision "no", RAM-efficient loading on and no checkpointing. Before, it still
    did when the script named the file itself (`patch("f.yaml")`) or through `$FSDP_OFFLOAD_CFG`."""
    config = _write(tmp_path, "f.yaml", loading="true", extra="  activation_cpu_offload: true\n")
    flags = ("--mixed_precision", "bf16", "--fsdp_activation_checkpointing", "true",
             "--fsdp_cpu_ram_efficient_loading", "false")  # fmt: skip
    args = ("--config", str(config)) if named == "argument" else ()
    env = {"FSDP_OFFLOAD_CFG": str(config)} if named == "env" else {}
    launch = _accelerate_launch(config, checkpoint, "--steps", "1", *args, flags=flags, **env)
    for r in _reports(launch):
        assert (r["mixed_precision"], r["plugin_cpu_ram_efficient_loading"], r["plugin_activation_checkpointing"]) == (
            "bf16", False, True), r
        assert (r["config_mixed_precision"], r["config_cpu_ram_efficient_loading"],
                r["config_activation_checkpointing"]) == ("bf16", False, True), r  # fmt: skip
        assert r["meta_numel_after_from_pretrained"] == 0, "loading is off on the command line"
        assert r["offload_enabled"] and r["offload_stats"]["offloaded_bytes"] > 0  # the file's plugin key stays
        assert "overridden by the launch command line" in r["source"] and "mixed_precision: 'bf16'" in r["source"]
    assert "the file says 'no'" in launch.output  # the rank-0 log line says where the value came from


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_llama(str(tmp_path_factory.mktemp("llama")))


def _write(tmp_path: Path, name: str, **fields: str) -> Path:
    values = {"use_cpu": "true", "loading": "false", "extra": ""}
    values.update(fields)
    path = tmp_path / name
    path.write_text(CPU_YAML.format(**values))
    return path


def _assert_fsdp2_sharded(reports: list[dict]) -> None:
    for r in reports:
        assert r["distributed_type"] == "FSDP" and r["backend"] == "gloo", r
        assert r["dtensor_params"] == r["num_params"] > 0, r
        assert r["local_numel"] < 0.75 * r["full_numel"], r  # each rank holds about half
        assert r["optimizer_holds_model_params"], r
        assert r["losses_finite"], r
    assert reports[0]["losses"] == reports[1]["losses"]


@pytest.fixture(scope="module")
def plain_run(checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The plain file launched once (FSDP2 on the CPU, loader, offload and checkpointing off, 3
    steps): what the test of the file's discovery and the offload's exactness baseline both read
    (a launch costs about 14 s of CPU, most of it three interpreters importing torch)."""
    config = _write(tmp_path_factory.mktemp("plain"), "fsdp2_cpu.yaml")
    return config, _reports(_accelerate_launch(config, checkpoint, "--steps", "3"))


def test_accelerate_launch_finds_its_config_and_runs_fsdp2_on_cpu(plain_run: tuple[Path, list[dict]]):
    """`use_cpu: true`; `use_cpu: false` on a machine without a GPU is the default file's launch below."""
    config, reports = plain_run
    _assert_fsdp2_sharded(reports)
    for r in reports:
        assert str(config) in r["source"], r["source"]
        assert "cpu-fsdp-accelerator-state" in r["patches"]


@pytest.fixture(scope="module")
def explained_offload_run(checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The plain file with the offload on (every saved tensor moved), rewritten by `explain` and
    launched as written, 3 steps: the run that both the test of `explain`'s file and the offload's
    exactness test without checkpointing read (one launch fewer at each end leg)."""
    import contextlib
    import io

    import yaml

    from fsdp_offload_cfg import cli

    folder = tmp_path_factory.mktemp("explained")
    source = _write(folder, "source.yaml", extra="  activation_cpu_offload:\n    min_tensor_bytes: 0\n")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["explain", str(source)]) == 0
    written = folder / "explained.yaml"
    written.write_text(yaml.safe_dump(yaml.safe_load(out.getvalue())["config"], sort_keys=False))
    return written, _reports(_accelerate_launch(written, checkpoint, "--steps", "3"))


def test_what_explain_writes_launches_as_is(explained_offload_run: tuple[Path, list[dict]]):
    """The README calls `explain`'s `config` a file you can run: it wrote the layer classes as a
    YAML list, which `accelerate launch` turns into text no rank can read."""
    written, reports = explained_offload_run
    _assert_fsdp2_sharded(reports)
    for r in reports:
        assert str(written) in r["source"] and r["offload_enabled"], r


def _demo(*args: str) -> Launch:
    """The README's main job: the example, launched with the example config."""
    root = HERE.parent
    return _run([str(BIN / "accelerate"), "launch", "--config_file", str(root / "examples" / "fsdp2_cpu.yaml"),
                 "--main_process_port", str(free_port()), str(root / "examples" / "train.py"), *args])


def _demo_folder(launch: Launch) -> Path:
    """The checkpoint folder the demo built (named in the loader's rank-0 line)."""
    import re

    found = re.search(r"load_strategy auto: (\S+fsdp_offload_cfg_demo_\S+) built on meta", launch.output)
    assert found is not None, launch.output[-3000:]
    return Path(found.group(1))


@pytest.mark.own_code
def test_the_demo_learns_shows_one_loading_bar_saves_and_cleans_up(tmp_path: Path):
    """Its losses were flat (new random tokens every step) and every rank drew a loading bar. Its
    `--output-dir` save (`save_pretrained` on every rank) writes a model that loads whole."""
    import re

    from transformers import AutoModelForCausalLM

    launch = _demo("--steps", "5", "--output-dir", str(tmp_path / "trained"))
    assert launch.proc.returncode == 0, launch.output[-3000:]
    assert f"saved the trained model to {tmp_path / 'trained'}" in launch.proc.stdout, launch.output[-3000:]
    info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"), output_loading_info=True)[1]
    assert not any(info.values()), info
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)$", launch.proc.stdout, re.MULTILINE)]
    assert len(losses) == 5 and losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.5, losses
    # rank 0's bar only (transformers 4.57 draws none)
    assert launch.output.count("Loading weights: 100%") <= 1, launch.output[-3000:]
    assert not _demo_folder(launch).exists()


@pytest.mark.own_code
def test_the_demo_removes_its_checkpoint_after_a_failed_run():
    launch = _demo("--steps", "1", "--lr", "-1")  # AdamW refuses the rate after the checkpoint is built
    assert launch.proc.returncode != 0 and "Invalid learning rate" in launch.output, launch.output[-3000:]
    assert not _demo_folder(launch).exists()


@pytest.mark.own_code
def test_the_demo_under_torchrun_without_a_config_stops_saying_how_to_name_one():
    """It crashed on rank 1 with "Unrecognized model in /tmp/fsdp_offload_cfg_demo_...": stock
    `Accelerator()` ran each rank as a job of its own, each building its own checkpoint."""
    root = HERE.parent
    launch = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(free_port()), str(root / "examples" / "train.py"), "--steps", "1"])
    assert launch.proc.returncode != 0
    assert "launched as 2 processes, but Accelerator() runs this one alone" in launch.output, launch.output[-3000:]
    assert "FSDP_OFFLOAD_CFG=examples/fsdp2_cpu.yaml torchrun" in launch.output
    assert "this is one of 2 launched processes" in launch.output  # patch()'s own line says it too
    assert "Unrecognized model" not in launch.output and "step 0 loss" not in launch.output


def test_accelerate_launch_without_flag_uses_accelerates_default_config_file(tmp_path: Path, checkpoint: str):
    """accelerate's default file, with `use_cpu: false` (a file written for GPUs) on this machine
    without one: FSDP2 on the CPU all the same."""
    hf_home = tmp_path / "hf_home"
    default = _write(tmp_path, "default.yaml", use_cpu="false", extra="  activation_cpu_offload: true\n")
    (hf_home / "accelerate").mkdir(parents=True)
    (hf_home / "accelerate" / "default_config.yaml").write_text(default.read_text())
    launch = _run([str(BIN / "accelerate"), "launch", "--main_process_port", str(free_port()), str(PROBE),
                   checkpoint], HF_HOME=str(hf_home))
    reports = _reports(launch)
    _assert_fsdp2_sharded(reports)
    for r in reports:
        assert str(hf_home / "accelerate" / "default_config.yaml") in r["source"], r["source"]
        assert "cpu-fsdp-accelerator-state" in r["patches"]
        assert r["offload_enabled"], r  # a plugin key only the file holds: not from FSDP_* variables


@pytest.mark.parametrize("checkpointing", ["false", "true"])
def test_activation_offload_through_accelerate_is_bit_identical(tmp_path: Path, checkpoint: str, checkpointing: str,
                                                                plain_run: tuple[Path, list[dict]],
                                                                explained_offload_run: tuple[Path, list[dict]]):
    """Same launch with and without `activation_cpu_offload`: identical losses over 3 AdamW steps
    (each loss after the first depends on the previous step's gradients)."""
    if checkpointing == "false":  # accelerate's default: the plain file's run, and the same file with the offload
        without, with_offload = plain_run[1], explained_offload_run[1]
    else:
        ac = f"  fsdp_activation_checkpointing: {checkpointing}\n"
        offload = _write(tmp_path, "offload.yaml", extra=ac + "  activation_cpu_offload:\n    min_tensor_bytes: 0\n")
        without = _reports(_accelerate_launch(_write(tmp_path, "plain.yaml", extra=ac), checkpoint, "--steps", "3"))
        with_offload = _reports(_accelerate_launch(offload, checkpoint, "--steps", "3"))
    assert with_offload[0]["offload_stats"]["offloaded_bytes"] > 0
    assert [r["losses"] for r in with_offload] == [r["losses"] for r in without]


def test_activation_offload_with_accelerates_regional_compilation(tmp_path: Path, checkpoint: str):
    """accelerate's regional compilation (`dynamo_use_regional_compilation`) with the offload: the
    same losses as without it, and no graph break in our code. accelerate 1.15 compiles every
    module outside the layers in place under FSDP2, `embed_tokens` and `lm_head` included, where
    dynamo used to compile our pack hook (a graph break per call)."""
    dynamo = "dynamo_config:\n  dynamo_backend: AOT_EAGER\n  dynamo_use_regional_compilation: true\n"
    plain = _write(tmp_path, "plain.yaml", extra=f"{dynamo}")
    offload = _write(tmp_path, "offload.yaml", extra="  activation_cpu_offload:\n    min_tensor_bytes: 0\n" + dynamo)
    without = _reports(_accelerate_launch(plain, checkpoint, "--steps", "2"))
    launch = _accelerate_launch(offload, checkpoint, "--steps", "2", TORCH_LOGS="graph_breaks")
    with_offload = _reports(launch)
    assert with_offload[0]["offload_stats"]["offloaded_bytes"] > 0
    assert [r["losses"] for r in with_offload] == [r["losses"] for r in without]
    ours = [line for line in launch.output.splitlines() if "Graph break in user code at" in line
            and "/fsdp_offload_cfg/" in line]  # a break elsewhere may pass through our forward: not ours
    assert ours == [], "\n".join(ours[:20])


@pytest.mark.own_code
def test_typo_in_plugin_key_stops_the_launch_naming_it(tmp_path: Path):
    """Every rank stops at `patch()`, before any model is built: the checkpoint named does not
    exist, and a rank that went on would stop in `from_pretrained` naming it (this test bounded
    the launch's time instead, which says nothing on a machine slow enough). torchrun's agent
    looks at its workers every `--monitor_interval` seconds (accelerate's default 0.1) and
    SIGTERMs the others once one has failed: a rank 1 that reached `patch()` a tenth of a second
    after rank 0 had failed was killed before it could say why (seen once in CI on a loaded
    machine). With 15 s, both ranks have stopped on their own before the agent first looks."""
    config = _write(tmp_path, "typo.yaml", extra="  fsdp_activaton_cpu_offload: true\n")
    launch = _accelerate_launch(config, str(tmp_path / "never_read"), flags=("--monitor_interval", "15"))
    assert launch.proc.returncode != 0
    output = launch.output
    assert "activaton_cpu_offload" in output and "did you mean" in output, output[-3000:]
    assert "activation_cpu_offload" in output
    for rank in (0, 1):
        assert f"[fsdp_offload_cfg rank {rank}] invalid config, nothing was patched" in output, output[-3000:]
    assert "never_read" not in output and "PROBE" not in launch.proc.stdout, output[-3000:]


def test_torchrun_with_explicit_config_path_and_param_offload(tmp_path: Path, checkpoint: str):
    config = _write(tmp_path, "torchrun.yaml", loading="true", extra="  fsdp_offload_params: true\n")
    reports = _reports(_run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_port", str(free_port()), str(PROBE), checkpoint, "--config", str(config)]))
    _assert_fsdp2_sharded(reports)
    assert reports[1]["meta_numel_after_from_pretrained"] == reports[1]["full_numel"]
    assert all(r["cpu_offload_policy"] == "CPUOffloadPolicy(pin_memory=False)" for r in reports), reports


def _trainer_probe(checkpoint: str, out: Path, **env: str) -> list[dict]:
    return _reports(_run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(free_port()), str(TRAINER_PROBE), checkpoint, str(out)], **env))


@pytest.fixture(scope="module")
def trainer_run(checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The Trainer probe without a budget, launched once: the plugin keys' test and the budget's
    baseline."""
    return _trainer_probe(checkpoint, tmp_path_factory.mktemp("trainer") / "out")


def test_trainer_fsdp_config_with_plugin_keys(trainer_run: list[dict]):
    reports = trainer_run
    for r in reports:
        assert r["distributed_type"] == "FSDP" and r["dtensor_params"] == r["num_params"], r
        assert r["source"] == "TrainingArguments.fsdp_config", r
        assert r["offload_enabled"] and r["offload_stats"]["offloaded_bytes"] > 0, r
        assert r["train_loss_finite"], r
    assert reports[1]["meta_numel_after_from_pretrained"] == reports[1]["full_numel"]


def test_trainer_fsdp_config_with_a_memory_budget(tmp_path: Path, checkpoint: str, trainer_run: list[dict]):
    """The Trainer's `fsdp_config` with `activation_memory_budget`: the layers follow a plan made at
    the first step, and the training loss is the one the same run without a budget gives, to the bit."""
    from fsdp_offload_cfg import load_config
    from fsdp_offload_cfg.estimate import estimate_memory

    report = estimate_memory(load_config({"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {
        "version": 2, "activation_cpu_offload": {"mode": "sync", "min_tensor_bytes": 0}}}), checkpoint, seq_len=16,
        batch_size=2, device="cpu", dtype="float32", activation_budget=2**40)
    peaks = sorted(u["device_peak_bytes"] for u in report["plan"]["uniform"].values())
    budget = (peaks[0] + peaks[-1]) // 2
    runs = {"plain": trainer_run, "budget": _trainer_probe(checkpoint, tmp_path / "budget", PROBE_BUDGET=str(budget))}
    expected = [layer["choice"] for layer in estimate_memory(load_config({
        "distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {
            "version": 2, "activation_cpu_offload": {"mode": "sync", "min_tensor_bytes": 0},
            "activation_memory_budget": budget, "activation_budget_compute_tflops": 0.05,
            "activation_budget_copy_gb_per_s": 5}}), checkpoint, seq_len=16, batch_size=2, device="cpu",
        dtype="float32")["plan"]["layers"]]
    for plain, planned in zip(runs["plain"], runs["budget"]):
        assert plain["choices"] is None and planned["choices"] == expected, (planned["choices"], expected)
        assert planned["training_loss"] == plain["training_loss"], (planned, plain)
    assert expected != ["keep"] * len(expected)  # halfway between the settings' peaks: not the plain run


def test_the_estimate_of_a_trainers_file_holds_what_its_trainer_holds(tmp_path: Path, checkpoint: str,
                                                                      capsys: pytest.CaptureFixture[str]):
    """A TrainingArguments file with `bf16: true` over a bf16 model: the Trainer's accelerate
    keeps float32 masters (1.13: bf16), and the estimate of that same file counts rank 0's
    parameter bytes and dtype as the real rank 0 holds them after a step. Before, the estimate
    read no precision from such a file: bf16, half the bytes."""
    from fsdp_offload_cfg import cli

    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({
        "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 2, "max_steps": 1, "bf16": True,
        "use_cpu": True, "save_strategy": "no", "report_to": [], "fsdp": "full_shard auto_wrap",
        "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}))
    real = _reports(_run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port()), str(HERE / "scripts" / "trainer_file_probe.py"), str(args_file), checkpoint]))
    assert cli.main(["estimate", str(args_file), "--model", checkpoint, "--seq-len", "16", "--num-processes", "2",
                     "--device", "cpu", "--dtype", "bfloat16", "--format", "json"]) == 0
    estimated = json.loads(capsys.readouterr().out)
    assert real[0]["mixed_precision"] == "bf16"
    assert real[0]["param_dtypes"] == [estimated["inputs"]["storage_dtype"]], (real[0], estimated["inputs"])
    assert estimated["per_rank"]["params_bytes"] == real[0]["param_bytes"], (estimated["per_rank"], real[0])


FSDP1_YAML = """\
distributed_type: FSDP
num_machines: 1
machine_rank: 0
num_processes: 2
mixed_precision: 'no'
use_cpu: true
fsdp_config:
  fsdp_version: 1
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_use_orig_params: true
  fsdp_sync_module_states: false
  fsdp_cpu_ram_efficient_loading: false
  activation_cpu_offload: true
"""


def test_accelerate_launch_fsdp1_with_activation_offload(tmp_path: Path, checkpoint: str):
    config = tmp_path / "fsdp1.yaml"
    config.write_text(FSDP1_YAML)
    reports = _reports(_accelerate_launch(config, checkpoint))
    for r in reports:
        assert r["distributed_type"] == "FSDP" and "fsdp1-prepare-model" in r["patches"], r
        assert r["optimizer_holds_model_params"] and r["losses_finite"], r
        assert r["offload_stats"]["offloaded_bytes"] > 0, r
    assert reports[0]["losses"] == reports[1]["losses"]


def _plain_digests(checkpoint: str) -> dict[str, str]:
    """What a plain single-process `from_pretrained` holds, in the probe's digest format."""
    import hashlib

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tensors = dict(model.state_dict())
    tensors.update(dict(model.named_buffers()))
    return {
        name: f"{t.dtype}:{tuple(t.shape)}:"
        + hashlib.sha1(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, t in tensors.items()
    }


# Each strategy once under the launcher: what a launch adds (its exports, its process group) is the
# same for every model; each model under each strategy is test_loading.py's matrix (forked ranks).
# Each launch also carries one script shape: the loader beside the activation offload, and a
# script that loads the model before it builds the Accelerator (the patched loader then starts
# the gloo group itself).
@pytest.mark.parametrize(
    "builder, strategy, extra, probe_args",
    [(save_deepseek_v3, "broadcast", "  activation_cpu_offload: true\n", ()),
     (save_qwen2_tied, "sharded", "", ("--load-before-accelerator",))],
    ids=["deepseek_v3-broadcast-offload", "qwen2_tied-sharded-load_first"],
)
def test_accelerate_launch_loads_exactly_what_a_plain_load_gives(tmp_path: Path, builder, strategy: str, extra: str,
                                                                 probe_args: tuple[str, ...]):
    """Through the real prepare path: persistent router bias (stock accelerate crashes on it),
    yarn RoPE buffers, bf16 weights, per-expert keys stacked on load, tied embeddings; every
    tensor equal on both ranks."""
    checkpoint = builder(str(tmp_path / "ckpt"))
    expected = _plain_digests(checkpoint)
    config = tmp_path / "loader.yaml"
    config.write_text(CPU_YAML.format(use_cpu="true", loading="true",
                                      extra=f"  load_strategy: {strategy}\n{extra}").replace(
        "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n", ""))
    reports = _reports(_accelerate_launch(config, checkpoint, "--steps", "1", *probe_args))
    _assert_fsdp2_sharded(reports)
    for r in reports:
        assert "overridden" not in r["source"], r["source"]  # nothing typed: accelerate's own exports are no override
        assert r["state_digests"] == expected, sorted(
            k for k in expected if r["state_digests"].get(k) != expected[k])
        # no rank reads a weight in from_pretrained, rank 0 included: per-expert keys that
        # transformers 5 stacks on load are read expert by expert at prepare
        assert r["meta_numel_after_from_pretrained"] == r["full_numel"]
        assert r["offload_enabled"] == bool(extra), r
        if extra:
            assert r["offload_stats"]["offloaded_bytes"] > 0, r
    if builder is save_qwen2_tied:
        assert all(r["tied_after_prepare"] and r["tied_after_steps"] for r in reports)


def _torchrun_exit_race(*args: str) -> Launch:
    return _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                 "--master_port", str(free_port()), str(EXIT_RACE_PROBE), *args], timeout=180)


def test_exit_while_a_gloo_worker_still_holds_a_collective_is_clean():
    """The gloo exit-abort race, forced (see `fsdp_offload_cfg.clean_exit`): torch alone aborts."""
    control = _torchrun_exit_race("--no-patch")
    if control.proc.returncode == 0:
        pytest.skip("this torch no longer aborts when a gloo worker outlives the script: nothing to guard")
    assert "terminate called without an active exception" in control.output, control.output[-3000:]

    guarded = _torchrun_exit_race()
    assert guarded.proc.returncode == 0, guarded.output[-3000:]
    assert "terminate called" not in guarded.output
