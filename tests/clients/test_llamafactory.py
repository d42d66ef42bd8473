"""LlamaFactory's own CLI (`llamafactory-cli train`), run through `fsdp-offload-cfg run` with no
code of ours in between, on 2 gloo CPU ranks (`FORCE_TORCHRUN=1`): the `clients` CI leg, where
`pip install llamafactory==0.9.5` chose the versions (transformers 5.6, accelerate 1.11, trl
0.24). Skipped where LlamaFactory is not installed (the other legs).

Against the same run with the plugin's loader and offload off: SFT under auto (with offload: auto
reads sharded here, one node) and broadcast saves bit-equal weights, and so does LoRA with DoRA and
new tokens under sharded; DPO (policy and a reference model LlamaFactory prepares itself) starts and
trains with TRL imported after the plugin (it failed at import while `patch()` imported TRL first)
and saves the baseline's policy bit for bit; the estimate of a DPO file counts the reference model
and the pairs of responses its run holds; the lines that prove the plugin is on are there; a typo
stops every rank with status 1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llamafactory")

BIN = Path(sys.executable).parent
CONFIG = """\
model_name_or_path: {model}
stage: {stage}
do_train: true
finetuning_type: full
dataset: {dataset}
dataset_dir: {data}
{adapter}template: default
cutoff_len: 64
overwrite_cache: true
preprocessing_num_workers: 1
output_dir: {out}
overwrite_output_dir: true
logging_steps: 1
per_device_train_batch_size: 2
learning_rate: 1.0e-3
max_steps: 4
lr_scheduler_type: constant
seed: 0
report_to: none
save_strategy: "no"
use_cpu: true
fsdp: "full_shard auto_wrap"
fsdp_config:
  fsdp_version: 2
  fsdp_transformer_layer_cls_to_wrap: ["LlamaDecoderLayer"]
{plugin}"""
PLUGIN = {
    "baseline": "  fsdp_cpu_ram_efficient_loading: false\n",
    "auto_offload": "  fsdp_cpu_ram_efficient_loading: true\n  fsdp_activation_cpu_offload: true\n",
    "broadcast": "  fsdp_cpu_ram_efficient_loading: true\n  fsdp_load_strategy: broadcast\n",
    "sharded": "  fsdp_cpu_ram_efficient_loading: true\n  fsdp_load_strategy: sharded\n",
    "typo": "  fsdp_cpu_ram_efficient_loading: true\n  fsdp_activaton_cpu_offload: true\n",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a character-level tokenizer, an SFT and a preference data set."""
    from fsdp_offload_cfg.testing.clients import save_char_llama

    root = tmp_path_factory.mktemp("llamafactory")
    save_char_llama(root / "model")
    data = root / "data"
    data.mkdir()
    counts = [(f"Count to {n}.", " ".join(str(i) for i in range(1, n + 1))) for n in range(1, 41)]
    (data / "count.json").write_text(json.dumps([{"instruction": q, "input": "", "output": a} for q, a in counts]))
    (data / "pairs.json").write_text(json.dumps(
        [{"instruction": q, "input": "", "chosen": a, "rejected": "no"} for q, a in counts]))
    (data / "dataset_info.json").write_text(json.dumps({
        "count": {"file_name": "count.json"},
        "pairs": {"file_name": "pairs.json", "ranking": True,
                  "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"}},
    }))  # fmt: skip
    return root


# LoRA with DoRA, and two new special tokens (LlamaFactory resizes the embeddings, initialises the
# new rows from the old ones' mean with noise, and trains embed_tokens and lm_head as modules_to_save)
LORA = ("finetuning_type: lora\nlora_target: q_proj,v_proj\nlora_rank: 4\nuse_dora: true\n"
        "add_special_tokens: \"<tool>,<think>\"\nresize_vocab: true\n")


def _train(files: Path, variant: str, stage: str = "sft", lora: bool = False,
           plugin: str | None = None) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = files / f"out_{stage}_{variant}{'_lora' if lora else ''}"
    shutil.rmtree(out, ignore_errors=True)
    config = files / f"{stage}_{variant}{'_lora' if lora else ''}.yaml"
    text = CONFIG.format(model=files / "model", stage=stage, data=files / "data", out=out, adapter=LORA if lora else "",
                         dataset="pairs" if stage == "dpo" else "count", plugin=plugin or PLUGIN[variant])
    config.write_text(text.replace("finetuning_type: full\n", "") if lora else text)
    from fsdp_offload_cfg.testing.dist import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               OMP_NUM_THREADS="1", FORCE_TORCHRUN="1", NPROC_PER_NODE="2", MASTER_PORT=str(free_port()),
               CUDA_VISIBLE_DEVICES="")  # fmt: skip
    proc = subprocess.run([str(BIN / "fsdp-offload-cfg"), "run", "--", "llamafactory-cli", "train", str(config)],
                          capture_output=True, text=True, timeout=420, env=env, cwd=files)
    return proc, out


