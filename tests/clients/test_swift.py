"""ms-swift's own CLI (`swift sft`; `swift rlhf` for the estimate), run through `fsdp-offload-cfg
run` with no code of ours in between, on 2 gloo CPU ranks (`NPROC_PER_NODE=2` makes ms-swift start
torchrun): the `swift` CI leg, where `pip install ms-swift==4.6.0` chose the versions (transformers
5.19, accelerate 1.15, trl 0.29, peft 0.20). Skipped where ms-swift is not installed (the other
legs).

The plugin's config travels in ms-swift's `--fsdp` JSON (`fsdp` + `fsdp_config`, handed to the
Trainer's arguments). Against the same run with the loader and offload off: full SFT under broadcast
(through `run`) and auto + offload (through ms-swift's `--external_plugins`; auto reads sharded on
one node) saves bit-equal weights, with the lines that prove the plugin is on (ms-swift's own save
streamed, one weight at a time on rank 0), and so does an
activation budget (planned per layer, ms-swift's checkpointing off); an offload left with nothing to
move under ms-swift's default gradient checkpointing says so at the end; LoRA under both strategies
saves the same adapters (ms-swift seeds each rank differently); the unprefixed
`activation_cpu_offload` (ms-swift's own key too, which turns its offloader on beside ours) stops
every rank naming both.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("swift")

BIN = Path(sys.executable).parent
FSDP = {"fsdp_version": 2, "fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "state_dict_type": "FULL_STATE_DICT"}  # ms-swift refuses save_only_model with sharded state dicts
PLUGIN = {
    "baseline": {"fsdp_cpu_ram_efficient_loading": False},
    "broadcast": {"fsdp_cpu_ram_efficient_loading": True, "fsdp_load_strategy": "broadcast"},
    "sharded": {"fsdp_cpu_ram_efficient_loading": True, "fsdp_load_strategy": "sharded"},
    "auto_offload": {"fsdp_cpu_ram_efficient_loading": True, "fsdp_activation_cpu_offload": True},
    "colliding_spelling": {"fsdp_cpu_ram_efficient_loading": True, "activation_cpu_offload": True},
}
ARGS = ["--model_type", "llama", "--template", "default", "--system", "x", "--tuner_type", "full",
        "--max_steps", "4", "--per_device_train_batch_size", "2", "--learning_rate", "1e-3",
        "--lr_scheduler_type", "constant", "--warmup_ratio", "0", "--seed", "0", "--save_strategy", "steps",
        "--save_steps", "4", "--save_only_model", "true", "--add_version", "false", "--report_to", "none",
        "--logging_steps", "1", "--max_length", "200", "--dataset_num_proc", "1", "--dataloader_num_workers", "0",
        "--split_dataset_ratio", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a character-level tokenizer and a chat data set."""
    from fsdp_offload_cfg.testing.clients import save_char_llama

    root = tmp_path_factory.mktemp("swift")
    save_char_llama(root / "model")
    with open(root / "data.jsonl", "w") as f:
        for n in range(1, 41):
            messages = [{"role": "user", "content": f"Count to {n}."},
                        {"role": "assistant", "content": " ".join(str(i) for i in range(1, n + 1))}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return root


def _train(files: Path, variant: str, *extra: str, plugin: dict | None = None,
           entry: str = "run") -> tuple[subprocess.CompletedProcess[str], Path]:
    """One `swift sft` under `fsdp-offload-cfg run` (`entry="run"`), or with the plugin's file in
    ms-swift's `--external_plugins` (`entry="external_plugins"`); the plugin's keys are
    `PLUGIN[variant]` unless given."""
    from fsdp_offload_cfg.testing.dist import free_port

    name = variant + "".join(a.strip("-") for a in extra)
    out = files / f"out_{name}"
    shutil.rmtree(out, ignore_errors=True)
    fsdp = files / f"fsdp_{variant}.json"
    fsdp.write_text(json.dumps({"fsdp": "full_shard auto_wrap", "fsdp_config": {**FSDP, **(plugin or PLUGIN[variant])}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               USE_HF="1", OMP_NUM_THREADS="1", NPROC_PER_NODE="2", MASTER_PORT=str(free_port()),
               CUDA_VISIBLE_DEVICES="")  # fmt: skip
    if entry == "run":
        prefix, extra = [str(BIN / "fsdp-offload-cfg"), "run", "--"], extra
    else:
        path = subprocess.run([str(BIN / "fsdp-offload-cfg"), "swift-plugin"], capture_output=True, text=True,
                              check=True, timeout=60).stdout.strip()
        prefix, extra = [], (*extra, "--external_plugins", path)
    command = [*prefix, "swift", "sft", "--model", str(files / "model"), "--dataset", str(files / "data.jsonl"),
               "--output_dir", str(out), "--fsdp", str(fsdp), *ARGS, *extra]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=420, env=env, cwd=files)
    return proc, out


def _weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "checkpoint-4" / "model.safetensors")


@pytest.fixture(scope="module")
def baseline(files: Path) -> dict:
    proc, out = _train(files, "baseline")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _weights(out)


def test_sft_under_broadcast_saves_what_the_run_without_the_loader_saves(files: Path, baseline: dict):
    """Each of the loader's two ways of filling the shards is run once under ms-swift: broadcast
    here, sharded (what auto picks on one node) with offload through `--external_plugins` below.
    The launches with `sharded` and `auto` + offload through `run` took about 50 s of CI each
    (ms-swift imports for seconds on every rank) and ran paths the other two run."""
    import torch

    proc, out = _train(files, "broadcast")
    assert proc.returncode == 0, proc.stderr[-4000:]
    weights = _weights(out)
    assert weights.keys() == baseline.keys() and all(torch.equal(weights[k], baseline[k]) for k in baseline)
    assert ("[fsdp_offload_cfg rank 0] config from TrainingArguments.fsdp_config (FSDP2, meta loading: broadcast, "
            "activation offload: off)") in proc.stderr, proc.stderr[-3000:]
    # ms-swift's own `_save` writes through `save_pretrained`: streamed, rank 0 holding one weight at a time, where
    # it had gathered the whole model on rank 0's host
    assert "each weight gathered to rank 0 as it is written (one at a time)" in proc.stderr, proc.stderr[-3000:]


LORA = ("--tuner_type", "lora", "--lora_rank", "4", "--target_modules", "q_proj", "v_proj")


@pytest.fixture(scope="module")
def lora_baseline(files: Path) -> dict:
    proc, out = _train(files, "baseline", *LORA)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _adapters(out)


def _adapters(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "checkpoint-4" / "adapter_model.safetensors")


@pytest.mark.parametrize("variant", ["broadcast", "sharded"])
def test_lora_saves_the_adapters_the_run_without_the_loader_saves(files: Path, lora_baseline: dict, variant: str):
    """ms-swift seeds each rank with seed + rank, so each rank's PEFT draws other adapters, and a
    plain FSDP2 run keeps each rank's own rows of them. Before, the loader gave every rank rank 0's
    (sharded: rank 0's region sent; broadcast: rank 0's RNG state after the load): other adapters,
    another training, silently."""
    import torch

    proc, out = _train(files, variant, *LORA)
    assert proc.returncode == 0, proc.stderr[-4000:]
    adapters = _adapters(out)
    assert adapters.keys() == lora_baseline.keys() and len(adapters) > 0
    differ = [k for k in lora_baseline if not torch.equal(adapters[k], lora_baseline[k])]
    assert not differ, differ


def test_the_external_plugins_entry_turns_the_plugin_on_without_run(files: Path, baseline: dict):
    """`swift sft --external_plugins $(fsdp-offload-cfg swift-plugin)`, no `fsdp-offload-cfg run`:
    ms-swift imports the file in each training process before it builds the Trainer's arguments;
    auto + offload (ms-swift's own checkpointing off: under it the offload has nothing to move)
    saves the baseline's weights, with the lines that say auto read sharded and the offload moved."""
    import torch

    proc, out = _train(files, "auto_offload", "--gradient_checkpointing", "false", entry="external_plugins")
    assert proc.returncode == 0, proc.stderr[-4000:]
    weights = _weights(out)
    assert weights.keys() == baseline.keys() and all(torch.equal(weights[k], baseline[k]) for k in baseline)
    assert ("[fsdp_offload_cfg rank 0] config from TrainingArguments.fsdp_config (FSDP2, meta loading: auto, "
            "activation offload: on)") in proc.stderr, proc.stderr[-3000:]
    assert "[fsdp_offload_cfg rank 0] activation offload moved" in proc.stderr, proc.stderr[-3000:]
    assert "sharded loading: rank 0 read" in proc.stderr, proc.stderr[-3000:]


def test_sft_under_an_activation_budget_plans_each_layer_and_saves_what_the_baseline_saves(files: Path,
                                                                                           baseline: dict):
    """`fsdp_activation_memory_budget` in the `--fsdp` JSON: the budget is the smallest peak a plan
    reaches at `--max_length` (so every batch fits, and a batch of any length saves less than the
    plain run would), ms-swift's own gradient checkpointing turned off as the docs say; the layers
    are planned at the first step, again at longer batches, and train the baseline's weights."""
    import torch

    from fsdp_offload_cfg.testing.cli_budget import RATES, assert_planned_per_layer, smallest_budget

    plugin = {"fsdp_cpu_ram_efficient_loading": True, **RATES,
              "fsdp_activation_memory_budget": smallest_budget(str(files / "model"), seq_len=200)}
    proc, out = _train(files, "budget", "--gradient_checkpointing", "false", plugin=plugin)
    assert proc.returncode == 0, proc.stderr[-4000:]
    weights = _weights(out)
    assert weights.keys() == baseline.keys() and all(torch.equal(weights[k], baseline[k]) for k in baseline)
    assert_planned_per_layer(proc.stderr)


def test_an_offload_with_nothing_to_move_under_swifts_checkpointing_says_so(files: Path):
    proc, _ = _train(files, "auto_offload")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "activation offload was on for" in proc.stderr and "but moved nothing" in proc.stderr, proc.stderr[-3000:]
    assert "--gradient_checkpointing false" in proc.stderr


def test_the_colliding_spelling_stops_every_rank_naming_both_offloaders(files: Path):
    """Before, ms-swift's offloader started beside ours: on CPU its pinned buffers crashed the run,
    on a GPU its hooks took every activation and ours moved nothing."""
    proc, _ = _train(files, "colliding_spelling")
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "turns on both ms-swift's own activation offloader" in text and "fsdp_activation_cpu_offload" in text, \
        text[-3000:]
    assert text.count("ms-swift --fsdp JSON: fsdp_config.activation_cpu_offload") >= 1
    assert "'loss'" not in text  # nothing trained


def _probed_and_estimated(command: list[str], files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                          monkeypatch: pytest.MonkeyPatch) -> tuple[dict, dict]:
    """The ms-swift `command` (its verb, model, data and what the test is about), with an FSDP JSON
    and one step's settings added, on 2 gloo ranks through `run`: rank 0's report from the Trainer
    probe (its `--external_plugins`, read after the training), and `estimate -- command` of it."""
    from fsdp_offload_cfg import cli
    from fsdp_offload_cfg.testing.dist import free_port

    fsdp = tmp_path / "fsdp.json"
    fsdp.write_text(json.dumps({"fsdp": "full_shard auto_wrap", "fsdp_config": {**FSDP, "cpu_ram_efficient_loading": True}}))
    args = [*command, "--fsdp", str(fsdp), "--use_cpu", "true", "--max_length", "64", "--model_type", "llama",
            "--template", "default", "--system", "x", "--max_steps", "1", "--save_strategy", "no", "--add_version",
            "false", "--report_to", "none", "--dataset_num_proc", "1", "--dataloader_num_workers", "0",
            "--split_dataset_ratio", "0", "--output_dir", str(tmp_path / "out")]  # fmt: skip
    probe = tmp_path / "probe"
    probe.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               USE_HF="1", OMP_NUM_THREADS="1", NPROC_PER_NODE="2", MASTER_PORT=str(free_port()),
               CUDA_VISIBLE_DEVICES="", PROBE_DIR=str(probe))  # fmt: skip
    plugin = Path(__file__).parents[1] / "scripts" / "trainer_probe_plugin.py"
    proc = subprocess.run([str(BIN / "fsdp-offload-cfg"), "run", "--", *args, "--external_plugins", str(plugin)],
                          capture_output=True, text=True, timeout=420, env=env, cwd=files)
    assert proc.returncode == 0, proc.stderr[-4000:]
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    assert cli.main(["estimate", "--device", "cpu", "--format", "json", "--", *args]) == 0, capsys.readouterr().err
    return json.loads((probe / "rank0.json").read_text()), json.loads(capsys.readouterr().out)


