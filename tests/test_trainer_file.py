"""A Trainer's file as the run it describes (`config/trainer_file.py`): the training arguments
`fsdp-offload-cfg estimate` takes where its flags are left out, in each framework's spelling.
Pure reading: the estimate's figures from them are tested in tests/test_estimate.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_offload_cfg.config import ConfigError
from fsdp_offload_cfg.config.trainer_file import RunArguments, run_arguments, run_arguments_of

FSDP = "fsdp: full_shard auto_wrap\nfsdp_config:\n  version: 2\n"


def _read(tmp_path: Path, text: str, name: str = "run.yaml") -> RunArguments | None:
    path = tmp_path / name
    path.write_text(text)
    return run_arguments(str(path))


def test_a_llamafactory_file_gives_its_model_length_batch_precision_and_lora(tmp_path: Path):
    run = _read(tmp_path, "model_name_or_path: meta-llama/Llama-3.1-8B\nstage: sft\nfinetuning_type: lora\n"
                          "cutoff_len: 4096\nper_device_train_batch_size: 2\ngradient_accumulation_steps: 8\n"
                          "bf16: true\n" + FSDP)
    assert run is not None
    assert (run.model, run.seq_len, run.batch_size, run.gradient_accumulation_steps, run.mixed_precision) == \
        ("meta-llama/Llama-3.1-8B", 4096, 2, 8, "bf16")
    assert (run.lora_rank, run.lora_targets, run.lora_dropout) == (8, "all-linear", 0.0)  # LlamaFactory's defaults
    assert run.taken == {"model": "model_name_or_path", "seq_len": "cutoff_len", "batch_size": "per_device_train_batch_size",
                         "gradient_accumulation_steps": "gradient_accumulation_steps", "mixed_precision": "bf16: true",
                         "optimizer": "optim unset: the Trainer's default adamw_torch_fused",
                         "gradient_checkpointing": "LlamaFactory's default: disable_gradient_checkpointing unset",
                         "lora": "finetuning_type: lora"}
    assert run.gradient_checkpointing
    named = _read(tmp_path, "finetuning_type: lora\nlora_rank: 16\nlora_target: q_proj,v_proj\nlora_dropout: 0.05\n"
                            "disable_gradient_checkpointing: true\n" + FSDP)
    assert (named.lora_rank, named.lora_targets, named.lora_dropout) == (16, "q_proj,v_proj", 0.05)
    assert not named.gradient_checkpointing and "gradient_checkpointing" not in named.taken
    assert _read(tmp_path, "finetuning_type: full\n" + FSDP).lora_rank is None


def test_where_a_llamafactory_file_is_silent_its_defaults_hold(tmp_path: Path):
    """LlamaFactory 0.9.5 (`hparams`): finetuning_type lora, lora_rank 8 on all, cutoff_len 2048,
    gradient checkpointing on; the Trainer's defaults are none of these."""
    run = _read(tmp_path, "stage: sft\nmodel_name_or_path: m\n" + FSDP)
    assert (run.seq_len, run.lora_rank, run.lora_targets, run.gradient_checkpointing) == (2048, 8, "all-linear", True)
    assert run.taken["seq_len"] == "cutoff_len unset: LlamaFactory's default"
    assert run.taken["lora"] == "finetuning_type unset: LlamaFactory's default lora"
    trainer = _read(tmp_path, "model_name_or_path: m\n" + FSDP)
    assert (trainer.seq_len, trainer.lora_rank, trainer.gradient_checkpointing) == (None, None, False)


@pytest.mark.parametrize("text, reference, batch", [
    ("stage: dpo\nfinetuning_type: full\n", "LlamaFactory's stage dpo", 4),
    ("stage: dpo\n", None, 4),  # LoRA, its default: the disabled adapters stand for the reference model
    ("stage: dpo\nfinetuning_type: full\npref_loss: simpo\n", None, 4),
    ("stage: dpo\nfinetuning_type: full\npref_loss: orpo\n", None, 4),
    ("stage: kto\nfinetuning_type: full\n", "LlamaFactory's stage kto", 2),
    ("stage: dpo\nref_model: other/model\n", "LlamaFactory's stage dpo", 4),  # named: loaded even under LoRA
    ("stage: sft\nfinetuning_type: full\n", None, 2),
])
def test_llamafactorys_preference_stages_load_a_reference_model_and_pair_the_responses(
        tmp_path: Path, text: str, reference: str | None, batch: int):
    """LlamaFactory 0.9.5: `stage: dpo` (its `pref_loss` not orpo or simpo) and `stage: kto` load
    a reference model (`create_ref_model`) unless LoRA's disabled adapters stand for it; `stage:
    dpo` batches each sample's chosen and rejected responses together. Before, a LlamaFactory
    DPO file was estimated as SFT: no reference model, half the sequences of a forward."""
    run = _read(tmp_path, "model_name_or_path: m\nper_device_train_batch_size: 2\n" + text + FSDP)
    assert (run.reference_model, run.batch_size) == (reference, batch), run
    assert run.caveats == (("ref_model: other/model is counted as a copy of the model",) if "ref_model" in text else ())
    one = _read(tmp_path, "model_name_or_path: m\nper_device_train_batch_size: 1\nstage: dpo\n" + FSDP)
    assert "per_device_train_batch_size, 1 sample x 2: DPO runs" in one.taken["batch_size"], one.taken


