"""TRL's own CLI (`trl sft --accelerate_config F`), run through `fsdp-offload-cfg run --` with no
code of ours in between and the file named once, as users name it, on 2 gloo CPU ranks.

`trl sft` starts accelerate's launcher inside its own process, and accelerate hands its workers
only the config keys it knows (its `FSDP_*` variables): each worker finds the file on its `trl`
ancestor's command line, as it finds an `accelerate launch --config_file`. Against the same CLI
run with the loader and offload off, the loader and the offload save bit-equal weights, and the
log says the plugin is on and what the offload moved.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_offload_cfg.testing.dist import free_port

pytest.importorskip("trl.cli")
pytestmark = [pytest.mark.distributed, pytest.mark.launches]

BIN = Path(sys.executable).parent
YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: 'no'
num_machines: 1
num_processes: 2
main_process_port: {port}
use_cpu: true
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
{plugin}"""
FULL = "  fsdp_state_dict_type: FULL_STATE_DICT\n"
STOCK = FULL + "  fsdp_cpu_ram_efficient_loading: false\n"
PLUGIN = FULL + "  fsdp_cpu_ram_efficient_loading: true\n  fsdp_activation_cpu_offload: true\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a word tokenizer, and a local data set of plain text."""
    import numpy as np

    from fsdp_offload_cfg.testing.models import save_llama, save_word_tokenizer, words

    root = tmp_path_factory.mktemp("trl_cli")
    save_word_tokenizer(save_llama(str(root / "llama"), pad_token_id=0, eos_token_id=1))
    (root / "data").mkdir()
    rng = np.random.default_rng(0)
    (root / "data" / "train.jsonl").write_text("".join(json.dumps({"text": words(rng, 12)}) + "\n" for _ in range(16)))
    return root


SAVE_AT_3 = ["--save_strategy", "steps", "--save_steps", "3", "--save_only_model"]


def _trl_sft(files: Path, name: str, plugin: str, save: list[str] = SAVE_AT_3,
             in_recipe: bool = False) -> tuple[subprocess.CompletedProcess[str], Path]:  # fmt: skip
    """`fsdp-offload-cfg run -- trl sft --accelerate_config F ...`: the file named once (passing it to
    `run --config` as well hid that the workers lost the plugin's keys). `in_recipe`: named as
    `accelerate_config: F` in the YAML of `trl sft --config`, as TRL's docs also write it."""
    config, out = files / f"{name}.yaml", files / f"out_{name}"
    config.write_text(YAML.format(port=free_port(), plugin=plugin))
    named = ["--accelerate_config", str(config)]
    if in_recipe:
        (files / f"{name}_recipe.yaml").write_text(f"accelerate_config: {config}\n")
        named = ["--config", f"{name}_recipe.yaml"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    command = [str(BIN / "fsdp-offload-cfg"), "run", "--", str(BIN / "trl"), "sft", *named,
               "--model_name_or_path", str(files / "llama"),
               "--dataset_name", str(files / "data"), "--output_dir", str(out), "--max_steps", "3",
               "--per_device_train_batch_size", "2", "--learning_rate", "1e-2", "--max_length", "24", "--seed", "0",
               "--use_cpu", "--report_to", "none", "--logging_steps", "1", *save, "--dataloader_num_workers", "0",
               "--gradient_checkpointing", "false"]  # TRL checkpoints by default, leaving the offload nothing
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=files), out


def _weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "checkpoint-3" / "model.safetensors")


def test_trl_sft_under_run_saves_what_the_run_without_the_loader_and_offload_saves(files: Path):
    import torch

    stock, stock_out = _trl_sft(files, "stock", STOCK)
    assert stock.returncode == 0, stock.stderr[-4000:]
    proc, out = _trl_sft(files, "plugin", PLUGIN)
    assert proc.returncode == 0, proc.stderr[-4000:]
    expected, got = _weights(stock_out), _weights(out)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    config = files / "plugin.yaml"
    line = f"[fsdp_offload_cfg rank 0] config from trl --accelerate_config {config} (FSDP2, meta loading: auto, " \
           "activation offload: on)"
    assert line in proc.stderr, proc.stderr[-3000:]
    assert "[fsdp_offload_cfg rank 0] sharded loading: rank 0 read" in proc.stderr, proc.stderr[-3000:]
    moved = [entry for entry in proc.stderr.splitlines() if "[fsdp_offload_cfg rank 0] activation offload moved" in entry]
    assert len(moved) == 1 and "(0 tensors)" not in moved[0], proc.stderr[-3000:]