def test_the_estimate_of_a_swift_command_holds_what_swift_sft_runs(files: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch):
    """`swift sft` with ms-swift's defaults left alone (LoRA rank 8 on all-linear with dropout 0.05,
    a micro-batch of 1, accumulation ceil(16 / batch / processes), gradient checkpointing, mixed
    precision by the load dtype): the estimate of that same command (`-- swift sft ...`, its
    processes from NPROC_PER_NODE) says each as the run has it (read after its training by an
    external plugin), and rank 0's parameter bytes. Before, an ms-swift command could not be
    estimated, and its `--fsdp` JSON alone read as a full fine-tune."""
    args = ["swift", "sft", "--model", str(files / "model"), "--dataset", str(files / "data.jsonl"),
            "--torch_dtype", "bfloat16"]
    real, estimated = _probed_and_estimated(args, files, tmp_path, capsys, monkeypatch)
    said = estimated["assumptions"][0]
    assert (real["mixed_precision"], estimated["inputs"]["compute_dtype"]) == ("bf16", "bfloat16"), said
    assert real["checkpointing"] and estimated["inputs"]["activation_setting"] == "checkpointing", said
    assert real["batch_size"] == estimated["inputs"]["batch_size"] == 1
    assert f"--gradient-accumulation-steps {real['gradient_accumulation_steps']} (" in said, (real, said)
    assert estimated["per_rank"]["params_bytes"] == real["param_bytes"], (estimated["per_rank"], real)  # a bf16 base
    lora = estimated["model"]["lora"]
    assert (lora["trainable_parameters"], lora["dropout"]) == (real["trainable"], real["dropout"]), (lora, real)
    assert lora["targets"] == "all-linear" and real["targets"] == \
        ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"], (lora, real)