@pytest.mark.parametrize("text, reference, batch", [
    ("rl: dpo\n", "axolotl's rl: dpo", 4),
    ("rl: ipo\n", "axolotl's rl: ipo", 4),
    ("rl: dpo\nadapter: lora\nlora_r: 8\nlora_target_linear: true\n", None, 4),  # disabled adapters
    ("rl: dpo\nadapter: lora\nlora_r: 8\nlora_target_linear: true\nrl_adapter_ref_model: true\n",
     "axolotl's rl: dpo", 4),
    ("rl: dpo\nprecompute_ref_log_probs: true\n", "axolotl's rl: dpo", 4),  # axolotl hands its copy to TRL
    ("rl: orpo\n", None, 4),
    ("rl: simpo\n", None, 4),
    ("rl: kto\n", "axolotl's rl: kto", 2),
    ("rl: kto\nadapter: lora\nlora_r: 8\nlora_target_linear: true\n", None, 2),
    ("rl: grpo\n", None, 2),  # TRL's beta 0: no KL term
    ("rl: grpo\ntrl:\n  beta: 0.04\n", "axolotl's rl: grpo, for its KL term (trl.beta 0.04)", 2),
    ("rl: gdpo\nrl_beta: 0.001\n", "axolotl's rl: gdpo, for its KL term (rl_beta 0.001)", 2),
    ("", None, 2),
])
def test_axolotls_rl_methods_load_a_reference_model_and_pair_the_completions(
        tmp_path: Path, text: str, reference: str | None, batch: int):
    """axolotl 0.19's `rl:` runs TRL 1.9's trainers under its own: DPO, IPO, ORPO and SimPO
    batch each sample's chosen and rejected completions together; DPO and IPO hold the second
    load axolotl hands TRL, KTO the copy TRL's KTOTrainer loads, GRPO one for a KL term, each
    unless an adapter's disabled adapters stand for it. Before, every axolotl file was estimated
    as fine-tuning: no reference model, half the sequences of a DPO forward."""
    run = _read(tmp_path, "base_model: m\nmicro_batch_size: 2\nsequence_len: 512\n" + text + FSDP)
    assert (run.reference_model, run.batch_size, run.caveats) == (reference, batch, ()), run
    assert "micro_batch_size" in run.taken["batch_size"]


def test_axolotls_grpo_asks_for_the_length_its_sequence_len_does_not_give(tmp_path: Path):
    """axolotl's GRPO drops no sample by `sequence_len` and cuts no prompt: its sequences are a
    prompt and a generated completion of any length the file gives. The estimate asks for
    --seq-len, saying so, where before it took `sequence_len` as the whole length."""
    run = _read(tmp_path, "base_model: m\nmicro_batch_size: 2\nsequence_len: 512\nrl: grpo\n"
                          "trl:\n  max_completion_length: 256\n" + FSDP)
    assert run.seq_len is None and "seq_len" not in run.taken
    assert run.seq_len_said == ("axolotl's rl: grpo trains on a prompt and a generated completion "
                                "(trl.max_completion_length 256), neither cut to sequence_len: give --seq-len as your "
                                "longest prompt plus the longest completion")
    unset = _read(tmp_path, "base_model: m\nsequence_len: 512\nrl: gdpo\n" + FSDP)
    assert "trl.max_completion_length unset: axolotl passes TRL None" in unset.seq_len_said
    assert _read(tmp_path, "base_model: m\nsequence_len: 512\nrl: dpo\n" + FSDP).seq_len == 512


def test_an_axolotl_rl_method_the_estimate_does_not_model_is_said_and_a_bad_beta_named(tmp_path: Path):
    run = _read(tmp_path, "base_model: m\nmicro_batch_size: 2\nrl: ebft\n" + FSDP)
    assert (run.reference_model, run.batch_size) == (None, 2)
    assert run.caveats == ("rl: ebft is not modelled: estimated as fine-tuning (no reference model, one sequence "
                           "a sample)",)
    with pytest.raises(ConfigError, match=r"run\.yaml.*trl\.beta.*expected a number, got high"):
        _read(tmp_path, "base_model: m\nrl: grpo\ntrl:\n  beta: high\n" + FSDP)


def test_trl_and_llamafactory_keep_the_trainers_micro_batch_of_8(tmp_path: Path):
    """TRL's and LlamaFactory's configs are TrainingArguments that keep its
    `per_device_train_batch_size` of 8 (the estimate had asked for --batch-size); a plain
    TrainingArguments file's script may set its own, and axolotl has its own default."""
    for text, framework in ((TRL, "TRL"), ("stage: sft\nmodel_name_or_path: m\n" + FSDP, "LlamaFactory")):
        run = _read(tmp_path, text)
        assert run.batch_size == 8
        assert run.taken["batch_size"] == \
            f"per_device_train_batch_size unset: TrainingArguments' default, which {framework} keeps"
    assert _read(tmp_path, "model_name_or_path: m\n" + FSDP).batch_size is None
    assert _read(tmp_path, "base_model: m\nsequence_len: 512\n" + FSDP).batch_size is None