def test_the_accelerate_config_named_in_trls_config_yaml_reaches_the_workers(files: Path):
    """`accelerate_config: F` in the YAML of `trl sft --config`: TRL launched with F, but the
    workers, finding no file on the `trl` command line, ran on accelerate's `FSDP_*` variables
    without the plugin's keys (no offload), and `run` checked no file."""
    proc, _ = _trl_sft(files, "in_recipe", PLUGIN, ["--save_strategy", "no"], in_recipe=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = f"[fsdp_offload_cfg rank 0] config from accelerate_config of trl --config in_recipe_recipe.yaml: " \
           f"{files / 'in_recipe.yaml'} (FSDP2, meta loading: auto, activation offload: on)"
    assert line in proc.stderr, proc.stderr[-3000:]
    moved = [entry for entry in proc.stderr.splitlines() if "[fsdp_offload_cfg rank 0] activation offload moved" in entry]
    assert len(moved) == 1 and "(0 tensors)" not in moved[0], proc.stderr[-3000:]


def test_a_typo_in_the_file_trl_names_stops_run_before_anything_starts(files: Path):
    """The file reached the workers only through accelerate's `FSDP_*` variables, which drop
    unknown keys: a typo'd key trained and exited 0."""
    proc, out = _trl_sft(files, "typo", PLUGIN + "  fsdp_activaton_cpu_offload: true\n")
    assert proc.returncode == 1 and "fsdp_activaton_cpu_offload: unknown key" in proc.stderr, proc.stderr[-3000:]
    assert str(files / "typo.yaml") in proc.stderr and not out.exists(), proc.stderr[-3000:]


def test_trl_sft_with_fsdp2s_default_state_dict_saves_its_final_model(files: Path):
    """A file that does not name `fsdp_state_dict_type` gets accelerate's FSDP2 default,
    `SHARDED_STATE_DICT`, under which `trainer.save_model(output_dir)`, the last line of `trl sft`,
    wrote nothing: with `--save_strategy no` the run kept no model (patch `trainer-final-model`)."""
    from safetensors.torch import load_file

    plugin = "  fsdp_cpu_ram_efficient_loading: true\n"
    proc, out = _trl_sft(files, "default_state_dict", plugin, ["--save_strategy", "no"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "model.safetensors").exists(), sorted(os.listdir(out)) if out.exists() else "no output folder"
    assert "the state dict is sharded (fsdp_state_dict_type SHARDED_STATE_DICT" in proc.stderr, proc.stderr[-3000:]
    saved, loaded = load_file(out / "model.safetensors"), load_file(files / "llama" / "model.safetensors")
    assert saved.keys() == loaded.keys() and (out / "config.json").exists()


def _probed_trl_script(verb: str, recipe: Path, tmp_path: Path, cwd: Path, steps: int = 1) -> dict:
    """TRL's own `VERB` script on 2 gloo ranks (torchrun) with `--config recipe`, `steps` steps;
    rank 0's report from the Trainer probe (tests/scripts/trainer_probe_plugin.py), and the run's
    output under "text"."""
    from fsdp_offload_cfg.testing.dist import free_port

    probe = Path(__file__).parent / "scripts" / "trl_script_probe.py"
    out = tmp_path / "probe"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PROBE_DIR=str(out))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(probe), verb, "--config", str(recipe), "--output_dir",
                           str(tmp_path / "out"), "--max_steps", str(steps), "--use_cpu", "--report_to", "none",
                           "--save_strategy", "no", "--dataloader_num_workers", "0"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {**json.loads((out / "rank0.json").read_text()), "text": proc.stdout + proc.stderr}


def test_the_estimate_of_a_trl_config_holds_what_trl_sft_runs(files: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]):
    """A TRL config that says neither `bf16` nor `gradient_checkpointing` nor `dtype`, with
    `use_peft: true`: TRL's `sft` script (on 2 gloo ranks) runs bf16 mixed precision, checkpoints
    every layer, loads in float32, takes TrainingArguments' micro-batch of 8 and trains rank-16
    adapters on PEFT's default modules with dropout 0.05. The estimate of that same file says
    each, and counts rank 0's parameter bytes and the trainable parameters as TRL's run holds them. Before, it read the file as the Trainer's:
    no mixed precision, no checkpointing, and a full fine-tune."""
    from fsdp_offload_cfg import cli

    recipe = tmp_path / "sft.yaml"
    recipe.write_text(f"model_name_or_path: {files / 'llama'}\ndataset_name: {files / 'data'}\ndataset_text_field: text\n"
                      "max_length: 16\nuse_peft: true\nfsdp: full_shard auto_wrap\n"
                      "fsdp_config:\n  version: 2\n  transformer_layer_cls_to_wrap: [LlamaDecoderLayer]\n")
    real = _probed_trl_script("sft", recipe, tmp_path, cwd=files)
    assert cli.main(["estimate", str(recipe), "--num-processes", "2", "--device", "cpu", "--format", "json"]) == 0
    estimated = json.loads(capsys.readouterr().out)
    assert (real["mixed_precision"], estimated["inputs"]["compute_dtype"]) == ("bf16", "bfloat16")
    assert real["checkpointing"] and estimated["inputs"]["activation_setting"] == "checkpointing"
    assert real["batch_size"] == estimated["inputs"]["batch_size"] == 8  # TrainingArguments' default, kept by TRL
    assert real["param_dtypes"] == [estimated["inputs"]["storage_dtype"]] == ["float32"], (real, estimated["inputs"])
    assert estimated["per_rank"]["params_bytes"] == real["param_bytes"], (estimated["per_rank"], real)
    # TRL scores the tokens through its fused LM head: the output layer's own forward never runs, no logits
    assert (real["output_layer_training_forwards"], estimated["inputs"]["loss_head"]) == (0, "trl_fused_lm_head")
    lora = estimated["model"]["lora"]
    assert (lora["trainable_parameters"], lora["targets"], lora["dropout"]) == \
        (real["trainable"], real["targets"], real["dropout"]), (lora, real)


