"""axolotl's own config loader with our plugin listed (`plugins:` in the axolotl YAML): the
`axolotl-plugin` CI leg, where `pip install axolotl==0.19.0` chose the versions (transformers
5.16.1, accelerate 1.13.0, trl 1.9, peft 0.20). Skipped where axolotl is not installed.

Most tests stop where axolotl hands over to training: its `load_cfg` (which registers plugins,
then validates with its schema), its plugin manager's `pre_model_load`, its trainer builder's
training-argument kwargs and its `AxolotlTrainingArguments`. Each runs in a fresh process:
`load_cfg` exports accelerate's variables and the plugin manager is a process-wide singleton.

Some run `axolotl train` whole, on 2 gloo CPU ranks (one under `rl: dpo`, read after its
training by the Trainer probe, for the estimate of its file). axolotl 0.19 trains on CUDA only because it
builds its device mesh for "cuda" whatever the machine has; `axolotl_cpu/sitecustomize.py` builds
that one mesh on the CPU where there is no CUDA, and changes nothing else.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("axolotl")

PLUGIN = "fsdp_offload_cfg.integrations.axolotl.FsdpOffloadCfgPlugin"

PROBE = textwrap.dedent("""
    import json, sys
    from axolotl.cli.config import load_cfg
    from axolotl.core.builders import HFCausalTrainerBuilder
    from axolotl.core.training_args import AxolotlTrainingArguments
    from axolotl.integrations.base import PluginManager
    from transformers import AutoTokenizer
    from fsdp_offload_cfg import registry

    def active():
        s = registry.active()
        return None if s is None else {"source": s.source, "load_strategy": s.config.load_strategy,
                                       "offload": s.config.activation_cpu_offload.enabled}

    if sys.argv[2:] == ["patch"]:  # as `fsdp-offload-cfg run` does first in every process
        import fsdp_offload_cfg
        fsdp_offload_cfg.patch()
    out = {}
    try:
        cfg = load_cfg(sys.argv[1])
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        print("PROBE " + json.dumps(out)); sys.exit(0)
    out["after_load_cfg"] = active()
    PluginManager.get_instance().pre_model_load(cfg)
    builder = HFCausalTrainerBuilder(cfg, None, AutoTokenizer.from_pretrained(cfg.base_model))
    kwargs, _ = builder._set_base_training_args(4)  # what axolotl hands its TrainingArguments
    out["trainer_fsdp_config"] = dict(kwargs["fsdp_config"])
    AxolotlTrainingArguments(output_dir=cfg.output_dir, fsdp=kwargs["fsdp"], fsdp_config=kwargs["fsdp_config"])
    out["after_training_arguments"] = active()
    print("PROBE " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fsdp_offload_cfg.testing.clients import save_char_llama

    root = tmp_path_factory.mktemp("axolotl")
    save_char_llama(root / "model", per_character=False)  # sequence_len 64: see its docstring
    (root / "data.jsonl").write_text("".join(json.dumps({"instruction": "abc", "input": "", "output": "def"}) + "\n"
                                             for _ in range(8)))
    return root


def _probe(root: Path, fsdp_config: dict, *probe_args: str, **top: object) -> tuple[dict, str]:
    import yaml

    cfg = {"base_model": str(root / "model"), "output_dir": str(root / "out"), "sequence_len": 64,
           "micro_batch_size": 1, "max_steps": 4, "learning_rate": 1e-3, "optimizer": "adamw_torch",
           "datasets": [{"path": str(root / "data.jsonl"), "type": "alpaca", "ds_type": "json"}],
           "plugins": [PLUGIN], "fsdp_version": 2, "fsdp_config": fsdp_config, **top}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    path = root / "axolotl.yml"
    path.write_text(yaml.safe_dump(cfg))
    (root / "probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    env.update(AXOLOTL_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(root / "probe.py"), str(path), *probe_args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=root)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("PROBE ")), proc.stdout + proc.stderr


BASE = {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "state_dict_type": "FULL_STATE_DICT", "cpu_ram_efficient_loading": True}


def test_the_plugin_turns_the_package_on_from_the_axolotl_config_alone(model: Path):
    """axolotl's schema drops the fsdp_config keys it does not know: without the plugin
    `load_strategy` and `activation_cpu_offload` would do nothing, silently. With it, the config
    is ours from `load_cfg` on, and the Trainer's fsdp_config axolotl builds carries our keys, so
    the TrainingArguments keep the run on the same config."""
    out, text = _probe(model, {**BASE, "load_strategy": "sharded", "activation_cpu_offload": True,
                               "final_state_dict_type": "FULL_STATE_DICT"})  # axolotl's own key, left to it
    assert out["after_load_cfg"] == {"source": f"argument (axolotl config {model / 'axolotl.yml'})",
                                     "load_strategy": "sharded", "offload": True}
    assert out["trainer_fsdp_config"]["load_strategy"] == "sharded"
    assert out["trainer_fsdp_config"]["activation_cpu_offload"] is True
    assert out["after_training_arguments"]["load_strategy"] == "sharded"
    assert out["after_training_arguments"]["offload"] is True
    assert "[fsdp_offload_cfg rank 0] config from argument (axolotl config" in text
    assert "list fsdp_offload_cfg.integrations.axolotl.FsdpOffloadCfgPlugin" not in text


def test_without_the_plugin_the_trainer_arguments_say_how_to_keep_our_keys(model: Path):
    """`fsdp-offload-cfg run -- axolotl train` alone: axolotl dropped load_strategy before our
    Trainer-arguments source sees it; the run goes on with what is left (auto), and says how to
    keep the rest."""
    out, text = _probe(model, {**BASE, "load_strategy": "sharded"}, "patch", plugins=None)
    assert out["after_load_cfg"]["load_strategy"] == "auto"  # nothing to patch for FSDP yet: the defaults
    assert "load_strategy" not in out["trainer_fsdp_config"]
    assert out["after_training_arguments"]["load_strategy"] == "auto"
    assert "list fsdp_offload_cfg.integrations.axolotl.FsdpOffloadCfgPlugin under plugins:" in text


def test_axolotls_own_fsdp_config_keys_are_not_refused_as_typos(model: Path):
    """axolotl passes its own keys (final_state_dict_type, cpu_offload_pin_memory,
    mixed_precision_policy) on to its TrainingArguments' fsdp_config; our schema refused them there
    (ConfigError at the Trainer arguments), for every axolotl FSDP config that set one."""
    out, _ = _probe(model, {**BASE, "final_state_dict_type": "SHARDED_STATE_DICT", "cpu_offload_pin_memory": True,
                            "mixed_precision_policy": "bf16"})
    assert "error" not in out, out
    assert out["after_training_arguments"] is not None


def test_a_typo_in_the_axolotl_fsdp_config_stops_load_cfg_naming_the_key_and_the_file(model: Path):
    out, _ = _probe(model, {**BASE, "load_strategi": "sharded"})
    assert out["error"].startswith("ConfigError"), out
    assert f"axolotl config {model / 'axolotl.yml'}: fsdp_config.load_strategi: unknown key" in out["error"]
    assert "load_strategy" in out["error"]  # the suggestion


def test_axolotls_activation_offloading_beside_ours_is_refused_naming_both(model: Path):
    out, _ = _probe(model, {**BASE, "activation_cpu_offload": True}, activation_offloading=True)
    assert out["error"].startswith("ConfigError"), out
    assert "activation_offloading" in out["error"] and "fsdp_config.activation_cpu_offload" in out["error"]


TRAIN = {"baseline": {"cpu_ram_efficient_loading": False},
         "sharded_offload": {"load_strategy": "sharded", "activation_cpu_offload": True},
         # FSDP's checkpointing (axolotl applies it in its fsdp2_prepare_model), with which the offload composes
         "broadcast_offload_checkpointing": {"load_strategy": "broadcast", "activation_cpu_offload": True,
                                             "activation_checkpointing": True},
         # planned per layer at the first forward (the smallest peak a plan reaches here is 0.2 MiB), at
         # rates stated so that the plan is the same every run (a CI run once measured copies too slow to offload
         # and planned checkpointing alone): copies fast enough to offload layer 0
         "sharded_budget": {"load_strategy": "sharded", "activation_memory_budget": 250_000,
                            "activation_budget_compute_tflops": 0.05, "activation_budget_copy_gb_per_s": 100}}


def _train(root: Path, variant: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = root / f"out_{variant}"
    fsdp_config = {**BASE, "cpu_ram_efficient_loading": True, **TRAIN[variant]}
    cfg = {"base_model": str(root / "model"), "output_dir": str(out), "sequence_len": 64, "micro_batch_size": 1,
           "max_steps": 4, "learning_rate": 1e-3, "optimizer": "adamw_torch", "seed": 0,
           "bf16": False, "fp16": False,  # float32: axolotl's float16 on the CPU gives NaN from step 2, plugin or not
           "datasets": [{"path": str(root / "data.jsonl"), "type": "alpaca", "ds_type": "json"}],
           "dataset_prepared_path": str(root / f"prepared_{variant}"),
           "plugins": [PLUGIN], "fsdp_version": 2, "fsdp_config": fsdp_config}
    return _axolotl_train(root, root / f"train_{variant}.yml", cfg), out


def _axolotl_train(root: Path, path: Path, cfg: dict, probe: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`axolotl train PATH` (CFG written there) as a user types it: axolotl execs `accelerate
    launch`, which reads accelerate's default config (2 CPU processes) from `$HF_HOME/accelerate`.
    `probe`: where the Trainer probe writes, for a CFG that lists `axolotl_probe_plugin.TrainerProbe`
    (in tests/scripts, put on the path)."""
    import yaml

    from fsdp_offload_cfg.testing.dist import free_port

    path.write_text(yaml.safe_dump(cfg))
    home = root / "hf"
    (home / "accelerate").mkdir(parents=True, exist_ok=True)
    (home / "accelerate" / "default_config.yaml").write_text(yaml.safe_dump({
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_machines": 1, "num_processes": 2,
        "machine_rank": 0, "mixed_precision": "no", "use_cpu": True, "rdzv_backend": "static",
        "main_process_port": free_port()}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", HF_HOME=str(home),
               # before, not instead of, a PYTHONPATH the package may be reached through (`pip --target`)
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent / "axolotl_cpu"),
                                                        str(Path(__file__).parents[1] / "scripts") if probe else None,
                                                        env.get("PYTHONPATH")])),
               AXOLOTL_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    if probe is not None:
        env["PROBE_DIR"] = str(probe)
    proc = subprocess.run([str(Path(sys.executable).parent / "axolotl"), "train", str(path)], capture_output=True,
                          text=True, timeout=420, env=env, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _trained(out: Path) -> tuple[dict, list[float]]:
    from safetensors.torch import load_file

    history = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    return load_file(out / "model.safetensors"), [h["loss"] for h in history if "loss" in h]


@pytest.fixture(scope="module")
def baseline(model: Path) -> tuple[dict, list[float]]:
    return _trained(_train(model, "baseline")[1])


@pytest.mark.parametrize("variant", ["sharded_offload", "broadcast_offload_checkpointing", "sharded_budget"])
def test_axolotl_train_with_the_plugin_saves_what_the_run_without_it_saves(model: Path, baseline, variant: str):
    """The whole `axolotl train`, with the plugin listed: axolotl replaces accelerate's
    `fsdp2_prepare_model` with its own copy when it loads the model, which left the loader's meta
    model unfilled ("still on the meta device", every rank) until ours ran around theirs. Same
    losses and saved weights, bit for bit, as the run with the loader and the offload off."""
    import torch

    proc, out = _train(model, variant)
    weights, losses = _trained(out)
    base_weights, base_losses = baseline
    assert len(losses) == 4 and losses == base_losses
    assert weights.keys() == base_weights.keys()
    assert all(torch.equal(weights[k], base_weights[k]) for k in weights)
    text = proc.stdout + proc.stderr
    assert "[fsdp_offload_cfg rank 0] config from argument (axolotl config" in text
    assert "replaced after patch() (by axolotl.monkeypatch.accelerate.fsdp2.fsdp2_prepare_model)" in text
    if variant.startswith("sharded"):  # each rank reads its own slices, rank 0 streams nothing
        assert "[fsdp_offload_cfg rank 0] sharded loading: rank 0 read" in text
        assert "rank-0 loading: sent" not in text, text[-3000:]
    else:
        assert "[fsdp_offload_cfg rank 0] rank-0 loading: sent" in text
    if variant.endswith("budget"):  # the plan's line, at the rates stated
        assert re.search(r"\[fsdp_offload_cfg rank 0\] activation_memory_budget \S+ (B|KiB|MiB|GiB) at 1 x 64 tokens per rank: "
                         r"layer 0: offload; .*, from the config\)", text), text[-3000:]
    moved = re.search(r"activation offload moved .* \((\d+) tensors\)", text)
    assert moved and int(moved.group(1)) > 0, text[-3000:]


def test_axolotl_dpo_with_the_plugin_fills_its_reference_model_and_the_estimate_counts_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """`rl: dpo` of a full fine-tune, the whole `axolotl train` on 2 gloo ranks with our plugin
    listed (meta loading auto), read after its training by the Trainer probe. axolotl loads the
    model a second time and shards it for TRL's DPOTrainer through its own `prepare_fsdp`, which
    it puts into TRL past ours: that reference model reached axolotl's sharding still on meta,
    and every rank stopped ("still on the meta device"). Now the loader fills both: the first
    step's loss is ln 2 and its rewards 0, as where policy and reference are the same weights.
    And the estimate of that same file counts rank 0's reference and parameter bytes and the
    forward's batch of 4 for a micro-batch of 2 (TRL's collator puts each sample's chosen and
    rejected completions in one batch). Before, it read every axolotl file as fine-tuning."""
    import math

    from fsdp_offload_cfg import cli
    from fsdp_offload_cfg.testing.clients import assert_the_estimate_holds_the_preference_run, save_char_llama

    save_char_llama(tmp_path / "model")  # one token a character: the chatml prompt and its completions fit 64
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"prompt": "ab", "chosen": "cd", "rejected": "ef"}) + "\n"
                                                  for _ in range(8)))
    probe = tmp_path / "probe"
    probe.mkdir()
    config = tmp_path / "dpo.yml"
    proc = _axolotl_train(tmp_path, config, {
        "base_model": str(tmp_path / "model"), "output_dir": str(tmp_path / "out"), "rl": "dpo", "sequence_len": 64,
        "micro_batch_size": 2, "max_steps": 1, "learning_rate": 1e-3, "optimizer": "adamw_torch", "bf16": False,
        "fp16": False, "datasets": [{"path": str(tmp_path / "pairs.jsonl"), "type": "chatml", "ds_type": "json",
                                     "split": "train"}],
        "dataset_prepared_path": str(tmp_path / "prepared"), "plugins": [PLUGIN, "axolotl_probe_plugin.TrainerProbe"],
        "fsdp_version": 2, "fsdp_config": BASE}, probe)
    real = json.loads((probe / "rank0.json").read_text())
    assert (proc.stdout + proc.stderr).count("[fsdp_offload_cfg rank 0] sharded loading: rank 0 read") == 2
    first = real["log_history"][0]
    assert (first["rewards/chosen"], first["rewards/rejected"]) == (0.0, 0.0), first
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6), first
    assert cli.main(["estimate", str(config), "--num-processes", "2", "--device", "cpu", "--format", "json"]) == 0
    estimated = json.loads(capsys.readouterr().out)
    assert_the_estimate_holds_the_preference_run(real, estimated, forward_batch=4)
    assert "a reference model: axolotl's rl: dpo" in estimated["assumptions"][0]