def test_an_axolotl_file_gives_the_same_in_its_own_names(tmp_path: Path):
    run = _read(tmp_path, "base_model: ./llama\nsequence_len: 2048\nmicro_batch_size: 1\nbf16: auto\nadapter: lora\n"
                          "lora_r: 32\nlora_dropout: 0\nlora_target_modules:\n  - q_proj\n  - v_proj\n"
                          "gradient_checkpointing: true\nfsdp_version: 2\nfsdp_config:\n  offload_params: false\n")
    assert (run.model, run.seq_len, run.batch_size, run.mixed_precision, run.gradient_checkpointing) == \
        ("./llama", 2048, 1, "bf16", True)
    assert (run.lora_rank, run.lora_targets, run.lora_dropout, run.taken["lora"]) == \
        (32, "q_proj,v_proj", 0.0, "adapter: lora")
    linear = _read(tmp_path, "adapter: lora\nlora_r: 8\nlora_target_linear: true\nfsdp_config: {}\n")
    assert linear.lora_targets == "all-linear"


def test_a_training_arguments_json_gives_fp16_and_trls_max_length(tmp_path: Path):
    args = {"per_device_train_batch_size": 4, "max_length": 1024, "fp16": True, "bf16": False,
            "fsdp": "full_shard", "fsdp_config": {"version": 2}}
    run = _read(tmp_path, json.dumps(args), "args.json")
    assert (run.seq_len, run.batch_size, run.mixed_precision, run.model, run.lora_rank) == (1024, 4, "fp16", None, None)


@pytest.mark.parametrize("text", ["bf16: false\n", "fp16: false\n", ""])
def test_precision_left_off_in_the_file_is_the_launchs(tmp_path: Path, text: str):
    """The Trainer reads ACCELERATE_MIXED_PRECISION first and only `true` overrides it: `false`
    in the file does not mean no mixed precision."""
    assert _read(tmp_path, text + FSDP).mixed_precision is None


def test_the_first_spelling_the_file_has_wins(tmp_path: Path):
    run = _read(tmp_path, "max_length: 512\ncutoff_len: 2048\nmodel_name_or_path: a\nbase_model: b\n" + FSDP)
    assert (run.seq_len, run.model) == (2048, "a")


@pytest.mark.parametrize("text", ["adapter: qlora\n", "load_in_4bit: true\n", "quantization_bit: 4\n"])
def test_a_quantized_base_is_named_with_its_key(tmp_path: Path, text: str):
    assert _read(tmp_path, text + FSDP).quantized == text.strip()
    assert _read(tmp_path, "load_in_4bit: false\n" + FSDP).quantized is None


def test_values_of_the_wrong_type_are_said_together_with_the_file_and_key(tmp_path: Path):
    with pytest.raises(ConfigError) as caught:
        _read(tmp_path, "sequence_len: 4k\nper_device_train_batch_size: true\nbf16: yes please\nadapter: lora\n"
                        "lora_target_modules: 5\n" + FSDP)
    path = tmp_path / "run.yaml"
    assert str(caught.value).splitlines() == [
        f"{path}: sequence_len: expected an integer, got 4k",
        f"{path}: per_device_train_batch_size: expected an integer, got true",
        f"{path}: bf16: expected true or false, got yes please",
        f"{path}: lora_target_modules: expected module names (a list, or names joined by commas), got 5",
    ]


def test_an_accelerate_file_or_a_bare_fsdp_config_is_no_trainers_file(tmp_path: Path):
    assert _read(tmp_path, "distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n  fsdp_version: 2\n") is None
    assert _read(tmp_path, "version: 2\ncpu_ram_efficient_loading: true\n") is None


@pytest.mark.parametrize("text, name, said", [
    ("", "adamw_fused", "optim unset: the Trainer's default adamw_torch_fused"),  # torch >= 2.8: every torch here
    ("optim: adamw_torch\n", "adamw", "optim"),
    ("optim: sgd\n", "sgd", "optim"),
    ("optimizer: adamw_torch_fused\n", "adamw_fused", "optimizer"),  # axolotl's key
    ("optim: adamw_bnb_8bit\n", "adamw_fused", "optim: adamw_bnb_8bit is not modelled: counted as adamw_torch_fused"),
])
def test_the_optimizer_is_the_files_else_the_trainers_default(tmp_path: Path, text: str, name: str, said: str):
    run = _read(tmp_path, text + FSDP)
    assert (run.optimizer, run.taken["optimizer"]) == (name, said)


def test_what_the_estimate_counts_otherwise_is_said(tmp_path: Path):
    assert _read(tmp_path, "finetuning_type: freeze\n" + FSDP).caveats == (
        "finetuning_type: freeze is counted as a full fine-tune (an upper bound)",)
    assert _read(tmp_path, "finetuning_type: lora\n" + FSDP).caveats == ()


@pytest.mark.parametrize(("text", "how"), [
    ("finetuning_type: lora\nuse_dora: true\n", "finetuning_type: lora, use_dora: true"),  # LlamaFactory
    ("adapter: lora\nlora_target_linear: true\npeft_use_dora: true\n", "adapter: lora, peft_use_dora: true"),  # axolotl
    ("use_peft: true\nuse_dora: true\n", "use_peft: true, use_dora: true"),  # TRL's ModelConfig
])
def test_dora_is_read_as_dora_not_counted_as_lora(tmp_path: Path, text: str, how: str):
    """DoRA's adapters save about twice LoRA's activations (each adapted layer its base output and
    its adapter's output): a file that turns it on is estimated as DoRA (it was LoRA's figure,
    0.53x of what a real DoRA forward holds, with a caveat)."""
    run = _read(tmp_path, text + FSDP)
    assert (run.lora_dora, run.taken["lora"], run.caveats) == (True, how, ()), run
    off = _read(tmp_path, text.replace("dora: true", "dora: false") + FSDP)
    assert (off.lora_dora, off.taken["lora"]) == (False, how.split(", ")[0])
    assert _swift("use_dora: true\n").lora_dora is True and _swift("model: m\n").lora_dora is False