def test_the_estimate_of_trl_dpo_holds_its_reference_model_and_its_two_sequences_a_sample(
        files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """`trl dpo` without PEFT loads a reference model, sharded beside the policy in the load dtype,
    and its collator puts each sample's chosen and rejected completions in one forward: twice the
    micro-batch. TRL's own `dpo` script (2 gloo ranks, a probe on `Trainer.train`) against
    `estimate -- trl dpo`: rank 0's reference bytes and the largest batch the policy's forward
    took. Before, the estimate counted neither (half the activations, no reference); nor, later,
    for the same script launched by hand (`accelerate launch trl/scripts/dpo.py`, torchrun)."""
    import numpy as np

    from fsdp_offload_cfg import cli
    from fsdp_offload_cfg.testing.models import words

    rng = np.random.default_rng(0)
    (tmp_path / "prefs").mkdir()
    (tmp_path / "prefs" / "train.jsonl").write_text("".join(json.dumps(
        {"prompt": words(rng, 4), "chosen": words(rng, 4), "rejected": words(rng, 4)}) + "\n" for _ in range(8)))
    (tmp_path / "fsdp.yaml").write_text("distributed_type: FSDP\nmixed_precision: 'no'\nnum_processes: 2\n"
                                        "use_cpu: true\nfsdp_config:\n  fsdp_version: 2\n"
                                        "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n")
    recipe = tmp_path / "dpo.yaml"
    recipe.write_text(f"model_name_or_path: {files / 'llama'}\ndataset_name: {tmp_path / 'prefs'}\nmax_length: 16\n"
                      "per_device_train_batch_size: 2\naccelerate_config: fsdp.yaml\nfsdp: full_shard auto_wrap\n"
                      "fsdp_config:\n  version: 2\n  transformer_layer_cls_to_wrap: [LlamaDecoderLayer]\n")
    real = _probed_trl_script("dpo", recipe, tmp_path, cwd=tmp_path)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["estimate", "--device", "cpu", "--format", "json", "--", "trl", "dpo", "--config", "dpo.yaml"]) \
        == 0, capsys.readouterr().err
    estimated = json.loads(capsys.readouterr().out)
    assert real["forward_batch"] == estimated["inputs"]["batch_size"] == 4, (real, estimated["inputs"])
    assert real["reference_param_bytes"] == estimated["per_rank"]["reference_params_bytes"] > 0, \
        (real, estimated["per_rank"])
    assert real["param_bytes"] == estimated["per_rank"]["params_bytes"], (real, estimated["per_rank"])
    assert (real["output_layer_training_forwards"], estimated["inputs"]["loss_head"]) == (0, "trl_fused_lm_head")
    import trl

    script = str(Path(trl.__file__).parent / "scripts" / "dpo.py")  # what `trl dpo` launches, launched by hand
    for launch in (["accelerate", "launch", "--config_file", "fsdp.yaml", script],
                   ["torchrun", "--nproc_per_node", "2", "-m", "trl.scripts.dpo"]):
        assert cli.main(["estimate", "--device", "cpu", "--format", "json", "--", *launch, "--config", "dpo.yaml"]) \
            == 0, capsys.readouterr().err
        by_script = json.loads(capsys.readouterr().out)
        assert (by_script["inputs"]["batch_size"], by_script["per_rank"]["reference_params_bytes"]) == \
            (real["forward_batch"], real["reference_param_bytes"]), launch