def test_the_estimate_of_swift_rlhf_dpo_holds_its_reference_model_and_its_two_sequences_a_sample(
        files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """`swift rlhf` (DPO unset) of a full fine-tune loads a reference model, sharded beside the
    policy, and runs each sample's chosen and rejected responses in one forward: against the run
    (read after its training by an external plugin), the estimate of that same command counts rank
    0's reference bytes and the forward's batch. Before, it was read as `swift sft`: neither."""
    with open(tmp_path / "prefs.jsonl", "w") as f:
        for n in range(1, 9):
            messages = [{"role": "user", "content": f"Count to {n}."},
                        {"role": "assistant", "content": " ".join(str(i) for i in range(1, n + 1))}]
            f.write(json.dumps({"messages": messages, "rejected_response": "no"}) + "\n")
    args = ["swift", "rlhf", "--model", str(files / "model"), "--dataset", str(tmp_path / "prefs.jsonl"),
            "--tuner_type", "full", "--torch_dtype", "float32", "--gradient_accumulation_steps", "1"]
    real, estimated = _probed_and_estimated(args, files, tmp_path, capsys, monkeypatch)
    assert real["forward_batch"] == estimated["inputs"]["batch_size"] == 2, (real, estimated["inputs"])
    # the head left gathered by the reference's forward (accelerate 1.14+'s tail group): in fp16 (the mixed
    # precision here) it weighed what its fp32 shard on 2 ranks weighs, so the bytes below matched regardless
    assert real["reference_gathered"] == [], real
    assert real["reference_param_bytes"] == estimated["per_rank"]["reference_params_bytes"] > 0, \
        (real, estimated["per_rank"])
    assert "a reference model: swift rlhf --rlhf_type dpo's" in estimated["assumptions"][0]


def test_the_estimate_of_swift_rlhf_gkd_holds_its_teacher_sharded(files: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch):
    """`swift rlhf --rlhf_type gkd` loads a teacher (`--teacher_model`) that ms-swift's
    `prepare_fsdp` shards beside the model (TRL's distillation keeps its whole): against the run
    (read after its training by an external plugin), the estimate of that same command counts rank
    0's share of it. Before, ms-swift's teacher was not counted at all, and its final norm and head
    stayed gathered on every rank after its first forward. (`--lmbda 0`: the student learns from
    the data set's responses, so no step generates.)"""
    args = ["swift", "rlhf", "--rlhf_type", "gkd", "--model", str(files / "model"), "--teacher_model",
            str(files / "model"), "--teacher_model_type", "llama", "--dataset", str(files / "data.jsonl"),
            "--tuner_type", "full", "--torch_dtype",
            "bfloat16", "--lmbda", "0", "--gradient_accumulation_steps", "1"]
    real, estimated = _probed_and_estimated(args, files, tmp_path, capsys, monkeypatch)
    assert real["teacher_gathered"] == [], real  # its head left gathered by its forward (accelerate 1.14+'s tail)
    assert real["teacher_bytes"] == estimated["per_rank"]["teacher_params_bytes"] > 0, (real, estimated["per_rank"])
    assert real["reference_param_bytes"] == estimated["per_rank"]["reference_params_bytes"] == 0