@pytest.mark.parametrize(("text", "saved", "how"), [
    ("finetuning_type: lora\nadditional_target: embed_tokens,lm_head\n", "embed_tokens,lm_head",
     "finetuning_type: lora, additional_target: embed_tokens,lm_head"),  # LlamaFactory
    ("finetuning_type: lora\nresize_vocab: true\n", "input-output-embeddings",  # LlamaFactory's own choice
     "finetuning_type: lora, resize_vocab: true, with which LlamaFactory trains the embeddings whole"),
    ("finetuning_type: lora\nadd_special_tokens: <tool>,<think>\n", "input-output-embeddings",  # new tokens resize
     "finetuning_type: lora, add_special_tokens: <tool>,<think>, with which LlamaFactory trains the embeddings whole"),
    ("finetuning_type: lora\nresize_vocab: false\n", "", "finetuning_type: lora"),
    ("adapter: lora\nlora_target_linear: true\nlora_modules_to_save: [embed_tokens, lm_head]\n", "embed_tokens,lm_head",
     "adapter: lora, lora_modules_to_save: embed_tokens,lm_head"),  # axolotl
    ("use_peft: true\nlora_modules_to_save: [lm_head]\n", "lm_head", "use_peft: true, lora_modules_to_save: lm_head"),
    ("adapter: lora\nlora_target_linear: true\nlora_modules_to_save: []\n", "", "adapter: lora"),
])
def test_the_modules_a_lora_run_trains_whole_are_read(tmp_path: Path, text: str, saved: str, how: str):
    """PEFT's `modules_to_save` under each framework's name: whole modules (the embeddings, when a
    run adds tokens) that get gradients and optimizer state beside the adapters, which the
    estimate counted as frozen."""
    run = _read(tmp_path, text + FSDP)
    assert (run.lora_modules_to_save, run.taken["lora"]) == (saved, how), run
    assert _swift("modules_to_save: [embed_tokens]\n").lora_modules_to_save == "embed_tokens"
    assert _read(tmp_path, "finetuning_type: lora\n" + FSDP).lora_modules_to_save == ""


def test_a_dora_switch_that_is_no_boolean_is_named(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"run\.yaml: use_dora: expected true or false, got yes please"):
        _read(tmp_path, "finetuning_type: lora\nuse_dora: yes please\n" + FSDP)


def test_a_value_the_file_gives_is_never_replaced_by_a_default(tmp_path: Path):
    """`cutoff_len: 0` is the file's (the estimate refuses it, naming --seq-len), not LlamaFactory's 2048."""
    run = _read(tmp_path, "stage: sft\ncutoff_len: 0\n" + FSDP)
    assert (run.seq_len, run.taken["seq_len"]) == (0, "cutoff_len")


TRL = "model_name_or_path: m\nmax_length: 2048\ndataset_text_field: text\n" + FSDP


def test_a_trl_file_silent_on_precision_and_checkpointing_gets_trls_defaults(tmp_path: Path):
    """TRL 1.16's configs (`trl/trainer/base_config.py`): `bf16 = not fp16` where unset, and
    `gradient_checkpointing` true. Read as the Trainer's (neither), the estimate counted a TRL
    run's float32 masters in the load dtype and every activation of an unchecked forward."""
    run = _read(tmp_path, TRL)
    assert (run.mixed_precision, run.gradient_checkpointing) == ("bf16", True)
    assert run.taken["mixed_precision"] == "bf16 unset: TRL's default"
    assert run.taken["gradient_checkpointing"] == "gradient_checkpointing unset: TRL's default"
    said = _read(tmp_path, TRL + "fp16: true\ngradient_checkpointing: false\n")
    assert (said.mixed_precision, said.gradient_checkpointing) == ("fp16", False)
    assert _read(tmp_path, TRL + "bf16: false\n").mixed_precision is None  # the launch's, as for the Trainer
    plain = _read(tmp_path, "model_name_or_path: m\nmax_length: 2048\n" + FSDP)  # nothing only TRL defines
    assert (plain.mixed_precision, plain.gradient_checkpointing) == (None, False)


def test_trls_use_peft_is_lora_with_trls_defaults(tmp_path: Path):
    """TRL's ModelConfig: `use_peft` with `lora_r` 16, `lora_dropout` 0.05 and no target_modules
    (PEFT's default for the model's type). It was estimated as a full fine-tune."""
    run = _read(tmp_path, TRL + "use_peft: true\n")
    assert (run.lora_rank, run.lora_targets, run.lora_dropout, run.taken["lora"]) == \
        (16, "peft-default", 0.05, "use_peft: true")
    named = _read(tmp_path, TRL + "use_peft: true\nlora_r: 64\nlora_dropout: 0\nlora_target_modules: [q_proj, k_proj]\n")
    assert (named.lora_rank, named.lora_targets, named.lora_dropout) == (64, "q_proj,k_proj", 0.0)
    assert _read(tmp_path, TRL + "use_peft: false\nlora_r: 64\n").lora_rank is None