@pytest.mark.parametrize("verb", ["kto", "grpo"])
def test_the_estimate_holds_the_reference_model_of_trl_kto_and_of_trl_grpo_with_a_kl_term(
        verb: str, files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """`trl kto` loads a reference model as `trl dpo` does, and `trl grpo` one for its KL term
    where `beta` is not 0 (here 0.04): TRL's own script (2 gloo ranks, a probe on `Trainer.train`)
    against `estimate -- trl VERB`: rank 0's reference bytes, and the largest batch the policy's
    forward took (KTO's mismatched KL completions run without gradients, in forwards of their
    own: one sequence a sample); and GRPO's reward model (`reward_model_name_or_path`), which TRL
    prepares in evaluation mode, whole on every rank. Before, the estimate counted no reference
    model but DPO's, and no reward model."""
    import numpy as np

    from fsdp_offload_cfg import cli
    from fsdp_offload_cfg.testing.models import words

    rng = np.random.default_rng(0)
    (tmp_path / "data").mkdir()
    rows = [{"prompt": words(rng, 4), "completion": words(rng, 4), "label": i % 2 == 0} for i in range(8)]
    if verb == "grpo":
        rows = [{"prompt": row["prompt"]} for row in rows]
        (tmp_path / "rewards.py").write_text("def length(completions, **kwargs):\n"
                                             "    return [float(len(c)) for c in completions]\n")
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "fsdp.yaml").write_text("distributed_type: FSDP\nmixed_precision: 'no'\nnum_processes: 2\n"
                                        "use_cpu: true\nfsdp_config:\n  fsdp_version: 2\n"
                                        "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n")
    own = {"kto": "max_length: 16\n",
           "grpo": "beta: 0.04\nnum_generations: 2\nmax_completion_length: 4\nreward_funcs: [rewards.length]\n"
                   f"reward_model_name_or_path: {files / 'llama'}\n"}[verb]
    (tmp_path / f"{verb}.yaml").write_text(
        f"model_name_or_path: {files / 'llama'}\ndataset_name: {tmp_path / 'data'}\n{own}"
        "per_device_train_batch_size: 2\naccelerate_config: fsdp.yaml\nfsdp: full_shard auto_wrap\n"
        "fsdp_config:\n  version: 2\n  transformer_layer_cls_to_wrap: [LlamaDecoderLayer]\n")
    real = _probed_trl_script(verb, tmp_path / f"{verb}.yaml", tmp_path, cwd=tmp_path)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["estimate", "--device", "cpu", "--format", "json", "--seq-len", "16", "--",
                     "trl", verb, "--config", f"{verb}.yaml"]) == 0, capsys.readouterr().err
    estimated = json.loads(capsys.readouterr().out)
    assert real["forward_batch"] == estimated["inputs"]["batch_size"] == 2, (real, estimated["inputs"])
    assert real["reference_param_bytes"] == estimated["per_rank"]["reference_params_bytes"] > 0, \
        (real, estimated["per_rank"])
    assert f"a reference model: trl {verb}'s" in estimated["assumptions"][0], estimated["assumptions"][0]
    if verb == "grpo":  # its reward model (a causal LM under a new one-row score head), whole on every rank
        assert real["reward_bytes"] == estimated["per_rank"]["reward_params_bytes"] > 0, (real, estimated["per_rank"])