def _weights(out: Path, name: str = "model.safetensors") -> dict:
    from safetensors.torch import load_file

    return load_file(out / name)


@pytest.fixture(scope="module")
def baseline(files: Path) -> dict:
    proc, out = _train(files, "baseline")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _weights(out)


# Each of the loader's two ways of filling the shards once: auto reads sharded on one node (its line
# says so); a third launch with `sharded` named took 40 s of CI and ran the same path.
@pytest.mark.parametrize("variant", ["auto_offload", "broadcast"])
def test_sft_saves_what_the_run_without_the_loader_saves(files: Path, baseline: dict, variant: str):
    import torch

    proc, out = _train(files, variant)
    assert proc.returncode == 0, proc.stderr[-4000:]
    weights = _weights(out)
    assert weights.keys() == baseline.keys() and all(torch.equal(weights[k], baseline[k]) for k in baseline)
    strategy = "auto" if variant == "auto_offload" else variant
    offload = "on" if variant == "auto_offload" else "off"
    assert (f"[fsdp_offload_cfg rank 0] config from TrainingArguments.fsdp_config (FSDP2, meta loading: {strategy}, "
            f"activation offload: {offload})") in proc.stderr, proc.stderr[-3000:]
    if variant == "auto_offload":
        assert "[fsdp_offload_cfg rank 0] activation offload moved" in proc.stderr
        assert "sharded loading: rank 0 read" in proc.stderr, proc.stderr[-3000:]


def test_sft_under_an_activation_budget_plans_each_layer_and_saves_what_the_baseline_saves(files: Path,
                                                                                           baseline: dict):
    """`fsdp_activation_memory_budget` in LlamaFactory's YAML: the budget is the smallest peak a
    plan reaches at the cutoff length (so every batch fits, and a batch of any length saves less
    than the plain run would), LlamaFactory's own gradient checkpointing turned off as the docs
    say; the layers are planned at the first step, again at longer batches, and train the
    baseline's weights."""
    import torch

    from fsdp_offload_cfg.testing.cli_budget import RATES, assert_planned_per_layer, smallest_budget

    keys = {"fsdp_cpu_ram_efficient_loading": "true", **RATES,
            "fsdp_activation_memory_budget": smallest_budget(str(files / "model"), seq_len=64)}
    plugin = "".join(f"  {key}: {value}\n" for key, value in keys.items())
    proc, out = _train(files, "budget", plugin=plugin + "disable_gradient_checkpointing: true\n")  # after fsdp_config
    assert proc.returncode == 0, proc.stderr[-4000:]
    weights = _weights(out)
    assert weights.keys() == baseline.keys() and all(torch.equal(weights[k], baseline[k]) for k in baseline)
    assert_planned_per_layer(proc.stderr)


def test_lora_with_dora_and_new_tokens_under_sharded_saves_the_baselines_adapter(files: Path):
    """PEFT's adapters on a meta base, DoRA's magnitude from the base weights, and new
    tokens resized and initialised from the old embeddings, all before prepare."""
    import torch

    runs = {variant: _train(files, variant, lora=True) for variant in ("baseline", "sharded")}
    for proc, _ in runs.values():
        assert proc.returncode == 0, proc.stderr[-4000:]
    plain, ours = (_weights(out, "adapter_model.safetensors") for _, out in runs.values())
    assert any("lora_magnitude_vector" in k for k in plain) and any("embed_tokens" in k for k in plain)
    assert ours.keys() == plain.keys() and all(torch.equal(ours[k], plain[k]) for k in plain)


def test_dpo_starts_with_trl_imported_after_the_plugin_and_saves_what_the_baseline_saves(files: Path):
    """DPO: the policy and the reference model LlamaFactory loads and TRL prepares itself; under
    auto + offload the saved policy equals the run with the loader and offload off."""
    import torch

    runs = {variant: _train(files, variant, stage="dpo") for variant in ("baseline", "auto_offload")}
    for proc, _ in runs.values():
        assert proc.returncode == 0, proc.stderr[-4000:]
    proc, out = runs["auto_offload"]
    assert "mergekit" not in proc.stderr
    assert "meta loading: auto, activation offload: on" in proc.stderr
    assert "[fsdp_offload_cfg rank 0] activation offload moved" in proc.stderr, proc.stderr[-3000:]
    plain, ours = _weights(runs["baseline"][1]), _weights(out)
    assert ours.keys() == plain.keys() and all(torch.equal(ours[k], plain[k]) for k in plain)