def test_trls_scripts_load_in_the_dtype_their_model_config_says(tmp_path: Path):
    """TRL's scripts load with ModelConfig's `dtype`, float32 unless set (`model_init_kwargs`
    wins, as they merge it last); `auto` is the checkpoint's own."""
    assert (_read(tmp_path, TRL + "use_peft: true\n").dtype, _read(tmp_path, TRL).dtype) == ("float32", None)
    assert _read(tmp_path, TRL + "use_peft: true\ndtype: bfloat16\n").dtype == "bfloat16"
    assert _read(tmp_path, TRL + "dtype: auto\n").dtype is None
    given = _read(tmp_path, TRL + "dtype: float32\nmodel_init_kwargs:\n  dtype: bfloat16\n")
    assert (given.dtype, given.taken["dtype"]) == ("bfloat16", "model_init_kwargs.dtype")


def _swift(text: str, verb: str = "sft") -> RunArguments:
    import yaml

    from fsdp_offload_cfg.config.trainer_file import run_arguments_of

    return run_arguments_of(yaml.safe_load(text) or {}, "the command line", f"swift {verb}")


def test_ms_swifts_command_line_gets_ms_swifts_defaults():
    """ms-swift 4.6 (`swift/arguments`, `swift/trainers/arguments.py`): `tuner_type` lora with rank
    8 on all-linear and dropout 0.05, a micro-batch of 1, checkpointing on, and its `template`
    is not LlamaFactory's (whose defaults would then have held)."""
    run = _swift("model: m\nmax_length: 512\ntemplate: default\n")
    assert (run.model, run.seq_len, run.batch_size, run.gradient_checkpointing) == ("m", 512, 1, True)
    assert (run.lora_rank, run.lora_targets, run.lora_dropout, run.taken["lora"]) == \
        (8, "all-linear", 0.05, "tuner_type unset: ms-swift's default lora")
    assert run.accumulation_target == 16 and run.gradient_accumulation_steps is None
    named = _swift("model: m\ntrain_type: lora\nlora_rank: 32\ntarget_modules: [q_proj, v_proj]\nlora_dropout: 0\n"
                   "gradient_accumulation_steps: 2\n")
    assert (named.lora_rank, named.lora_targets, named.lora_dropout, named.accumulation_target) == \
        (32, "q_proj,v_proj", 0.0, None)
    assert _swift("tuner_type: full\n").lora_rank is None
    assert _swift("tuner_type: longlora\n").caveats == ("tuner_type: longlora is counted as a full fine-tune "
                                                        "(an upper bound)",)


@pytest.mark.parametrize("text, precision, follows", [
    ("torch_dtype: bfloat16\n", "bf16", False), ("torch_dtype: float32\n", "fp16", False),
    ("", None, True), ("bf16: true\n", "bf16", False), ("fp16: false\n", None, False),
])
def test_ms_swifts_precision_is_its_load_dtypes(text: str, precision: str | None, follows: bool):
    """ms-swift's `_init_mixed_precision`: bf16 over a bfloat16 load, fp16 over float16 and
    float32; with no `torch_dtype`, the checkpoint's dtype decides (the estimate reads it)."""
    run = _swift(text)
    assert (run.mixed_precision, run.precision_follows_dtype) == (precision, follows)


def test_trl_dpo_runs_two_sequences_a_sample():
    """`trl dpo`'s collator puts each sample's chosen and rejected completions in one forward:
    the micro-batch the estimate counts is twice `per_device_train_batch_size` (8 when unset)."""
    from fsdp_offload_cfg.config.trainer_file import run_arguments_of

    given = run_arguments_of({"model_name_or_path": "m", "per_device_train_batch_size": 2}, "dpo.yaml", "trl dpo")
    assert given.batch_size == 4 and given.taken["batch_size"].startswith("per_device_train_batch_size, 2 samples x 2")
    assert run_arguments_of({"model_name_or_path": "m"}, "dpo.yaml", "trl dpo").batch_size == 16
    assert run_arguments_of({"model_name_or_path": "m"}, "sft.yaml", "trl sft").batch_size == 8


@pytest.mark.parametrize("verb, said, loads", [
    ("dpo", {}, True), ("kto", {}, True), ("kto", {"use_peft": True}, False),
    ("kto", {"precompute_ref_log_probs": True}, False), ("dpo", {"beta": 0}, True),
    ("grpo", {}, False), ("grpo", {"beta": 0.04}, True), ("grpo", {"beta": "1e-3"}, True),
    ("grpo", {"beta": 0.04, "use_peft": True}, False),
    ("rloo", {}, True), ("rloo", {"beta": 0}, False), ("sft", {}, False),
])
def test_the_trl_trainers_that_load_a_reference_model(verb: str, said: dict, loads: bool):
    """TRL's trainers (0.24 to 1.16) load a reference model beside the policy: DPO and KTO
    whatever their beta, unless PEFT's disabled adapters stand for it or its log-probs are
    precomputed; GRPO and RLOO for their KL term where `beta` is not 0 (unset: 0.0 and 0.05),
    unless PEFT. Before, only `trl dpo`'s was counted."""
    from fsdp_offload_cfg.config.trainer_file import run_arguments_of

    run = run_arguments_of({"model_name_or_path": "m", **said}, f"{verb}.yaml", f"trl {verb}")
    assert bool(run.reference_model) is loads, run.reference_model
    if verb in ("grpo", "rloo") and loads:
        assert "beta" in run.reference_model and ("default" in run.reference_model) is ("beta" not in said)