def test_the_estimate_holds_the_teacher_of_trl_distillation_whole_on_every_rank(
        files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """`trl distillation` loads its teacher (`teacher_model_name_or_path`) with its
    `teacher_model_init_kwargs` (here bfloat16, where the student loads in TRL's float32) and
    prepares it in evaluation mode: whole on every rank. TRL's own script (2 gloo ranks, a probe on
    `Trainer.train`) against `estimate -- trl distillation`: the teacher's bytes on rank 0. Before,
    the estimate counted no teacher."""
    from fsdp_offload_cfg import cli

    _distillation_recipe(files, tmp_path, "", "teacher_model_init_kwargs:\n  dtype: bfloat16\n")
    real = _probed_trl_script("distillation", tmp_path / "kd.yaml", tmp_path, cwd=tmp_path)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["estimate", "--device", "cpu", "--format", "json", "--seq-len", "16", "--",
                     "trl", "distillation", "--config", "kd.yaml"]) == 0, capsys.readouterr().err
    estimated = json.loads(capsys.readouterr().out)
    assert real["teacher_bytes"] == estimated["per_rank"]["teacher_params_bytes"] > 0, (real, estimated["per_rank"])
    assert real["param_dtypes"] == [estimated["inputs"]["storage_dtype"]] == ["float32"], (real, estimated["inputs"])
    # TRL projects the hidden states through the output layer's weight itself: its forward runs for generation only
    assert (real["output_layer_training_forwards"], estimated["inputs"]["loss_head"]) == (0, "trl_chunked_distillation")


@pytest.fixture(scope="module")
def distillation_baseline(files: Path, tmp_path_factory: pytest.TempPathFactory) -> list[tuple[float, float]]:
    """The losses and gradient norms `trl distillation` logs without the offload or a budget."""
    return _distilled(files, tmp_path_factory.mktemp("distillation_baseline"), "")[0]


def _distilled(files: Path, tmp_path: Path, fsdp_keys: str) -> tuple[list[tuple[float, float]], str]:
    """TRL's own distillation script, 2 steps on 2 gloo ranks: each step's (loss, grad norm), and its output."""
    _distillation_recipe(files, tmp_path, fsdp_keys)
    run = _probed_trl_script("distillation", tmp_path / "kd.yaml", tmp_path, cwd=tmp_path, steps=2)
    return [(h["loss"], h["grad_norm"]) for h in run["log_history"] if "loss" in h], run["text"]