def test_the_estimate_of_a_dpo_file_holds_its_reference_model_and_both_responses_of_a_sample(
        files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """`stage: dpo` of a full fine-tune: LlamaFactory loads a reference model, which it shards
    beside the policy with accelerate's `fsdp2_prepare_model`, and batches each sample's chosen
    and rejected responses together. Against the run (LlamaFactory's `run_exp` on 2 gloo ranks,
    read after its training by the Trainer probe), the estimate of that same file counts rank 0's
    reference bytes and the forward's batch of 4 for a micro-batch of 2, and the reference model
    holds nothing whole after its forwards. Before, the estimate read the file as SFT: neither."""
    from fsdp_offload_cfg.testing.clients import assert_the_estimate_holds_the_preference_run

    real, estimated = _probed_and_estimated(files, tmp_path, capsys, stage="dpo", adapter="", dataset="pairs")
    assert_the_estimate_holds_the_preference_run(real, estimated, forward_batch=4)


def test_the_estimate_of_a_dora_file_with_new_tokens_trains_what_the_run_trains(
        files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """LoRA with `use_dora: true` and `resize_vocab: true` (new special tokens), with which
    LlamaFactory trains the embeddings whole beside the adapters (PEFT's `modules_to_save`).
    Against the run (LlamaFactory's `run_exp` on 2 gloo ranks, read by the Trainer probe), the
    estimate of that same file is DoRA's, trains the same modules whole, and counts the same
    trainable parameters but the rows the resize added (the estimate reads the checkpoint's
    vocabulary). Before, it counted LoRA on the two targets alone: DoRA's magnitudes and the
    embeddings' gradients and AdamW state left out."""
    real, estimated = _probed_and_estimated(files, tmp_path, capsys, stage="sft", adapter=LORA, dataset="count")
    lora = estimated["model"]["lora"]
    assert (lora["dora"], lora["modules_to_save"]) == (real["dora"], real["modules_to_save"]) == \
        (True, ["embed_tokens", "lm_head"]), (lora, real)
    hidden = json.loads((files / "model" / "config.json").read_text())["hidden_size"]
    checkpoint_vocab = json.loads((files / "model" / "config.json").read_text())["vocab_size"]
    added = 2 * (real["vocab"] - checkpoint_vocab) * hidden  # the trained embed_tokens and lm_head copies' new rows
    assert real["vocab"] > checkpoint_vocab and lora["trainable_parameters"] + added == real["trainable"], (lora, real)


def _probed_and_estimated(files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], stage: str, adapter: str,
                          dataset: str) -> tuple[dict, dict]:
    """One step of LlamaFactory's `run_exp` on 2 gloo ranks with the Trainer probe (rank 0's
    report), and `fsdp-offload-cfg estimate` of the same file (its JSON)."""
    from fsdp_offload_cfg import cli
    from fsdp_offload_cfg.testing.dist import free_port

    config = tmp_path / f"{stage}.yaml"
    text = CONFIG.format(model=files / "model", stage=stage, data=files / "data", out=tmp_path / "out", adapter=adapter,
                         dataset=dataset, plugin=PLUGIN["auto_offload"]).replace("max_steps: 4", "max_steps: 1")
    config.write_text(text.replace("finetuning_type: full\n", "") if adapter else text)
    probe = tmp_path / "probe"
    probe.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PROBE_DIR=str(probe))  # fmt: skip
    script = Path(__file__).parents[1] / "scripts" / "llamafactory_probe.py"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(script), str(config)],
                          capture_output=True, text=True, timeout=420, env=env, cwd=files)
    assert proc.returncode == 0, proc.stderr[-4000:]
    real = json.loads((probe / "rank0.json").read_text())
    assert cli.main(["estimate", str(config), "--num-processes", "2", "--device", "cpu", "--format", "json"]) == 0
    return real, json.loads(capsys.readouterr().out)


def test_a_typo_stops_every_rank_with_status_1(files: Path):
    proc, _ = _train(files, "typo")
    assert proc.returncode != 0
    assert "activaton_cpu_offload" in proc.stderr and "did you mean" in proc.stderr, proc.stderr[-3000:]
    assert "'loss'" not in proc.stdout + proc.stderr  # nothing trained