def test_a_beta_that_is_not_a_number_is_named():
    from fsdp_offload_cfg.config.model import ConfigError
    from fsdp_offload_cfg.config.trainer_file import run_arguments_of

    with pytest.raises(ConfigError, match=r"grpo\.yaml.*beta.*expected a number, got high"):
        run_arguments_of({"model_name_or_path": "m", "beta": "high"}, "grpo.yaml", "trl grpo")


def test_trl_kto_runs_one_sequence_a_sample_of_1024_tokens_unset():
    """KTO's mismatched KL completions run under no_grad: the forward that is trained takes
    `per_device_train_batch_size` sequences, of KTOConfig's `max_length` 1024 where unset."""
    from fsdp_offload_cfg.config.trainer_file import run_arguments_of

    run = run_arguments_of({"model_name_or_path": "m", "per_device_train_batch_size": 2}, "kto.yaml", "trl kto")
    assert (run.batch_size, run.seq_len) == (2, 1024)


@pytest.mark.parametrize("text, reference, batch, accumulation", [
    ("", None, 2, (None, 16)),  # DPO unset, over LoRA: the disabled adapters are the reference
    ("tuner_type: full\n", "swift rlhf --rlhf_type dpo's", 2, (None, 16)),
    ("rlhf_type: kto\ntuner_type: full\n", "swift rlhf --rlhf_type kto's", 1, (None, 16)),
    ("rlhf_type: grpo\ntuner_type: full\n",
     "swift rlhf --rlhf_type grpo's, for its KL term (beta 0.04: ms-swift's default)", 1, (1, None)),
    ("rlhf_type: grpo\ntuner_type: full\nbeta: 0\n", None, 1, (1, None)),
    ("rlhf_type: grpo\ngradient_accumulation_steps: 4\n", None, 1, (4, None)),
    ("rlhf_type: orpo\ntrain_type: full\n", None, 2, (None, 16)),
    ("rlhf_type: simpo\nper_device_train_batch_size: 3\n", None, 6, (None, 16)),
])
def test_swift_rlhf_gets_its_methods_defaults(text: str, reference: str | None, batch: int,
                                              accumulation: tuple[int | None, int | None]):
    """`swift rlhf` (ms-swift 4.6's `RLHFArguments`): DPO unless `--rlhf_type` says otherwise; a
    reference model for DPO, KTO, PPO and GRPO (beta 0.04 unset, none at 0) under a full fine-tune
    alone; DPO's, CPO's, SimPO's and ORPO's chosen and rejected completions in one forward; GRPO's
    unset accumulation 1, not ceil(16 / batch / processes). Before, `swift rlhf` was read as
    `swift sft`: no reference model, half the sequences, 16 times GRPO's accumulation."""
    run = _swift(text, "rlhf")
    assert (run.reference_model, run.batch_size) == (reference, batch), run
    assert (run.gradient_accumulation_steps, run.accumulation_target) == accumulation, run


@pytest.mark.parametrize("text, seq_len", [
    ("rlhf_type: grpo\nmax_length: 1024\n", 1024 + 512),
    ("rlhf_type: grpo\nmax_length: 1024\nmax_completion_length: 2048\n", 1024 + 2048),
    ("rlhf_type: grpo\nmax_length: 1024\nmax_new_tokens: 256\n", 1024 + 256),  # its older name, first
    ("rlhf_type: dpo\nmax_length: 1024\nmax_completion_length: 2048\n", 1024),
])
def test_swift_grpo_trains_on_the_prompt_cut_to_max_length_and_its_completion(text: str, seq_len: int):
    """ms-swift 4.6's GRPO cuts each prompt to `max_length` and encodes prompt and completion for
    training with no `max_length` (`_prepare_batch_inputs`): its sequences are the two together.
    Before, the estimate took `max_length` alone, 512 tokens short with the default completion."""
    run = _swift(text, "rlhf")
    assert run.seq_len == seq_len, run
    assert not run.seq_len_follows_model


def test_swift_grpo_without_max_length_asks_for_the_sequence_length():
    """Unset, `max_length` is the model's longest, which would cut no prompt: the estimate asks for
    `--seq-len`, saying what a GRPO sequence is, instead of counting the model's longest."""
    run = _swift("rlhf_type: grpo\nmax_completion_length: 300\n", "rlhf")
    assert run.seq_len is None and not run.seq_len_follows_model
    assert "max_completion_length 300" in run.seq_len_said and "max_length" in run.seq_len_said
    assert _swift("rlhf_type: dpo\n", "rlhf").seq_len_follows_model


def test_swift_rlhf_names_its_reward_models_and_teacher_which_it_shards():
    """ms-swift 4.6's `--reward_model` (GRPO: one or several) and `--teacher_model` (GKD, GRPO),
    which its `prepare_fsdp` shards beside the model (TRL keeps them whole); PPO's reward model,
    the start of its trained value model too, is not counted, saying so."""
    grpo = _swift("rlhf_type: grpo\nmax_length: 64\nreward_model: [rm1, rm2]\n", "rlhf")
    assert (grpo.reward_models, grpo.companions_sharded) == (("rm1", "rm2"), True)
    assert _swift("rlhf_type: grpo\nmax_length: 64\nreward_model: rm\n", "rlhf").reward_models == ("rm",)
    gkd = _swift("rlhf_type: gkd\nteacher_model: big\n", "rlhf")
    assert (gkd.teacher_model, gkd.teacher_dtype, gkd.reward_models) == ("big", None, ())
    ppo = _swift("rlhf_type: ppo\nreward_model: rm\n", "rlhf")
    assert ppo.reward_models == () and ppo.caveats == ("reward_model: PPO's value and reward models are not counted",)
    assert _swift("teacher_model: big\nreward_model: rm\n").teacher_model is None  # swift sft loads neither