def test_trl_distillation_under_the_activation_offload_offloads_and_trains_what_it_trains_without(
        files: Path, tmp_path: Path, distillation_baseline: list):
    """TRL's distillation trainer runs its loss in place of the student's forward
    (`_ForwardRedirection`: the model's `forward` swapped for one that calls the loss, then the
    model called), which swapped out the offload's forward with it: the student's layers ran
    outside any offload pass and nothing was offloaded, without a word (no `activation offload
    moved` line). TRL's own script on 2 gloo ranks, 2 steps: with the offload on, it moves the
    layers' saves and logs the losses and gradient norms of the run without it, bit for bit."""
    logged, text = _distilled(files, tmp_path, "  activation_cpu_offload: true\n")
    moved = re.search(r"activation offload moved .* \((\d+) tensors\)", text)
    assert moved and int(moved.group(1)) > 0, text[-3000:]
    assert "outside the offload" not in text, text[-3000:]  # no layer ran outside it (the guard of api)
    assert len(logged) == 2 and logged == distillation_baseline, (logged, distillation_baseline)


def test_an_activation_budget_under_trl_distillation_plans_at_the_first_layer_with_trls_head(
        files: Path, tmp_path: Path, distillation_baseline: list):
    """The budget plans at the model's first training forward from its arguments' batch shape;
    under TRL's `_ForwardRedirection` they are the trainer's loss arguments, not the model's, and
    every rank stopped ("cannot tell the batch shape from the model's forward arguments"). It now
    plans at the first layer, from its hidden states, at the 2 x 8 tokens a rank runs, and counts
    the head TRL's loss runs: its chunked divergence, whose two float32 tiles of 8 x 32768 (2 MiB)
    dwarf this tiny model's logits. The budget, 2150000 B, lies between the estimate's peaks of
    `trl distillation` with the offload (2145788 B; 4.57: 2146300) and without it (2164220 B;
    4.57: 2166780): the plan offloads. Counting the model's own head (full logits, a few KiB) the
    budget planned every layer kept. The run logs what it logs without a budget."""
    logged, text = _distilled(files, tmp_path, "  activation_memory_budget: 2150000\n"
                                                "  activation_budget_compute_tflops: 0.05\n"
                                                "  activation_budget_copy_gb_per_s: 100\n")
    assert re.search(r"\[fsdp_offload_cfg rank 0\] activation_memory_budget \S+ MiB at 2 x 8 tokens per rank: "
                     r"[^\n]*: offload", text), text[-3000:]
    moved = re.search(r"activation offload moved .* \((\d+) tensors\)", text)
    assert moved and int(moved.group(1)) > 0, text[-3000:]
    assert "outside the offload" not in text, text[-3000:]
    assert logged == distillation_baseline, (logged, distillation_baseline)


def _distillation_recipe(files: Path, tmp_path: Path, fsdp_keys: str, keys: str = "") -> None:
    """`trl distillation`'s recipe in tmp_path/kd.yaml (its data and accelerate file beside it):
    the tiny Llama as student and teacher, 2 samples a step, `keys` added at the top and
    `fsdp_keys` to fsdp_config."""
    import numpy as np

    from fsdp_offload_cfg.testing.models import words

    if not (tmp_path / "data").exists():
        rng = np.random.default_rng(0)
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(
            {"prompt": words(rng, 4), "completion": words(rng, 4)}) + "\n" for _ in range(8)))
        (tmp_path / "fsdp.yaml").write_text("distributed_type: FSDP\nmixed_precision: 'no'\nnum_processes: 2\n"
                                            "use_cpu: true\nfsdp_config:\n  fsdp_version: 2\n"
                                            "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n")
    (tmp_path / "kd.yaml").write_text(
        f"model_name_or_path: {files / 'llama'}\nteacher_model_name_or_path: {files / 'llama'}\n"
        "dataset_name: data\nmax_completion_length: 4\nper_device_train_batch_size: 2\n"
        "gradient_checkpointing: false\nlogging_steps: 1\naccelerate_config: fsdp.yaml\nfsdp: full_shard auto_wrap\n"
        + keys + "fsdp_config:\n  version: 2\n  transformer_layer_cls_to_wrap: [LlamaDecoderLayer]\n" + fsdp_keys)