def test_a_swift_reward_model_that_is_no_path_is_named_with_its_key():
    with pytest.raises(ConfigError, match=r"the command line.*reward_model.*expected model paths, got 3"):
        _swift("rlhf_type: grpo\nmax_length: 64\nreward_model: 3\n", "rlhf")


def test_swift_rlhf_counts_another_reference_checkpoint_as_a_copy_saying_so():
    run = _swift("tuner_type: full\nref_model: other/model\n", "rlhf")
    assert run.reference_model and run.caveats == ("ref_model: other/model is counted as a copy of the model",)


def test_trl_grpo_and_rloo_name_their_reward_model():
    """`reward_model_name_or_path` (TRL's grpo and rloo scripts): a model the estimate counts whole
    on every rank; other trainers' files do not load one."""
    from fsdp_offload_cfg.config.trainer_file import run_arguments_of

    said = {"model_name_or_path": "m", "reward_model_name_or_path": "rm"}
    assert run_arguments_of(said, "grpo.yaml", "trl grpo").reward_models == ("rm",)
    assert run_arguments_of(said, "rloo.yaml", "trl rloo").reward_models == ("rm",)
    assert run_arguments_of(said, "sft.yaml", "trl sft").reward_models == ()


@pytest.mark.parametrize("said, dtype", [
    ({}, None), ({"teacher_model_init_kwargs": {"dtype": "bfloat16"}}, "bfloat16"),
    ({"teacher_model_init_kwargs": '{"dtype": "auto"}'}, "auto"),  # JSON text, as TRL's command line takes it
])
def test_trl_distillation_names_its_teacher_and_the_dtype_it_loads_in(said: dict, dtype: str | None):
    """`trl distillation`'s `teacher_model_name_or_path`, held whole on every rank, loaded in its
    `teacher_model_init_kwargs` dtype (None: the model's, as TRL's script loads both)."""
    from fsdp_offload_cfg.config.trainer_file import run_arguments_of

    run = run_arguments_of({"model_name_or_path": "m", "teacher_model_name_or_path": "t", **said}, "kd.yaml",
                           "trl distillation")
    assert (run.teacher_model, run.teacher_dtype) == ("t", dtype)
    assert run_arguments_of({"teacher_model_name_or_path": "t"}, "sft.yaml", "trl sft").teacher_model is None


def test_a_teacher_init_kwargs_that_is_no_mapping_is_named():
    from fsdp_offload_cfg.config.model import ConfigError
    from fsdp_offload_cfg.config.trainer_file import run_arguments_of

    with pytest.raises(ConfigError, match=r"kd\.yaml.*teacher_model_init_kwargs.*expected a mapping"):
        run_arguments_of({"teacher_model_name_or_path": "t", "teacher_model_init_kwargs": "dtype=bf16"}, "kd.yaml",
                         "trl distillation")


def test_trl_distillation_trains_on_its_completion_through_a_chunked_head():
    """`trl distillation`'s loss runs over each sequence's last `max_completion_length` positions
    (TRL's default 512), chunked (`estimate/heads.py`); ms-swift's GKD keeps the model's head."""
    from fsdp_offload_cfg.config.trainer_file import run_arguments_of

    said = {"model_name_or_path": "m", "teacher_model_name_or_path": "t"}
    run = run_arguments_of(said, "kd.yaml", "trl distillation")
    assert (run.loss_head, run.completion_tokens) == ("trl_chunked_distillation", 512)
    run = run_arguments_of({**said, "max_completion_length": 128}, "kd.yaml", "trl distillation")
    assert (run.loss_head, run.completion_tokens) == ("trl_chunked_distillation", 128)
    run = run_arguments_of({**said, "teacher_model": "t"}, "gkd.yaml", "swift rlhf")
    assert (run.loss_head, run.completion_tokens) == ("cross_entropy", None)


def test_trls_trainers_score_their_tokens_through_its_fused_lm_head():
    """TRL 1.15 on patches the model of its `sft`, `dpo`, `kto`, `grpo` and `rloo` trainers with a
    fused LM head (no logits over the vocabulary); `sft` under label smoothing computes the logits;
    a file of TRL's keys is read as one of those; ms-swift's, LlamaFactory's and a Trainer's file
    keep the model's own head. Before, every run was estimated with the model's cross-entropy."""
    from fsdp_offload_cfg.config.trainer_file import run_arguments_of

    def head(said: dict, cli: str | None) -> tuple[str, int | None]:
        run = run_arguments_of(said, "run.yaml", cli)
        return run.loss_head, run.completion_tokens

    said = {"model_name_or_path": "m"}
    for verb in ("sft", "dpo", "kto"):  # every labelled position
        assert head(said, f"trl {verb}") == ("trl_fused_lm_head", None), verb
    for verb in ("grpo", "rloo"):  # the completion's: TRL labels the prompt -100
        assert head(said, f"trl {verb}") == ("trl_fused_lm_head", 512), verb
        assert head({**said, "max_completion_length": 64}, f"trl {verb}") == ("trl_fused_lm_head", 64), verb
    assert head({**said, "label_smoothing_factor": 0.1}, "trl sft") == ("cross_entropy", None)
    assert head({**said, "label_smoothing_factor": 0.1}, "trl dpo") == ("trl_fused_lm_head", None)
    assert head({**said, "dataset_text_field": "text"}, None) == ("trl_fused_lm_head", None)  # TRL's key
    for other, cli in ((said, "trl reward"), (said, "swift sft"), ({**said, "stage": "sft", "cutoff_len": 8}, None),
                       (said, None)):
        assert head(other, cli) == ("cross_entropy", None), (other, cli)


@pytest.mark.parametrize("verb, said, share", [
    ("grpo", {"use_vllm": True}, "0.3"), ("rloo", {"use_vllm": True, "vllm_mode": "colocate"}, "0.3"),
    ("grpo", {"use_vllm": True, "vllm_gpu_memory_utilization": 0.5, "vllm_enable_sleep_mode": True}, "0.5"),
    ("grpo", {"use_vllm": True, "vllm_mode": "server"}, None), ("grpo", {}, None),
    ("sft", {"use_vllm": True}, None),
])
def test_vllm_colocated_with_grpo_is_said_with_its_share_of_the_gpu(verb: str, said: dict, share: str | None):
    """`use_vllm` under TRL's GRPO and RLOO, colocated (1.0 on, the mode unset): vLLM holds its
    `vllm_gpu_memory_utilization` of each GPU beside the run, which the estimate's peak does not
    count. Before, nothing said so: a run the estimate called fitting on 80 GB lost 24 GB to vLLM.
    A server (its own GPUs) is no such share."""
    from fsdp_offload_cfg.config.trl_defaults import vllm_mode

    run = run_arguments_of({"model_name_or_path": "m", **said}, f"{verb}.yaml", f"trl {verb}")
    lines = [c for c in run.caveats if c.startswith("use_vllm")]
    if share is None or (vllm_mode() == "server" and "vllm_mode" not in said):
        assert not lines, lines
        return
    assert len(lines) == 1 and f"vLLM holds {share} of each GPU's memory beside this run" in lines[0], lines
    assert ("while vLLM is awake" in lines[0]) is bool(said.get("vllm_enable_sleep_mode"))


@pytest.mark.parametrize("said, share", [
    ({"use_vllm": True, "vllm_mode": "colocate"}, "0.9"),
    ({"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.4, "sleep_level": 1}, "0.4"),
    ({"use_vllm": True, "vllm_mode": "server"}, None), ({}, None),
])
def test_ms_swifts_colocated_vllm_is_said_with_its_share(said: dict, share: str | None):
    """ms-swift's GRPO colocating vLLM (`--vllm_mode colocate`, which it requires with `--use_vllm`)
    gives it `vllm_gpu_memory_utilization` of each GPU, 0.9 unset (ms-swift 4.6)."""
    run = run_arguments_of({"model": "m", "rlhf_type": "grpo", **said}, "the command line", "swift rlhf")
    lines = [c for c in run.caveats if c.startswith("use_vllm")]
    assert run.vllm_share == (None if share is None else float(share))
    if share is not None:
        assert len(lines) == 1 and f"vLLM holds {share} of each GPU's memory" in lines[0], lines
        assert ("while vLLM is awake" in lines[0]) is ("sleep_level" in said)
    else:
        assert not lines


@pytest.mark.parametrize("text, share", [
    ("rl: grpo\ntrl:\n  use_vllm: true\n  vllm_mode: colocate\n", "0.9"),
    ("rl: grpo\ntrl:\n  use_vllm: true\n  vllm_mode: colocate\nvllm:\n  gpu_memory_utilization: 0.35\n", "0.35"),
    ("rl: grpo\ntrl:\n  use_vllm: true\n", None),  # axolotl 0.19 sets server where the mode is unset
    ("rl: dpo\ntrl:\n  use_vllm: true\n  vllm_mode: colocate\n", None),
])
def test_axolotls_colocated_vllm_is_said_with_its_share(tmp_path: Path, text: str, share: str | None):
    """axolotl's GRPO with `trl.vllm_mode: colocate` gives vLLM its `vllm.gpu_memory_utilization`
    of each GPU, 0.9 unset (axolotl 0.19's `VllmConfig`, passed on to TRL's GRPOConfig)."""
    run = _read(tmp_path, "base_model: m\nsequence_len: 64\nmicro_batch_size: 1\n" + text + FSDP)
    assert run.vllm_share == (None if share is None else float(share))
    lines = [c for c in run.caveats if c.startswith("trl.use_vllm")]
    assert len(lines) == (share is not None) and (share is None or f"vLLM holds {share} of each GPU" in lines[0])


def test_a_vllm_share_that_is_no_fraction_is_named_with_its_file_and_key(tmp_path: Path):
    """Before, `vllm_gpu_memory_utilization: 1.5` reached the estimate, whose error named the key
    but not the file it came from."""
    from fsdp_offload_cfg.config.trainer_file import run_arguments_of

    for value in (1.5, "most"):
        with pytest.raises(ConfigError, match=r"grpo\.yaml.*vllm_gpu_memory_utilization.*expected a fraction from 0 to 1"):
            run_arguments_of({"model_name_or_path": "m", "use_vllm": True, "vllm_mode": "colocate",
                              "vllm_gpu_memory_utilization": value}, "grpo.yaml", "trl grpo")
