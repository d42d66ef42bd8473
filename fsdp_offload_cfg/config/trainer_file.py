"""A Trainer's file as the run it describes: the training arguments beside its `fsdp_config`.

A TrainingArguments JSON or YAML, a LlamaFactory or axolotl YAML, a TRL config: each holds the
run, not only its FSDP settings. `fsdp-offload-cfg estimate FILE` takes from it what the
command line leaves out (the command line wins, as in accelerate), so that the figures are those
of the run the file launches.

Why, above all, the precision. The Trainer's `bf16: true` (or `fp16`) becomes accelerate's mixed
precision (TrainingArguments sets `ACCELERATE_MIXED_PRECISION`), under which accelerate keeps
float32 master weights: parameters, gradients and optimizer state twice the bytes of a bf16 model
without it. Such a file has no `mixed_precision` key, and `--set mixed_precision=` is refused
there (not an fsdp_config key), so the estimate counted those states in the load dtype and nothing
could correct it.

Each figure's key, as each framework spells it (the first the file has wins):
- model: `model_name_or_path` (TRL, LlamaFactory), `base_model` (axolotl);
- sequence length: `cutoff_len` (LlamaFactory; default 2048), `sequence_len` (axolotl),
  `max_length` (TRL), `max_seq_length` (TRL before 0.20);
- micro-batch: `per_device_train_batch_size` (the Trainer; unset, 8 under TRL and LlamaFactory,
  TrainingArguments' default), `micro_batch_size` (axolotl);
- `gradient_accumulation_steps`;
- optimizer: `optim` (axolotl: `optimizer`); unset, the Trainer's default `adamw_torch_fused`;
  one the estimate does not model (8-bit, paged, Adafactor) is counted as that, saying so;
- precision: `bf16` (`true`, or axolotl's `auto`: bf16 on a GPU that has it), `fp16`. False or
  unset leaves the launch's (`accelerate launch --mixed_precision`, its config file), which the
  Trainer reads first; a TRL config's unset `bf16` is true unless `fp16` (below);
- load dtype: `dtype` or `torch_dtype` (TRL's ModelConfig, transformers' example scripts),
  `model_init_kwargs` over them as TRL's scripts merge it;
- layer checkpointing: `gradient_checkpointing`; LlamaFactory's is on unless
  `disable_gradient_checkpointing: true`;
- LoRA: LlamaFactory's `finetuning_type: lora` (its default) with `lora_rank` (default 8),
  `lora_target` (default `all`: every linear layer) and `lora_dropout`; axolotl's
  `adapter: lora` with `lora_r`, `lora_target_linear` / `lora_target_modules` and `lora_dropout`;
  TRL's `use_peft: true` with `lora_r` (16), `lora_target_modules` (PEFT's default for the model's
  type) and `lora_dropout` (0.05); DoRA where `use_dora` (LlamaFactory's, TRL's, ms-swift's) or
  axolotl's `peft_use_dora` is true; modules trained whole beside the adapters (PEFT's
  `modules_to_save`): LlamaFactory's `additional_target` (where that is unset, its embeddings after
  `resize_vocab: true` or new tokens: `add_tokens`, `add_special_tokens`, `new_special_tokens_config`), axolotl's and TRL's `lora_modules_to_save`, ms-swift's `modules_to_save`;
- what the estimate counts otherwise, said as caveats: LlamaFactory's `freeze` and `oft` as a
  full fine-tune;
- a quantized base (axolotl's `adapter: qlora`, `load_in_4bit`, `load_in_8bit`; LlamaFactory's
  `quantization_bit`): the estimate counts no 4- or 8-bit weights, so it stops, saying so, unless
  `--lora-rank` asks for LoRA over the base as loaded.

A LlamaFactory file (one with `stage`, `finetuning_type`, `cutoff_len` or `template`) takes
LlamaFactory's defaults where it is silent (0.9.5's `hparams`): LoRA, a cutoff of 2048 tokens,
every layer checkpointed; `stage: dpo` pairs each sample's responses in one forward, and it and
`stage: kto` load a reference model beside a full fine-tune. An axolotl file's `rl` (`AXOLOTL_RL`)
likewise: DPO, IPO, ORPO and SimPO pair them, DPO, IPO, KTO and GRPO with a KL term load one
unless an adapter trains. A TRL config (a key in `TRL_KEYS`, which only TRL's dataclasses define)
takes TRL's (0.24 to 1.16, `trl/trainer/*_config.py`): bf16 unless `fp16`, every layer
checkpointed, and where it has a ModelConfig key the float32 load of TRL's scripts (0.29 and
later). The arguments of a framework's CLI (`cli`: `trl sft`, `swift sft`, read from a launch
command) take that framework's defaults whatever keys they hold: TRL's trainer by its verb (its
`max_length`, DPO's two sequences a sample, the reference model of `trl dpo`, `trl kto`, and of
`trl grpo` / `trl rloo` where their `beta` is not 0); ms-swift 4.6's: `--model`, LoRA
by `--tuner_type` (rank 8, all-linear, dropout 0.05), a micro-batch of 1, accumulation
`ceil(16 / batch / processes)`, checkpointing, and mixed precision by the load dtype; under
`swift rlhf --rlhf_type grpo`, `max_length` cuts the prompts alone, so a sequence is it plus
`max_completion_length` (512 unset), and an unset `max_length` makes the estimate ask. As a
file alone, only one in the Trainer's layout is read so (`fsdp` or `fsdp_config` at the top, no
accelerate launch key): an accelerate file says its own precision and names no model.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from fsdp_offload_cfg.config.model import ConfigError, Problem
from fsdp_offload_cfg.config.reading import read_config_file
from fsdp_offload_cfg.config.sources import layout_of
from fsdp_offload_cfg.config.trl_defaults import named_model_dtype, vllm_mode
from fsdp_offload_cfg.config.trl_script import TrlScript

ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer but the output head (`estimate --lora-targets`)
# no `target_modules`: PEFT's own default for the model's type (q_proj,v_proj for a Llama), as TRL leaves it
PEFT_DEFAULT = "peft-default"
# the model's input and output embeddings, whatever their names: what LlamaFactory trains whole
# beside its adapters after `resize_vocab` (its `adapter.py`), `estimate --lora-modules-to-save`
EMBEDDINGS = "input-output-embeddings"
# LlamaFactory's keys that add tokens to the tokenizer: new ones turn its `resize_vocab` on
NEW_TOKEN_KEYS = ("add_tokens", "add_special_tokens", "new_special_tokens_config")
MODEL_KEYS = ("model_name_or_path", "base_model", "model")  # `model`: ms-swift's
SEQ_LEN_KEYS = ("cutoff_len", "sequence_len", "max_length", "max_seq_length")
BATCH_KEYS = ("per_device_train_batch_size", "micro_batch_size")
# the Trainer's `optim` names the estimate models, as the estimate names them
OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw_fused", "sgd": "sgd"}
LLAMAFACTORY_KEYS = ("stage", "finetuning_type", "cutoff_len", "template")  # keys no other file here has
# a base quantized to 4 or 8 bits: axolotl's qlora and load_in_*bit, LlamaFactory's quantization_bit
QUANTIZED_KEYS = ("load_in_4bit", "load_in_8bit", "quantization_bit")
# keys only TRL's dataclasses define (its ModelConfig, ScriptArguments, its trainers' configs and its CLI)
TRL_KEYS = ("use_peft", "model_revision", "accelerate_config", "dataset_train_split", "dataset_text_field",
            "completion_only_loss", "assistant_only_loss", "model_init_kwargs", "padding_free",
            "num_generations", "reward_funcs")
# the TRL trainers that may load a reference model, and the KL coefficient `beta` each has unset (TRL 0.24 to
# 1.16; DPO's and KTO's load one whatever their beta)
REFERENCE_BETA = {"dpo": 0.1, "kto": 0.1, "grpo": 0.0, "rloo": 0.05}
# the TRL verbs whose trainers patch the model with TRL's fused LM head (1.15 on), and those among them that
# score a generated completion only (its `max_completion_length`) and may hold a reward model
TRL_FUSED_HEAD_VERBS = ("sft", "dpo", "kto", "grpo", "rloo")
TRL_COMPLETION_VERBS = ("grpo", "rloo")
# axolotl 0.19's `rl` methods (its RLType) the estimate models, through the TRL 1.9 trainers it subclasses; any
# other (`ebft`) is read as fine-tuning, saying so
AXOLOTL_RL = ("dpo", "ipo", "orpo", "simpo", "kto", "grpo", "gdpo")
MODEL_CONFIG_KEYS = ("use_peft", "model_revision", "lora_task_type")  # TRL's ModelConfig: its scripts load by it


@dataclass(frozen=True)
class RunArguments:
    """What a Trainer's file says of its run; None where it says nothing. `taken`: where each
    value came from (`cutoff_len`; `bf16: true`; `finetuning_type: lora`),
    for the estimate to say."""

    file: str
    model: str | None = None
    seq_len: int | None = None
    batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    mixed_precision: str | None = None  # accelerate's name, bf16 or fp16; None: the file turns none on
    gradient_checkpointing: bool = False
    optimizer: str | None = None  # the estimate's name (adamw, adamw_fused, sgd)
    dtype: str | None = None  # the dtype the model is loaded in (TRL's `dtype`); None: the model's own
    # ms-swift's mixed precision follows the load dtype where nothing names it (bf16 over bfloat16, else fp16):
    # the estimate, which reads the model, decides it
    precision_follows_dtype: bool = False
    accumulation_target: int | None = None  # ms-swift's unset accumulation: ceil(this / batch / processes)
    # ms-swift's unset max_length: the model's longest (`model_max_length`), which the estimate, reading the model,
    # finds (its `--max_model_len` sets RoPE scaling, not this)
    seq_len_follows_model: bool = False
    # where no key gives the sequence length and no default holds: what the run's sequences are, in words
    # (`trl grpo`'s: a prompt and its generated completion), for the usage error that asks for --seq-len
    seq_len_said: str | None = None
    # TRL loads a reference model, a frozen copy sharded beside the policy (`trl dpo` without PEFT): whose, in words
    reference_model: str | None = None
    # `trl grpo` / `trl rloo`'s `reward_model_name_or_path`: a reward model TRL holds whole on every rank;
    # `swift rlhf --rlhf_type grpo`'s `--reward_model` (one or more)
    reward_models: tuple[str, ...] = ()
    # `trl distillation`'s `teacher_model_name_or_path`, held whole on every rank too, and the dtype its
    # `teacher_model_init_kwargs` name (`auto`: its checkpoint's own; None: the model's load dtype, as TRL's script
    # loads both by ModelConfig's `dtype`); `swift rlhf`'s `--teacher_model` (GKD, GRPO)
    teacher_model: str | None = None
    teacher_dtype: str | None = None
    # the head the loss goes through (`estimate/heads.py`): the model's own `cross_entropy` over the full logits,
    # TRL's `trl_fused_lm_head` (`trl sft`, `dpo`, `kto`, `grpo`, `rloo`) or `trl_chunked_distillation`; and the
    # positions it scores at each sequence's end (a generated completion's: `max_completion_length`), None: all
    loss_head: str = "cross_entropy"
    completion_tokens: int | None = None
    # ms-swift shards its reward models and teacher beside the model (its `prepare_fsdp`), where TRL keeps them whole
    companions_sharded: bool = False
    lora_rank: int | None = None
    lora_targets: str | None = None  # PEFT's target_modules: all-linear, or names joined by commas
    lora_dropout: float | None = None
    lora_dora: bool = False  # the adapters are DoRA's (`use_dora`, axolotl's `peft_use_dora`)
    lora_modules_to_save: str = ""  # PEFT's modules_to_save, names joined by commas (or EMBEDDINGS)
    # where the targets and the modules to save were read ("sft.yaml: lora_target:"), for an error
    # naming a module the model lacks; "" where a default holds
    lora_keys: tuple[str, str] = ("", "")
    quantized: str | None = None  # the key that quantizes the base (`adapter: qlora`), which no estimate counts
    vllm_share: float | None = None  # the fraction of each GPU vLLM holds colocated with GRPO / RLOO (`use_vllm`)
    taken: dict[str, str] = field(default_factory=dict)
    caveats: tuple[str, ...] = ()  # what the file asks that the estimate counts otherwise, in words


def is_trainer_layout(top: dict[Any, Any]) -> bool:
    return layout_of(top) == "trainer"


def run_arguments(path: str) -> RunArguments | None:
    """The run `path` describes, where it is a Trainer's file; None for any other config."""
    top = read_config_file(path)
    if not is_trainer_layout(top):
        return None
    return run_arguments_of(top, path)


def run_arguments_of(top: dict[Any, Any], source: str, cli: str | None = None,
                     script: TrlScript | None = None) -> RunArguments:
    """The run training arguments describe, wherever they were read (`source` names it in
    errors): a Trainer's file, or a launch command's (`launch_command.py`), where `cli`
    (`trl sft`, `swift sft`) names the framework's CLI that runs them, whose defaults then hold,
    and `script` the TRL run a script of the user's own builds (`config/trl_script.py`): under a
    TRL config, that trainer's defaults hold, as under `trl VERB`."""
    reader = _Reader(top, source, cli, script)
    values: dict[str, Any] = {
        "model": reader.first(MODEL_KEYS, str, "model"),
        "seq_len": reader.seq_len(),
        "batch_size": reader.sequences_a_forward(reader.first(BATCH_KEYS, int, "batch_size",
                                                              default=reader.default_batch_size())),
        **reader.accumulation(),
        "seq_len_follows_model": reader.swift and reader.swift_rlhf != "grpo"
        and not any(top.get(key) is not None for key in SEQ_LEN_KEYS),
        "seq_len_said": reader.generated_length(),
        "reference_model": reader.reference_model(),
        "reward_models": reader.reward_models(),
        "companions_sharded": reader.swift,
        **reader.teacher(),
        **reader.loss_head(),
        "mixed_precision": reader.precision(),
        "precision_follows_dtype": reader.precision_follows_dtype,
        "optimizer": reader.optimizer(),
        "dtype": reader.load_dtype(),
        "gradient_checkpointing": reader.checkpointing(),
        **reader.lora(),
        "quantized": "adapter: qlora" if top.get("adapter") == "qlora" else next(
            (f"{k}: {_show(top[k])}" for k in QUANTIZED_KEYS if top.get(k) not in (None, False)), None),
    }
    values["vllm_share"] = reader.colocated_vllm()
    reader.raise_problems()
    return RunArguments(source, **values, taken=reader.taken, caveats=tuple(reader.caveats))


# the keys a model's config.json gives its longest sequence in, as ms-swift 4.6 reads them
# (`HfConfigFactory.get_max_model_len`: the least of those present), and the sub-configs it looks in
MAX_LENGTH_KEYS = ("seq_length", "max_position_embeddings", "n_positions", "model_max_length", "seq_len",
                   "max_seq_len", "max_sequence_length", "max_seq_length")
LANGUAGE_SUBCONFIGS = ("llm_config", "language_config", "text_config")


def model_max_length(model_config: dict[str, Any]) -> int | None:
    """The longest sequence a model's config.json allows, as ms-swift takes it for an unset
    `max_length`: the least of `MAX_LENGTH_KEYS`, at the top or in its language model's sub-config
    (a vision-language model keeps it in `text_config`); None where it names none."""
    lengths = [config[key] for config in [model_config, *(model_config.get(k) for k in LANGUAGE_SUBCONFIGS)]
               if isinstance(config, dict) for key in MAX_LENGTH_KEYS if isinstance(config.get(key), int)]
    return min(lengths, default=None)


class _Reader:
    """The file's keys, type-checked; every wrong one is collected and said together, the file and
    key named, as `load_config` says its problems."""

    def __init__(self, top: dict[Any, Any], path: str, cli: str | None = None, script: TrlScript | None = None):
        self.top, self.path = top, path
        framework, _, verb = (cli or "").partition(" ")
        # a script of the user's own building a TRL trainer with TRL's config: that verb's defaults
        self.script = script if script is not None and script.trl_defaults else None
        self.trl_verb = verb if framework == "trl" else self.script.verb if self.script else None
        # TRL's own scripts load the model by its ModelConfig (float32 unset), and so does a script naming it
        self.trl_scripts = framework == "trl" or bool(self.script and self.script.model_config)
        # ms-swift's CLI: LoRA, checkpointing and a micro-batch of 1 by default, precision by the load dtype
        self.swift = framework == "swift"
        # `swift rlhf`'s method (`--rlhf_type`, DPO unset; SimPO runs as CPO), whose defaults hold over sft's
        self.swift_rlhf = str(top.get("rlhf_type") or "dpo") if cli == "swift rlhf" else None
        self.precision_follows_dtype = False
        self.taken: dict[str, str] = {}
        self.caveats: list[str] = []
        self.problems: list[Problem] = []
        # LlamaFactory's own keys: its defaults differ from the Trainer's (LoRA, checkpointing on)
        self.llamafactory = not self.swift and any(key in top for key in LLAMAFACTORY_KEYS)  # ms-swift has `template`
        # TRL's configs: bf16 and checkpointing on where the file is silent (`trl/trainer/base_config.py`)
        self.trl = self.trl_verb is not None or (  # ms-swift's GRPO has `num_generations` and `reward_funcs`
            not self.llamafactory and not self.swift and "base_model" not in top and any(key in top for key in TRL_KEYS))
        # an axolotl file's `rl` method (`rl: dpo`): None for fine-tuning, its default
        self.axolotl_rl = self._axolotl_rl()

    @property
    def _trl_run(self) -> str:
        """What runs TRL's trainer, in words: `trl dpo`, or a script's `TRL's DPOTrainer`."""
        return f"TRL's {self.script.trainer}" if self.script else f"trl {self.trl_verb}"

    def _axolotl_rl(self) -> str | None:
        said = self.top.get("rl") if "base_model" in self.top and not self.llamafactory and not self.swift else None
        if said in (None, False) or said in AXOLOTL_RL:
            return said or None
        self.caveats.append(f"rl: {_show(said)} is not modelled: estimated as fine-tuning (no reference model, "
                            "one sequence a sample)")
        return None

    def optimizer(self) -> str:
        """The estimate's name for the run's optimizer: the Trainer's default (`adamw_torch_fused`
        on torch >= 2.8, so on every torch this package supports) where the file names none."""
        key = next((k for k in ("optim", "optimizer") if self.top.get(k) is not None), None)
        if key is None:
            self.taken["optimizer"] = "optim unset: the Trainer's default adamw_torch_fused"
            return "adamw_fused"
        name = self.top[key]
        if name in OPTIMIZERS:
            self.taken["optimizer"] = key
            return OPTIMIZERS[name]
        self.taken["optimizer"] = f"{key}: {_show(name)} is not modelled: counted as adamw_torch_fused"
        return "adamw_fused"

    def checkpointing(self) -> bool:
        """Whether every layer is checkpointed: `gradient_checkpointing: true`; LlamaFactory's
        unless `disable_gradient_checkpointing: true`."""
        if self.llamafactory:
            disabled = self._typed("disable_gradient_checkpointing", bool) \
                if "disable_gradient_checkpointing" in self.top else False
            if disabled is False:
                self.taken["gradient_checkpointing"] = "LlamaFactory's default: disable_gradient_checkpointing unset"
            return disabled is False
        if self.top.get("gradient_checkpointing") is not None:
            if self._typed("gradient_checkpointing", bool):
                self.taken["gradient_checkpointing"] = "gradient_checkpointing: true"
                return True
            return False
        if self.trl or self.swift:
            self.taken["gradient_checkpointing"] = \
                f"gradient_checkpointing unset: {'TRL' if self.trl else 'ms-swift'}'s default"
        return self.trl or self.swift

    def load_dtype(self) -> str | None:
        """TRL's `dtype` (its ModelConfig; `model_init_kwargs` wins, as its scripts merge them),
        where it names one: its scripts load in float32 where a ModelConfig file says none."""
        init = self.top.get("model_init_kwargs")
        for where, mapping in (("model_init_kwargs.", init if isinstance(init, dict) else {}), ("", self.top)):
            key = next((k for k in ("dtype", "torch_dtype") if mapping.get(k) is not None), None)
            if key is not None and mapping[key] != "auto":
                self.taken["dtype"] = f"{where}{key}"
                return str(mapping[key])
            if key is not None:
                return None  # auto: the checkpoint's own, the estimate's default
        if self.trl_scripts or (self.trl and self.trl_verb is None and any(key in self.top for key in MODEL_CONFIG_KEYS)):
            self.taken["dtype"] = "dtype unset: TRL's ModelConfig default float32"
            return "float32"
        if self.script is not None and self.script.model_by_name and (dtype := named_model_dtype()) is not None:
            self.taken["dtype"] = "dtype unset: TRL loads a model given by name in float32 (0.27 on)"
            return dtype
        return None

    def accumulation(self) -> dict[str, int | None]:
        """`gradient_accumulation_steps`, and where ms-swift computes it (unset) the target it
        divides: `ceil(16 / batch / processes)`, except under `swift rlhf --rlhf_type grpo`, whose
        unset accumulation is 1 (ms-swift 4.6's `RLHFArguments._set_default`)."""
        if self.top.get("gradient_accumulation_steps") is not None or not self.swift:
            return {"gradient_accumulation_steps": self.first(("gradient_accumulation_steps",), int,
                                                              "gradient_accumulation_steps"), "accumulation_target": None}
        if self.swift_rlhf == "grpo":
            self.taken["gradient_accumulation_steps"] = "gradient_accumulation_steps unset: ms-swift's GRPO default"
            return {"gradient_accumulation_steps": 1, "accumulation_target": None}
        return {"gradient_accumulation_steps": None, "accumulation_target": 16}

    def reference_model(self) -> str | None:
        """Why the TRL trainer loads a reference model beside the policy, in words; None where it
        loads none (TRL 0.24 to 1.16 alike). `trl dpo` and `trl kto` load one unless PEFT's disabled
        adapters stand for it (`use_peft`) or its log-probs are computed before training
        (`precompute_ref_log_probs`: under FSDP it is freed then); `trl grpo` and `trl rloo` load
        one for their KL term where `beta` is not 0 (0.0 and 0.05 unset), unless `use_peft`."""
        if self.swift_rlhf is not None:
            return self._swift_reference()
        if self.axolotl_rl is not None:
            return self._axolotl_reference()
        if self.llamafactory:
            return self._llamafactory_reference()
        if self.trl_verb not in REFERENCE_BETA or self.top.get("use_peft") is True:
            return None
        if self.trl_verb in ("dpo", "kto"):
            return None if self.top.get("precompute_ref_log_probs") is True else self._trl_run + "'s"
        return self._kl_term(self._trl_run + "'s", REFERENCE_BETA[self.trl_verb], "TRL")

    def _llamafactory_reference(self) -> str | None:
        """LlamaFactory 0.9.5 loads a reference model for `stage: dpo` (unless `pref_loss` is
        orpo or simpo) and `stage: kto` (`create_ref_model`), unless the fine-tune is LoRA (its
        default), whose disabled adapters stand for it, and no `ref_model` names another
        checkpoint, which is counted as a copy of the model, saying so."""
        stage = self.top.get("stage")
        if stage not in ("dpo", "kto") or (stage == "dpo" and self.top.get("pref_loss") in ("orpo", "simpo")):
            return None
        if self.top.get("ref_model") is None and self.top.get("finetuning_type", "lora") == "lora":
            return None
        return self._named_reference(f"LlamaFactory's stage {stage}")

    def _axolotl_reference(self) -> str | None:
        """axolotl 0.19 (`setup_reference_model`, then TRL 1.9's trainers) holds a reference
        model for `rl: dpo` and `ipo` (a second load it hands TRL, which shards it, its log-probs
        precomputed or not), `kto` (TRL's KTOTrainer loads its own) and `grpo` / `gdpo` where the
        KL weight `trl.beta` (else `rl_beta`; 0 unset, TRL's) is not 0: each unless an `adapter`
        trains, whose disabled adapters stand for it (DPO's and IPO's copy is loaded anyway under
        `rl_adapter_ref_model: true`). ORPO and SimPO have none."""
        rl, adapter = self.axolotl_rl, self.top.get("adapter") is not None
        words = f"axolotl's rl: {rl}"
        if rl in ("dpo", "ipo"):
            return words if not adapter or self.top.get("rl_adapter_ref_model") is True else None
        if adapter or rl not in ("kto", "grpo", "gdpo"):
            return None
        if rl == "kto":
            return words
        return self._kl_term(words, 0.0, "TRL", "trl.beta" if self._said("trl.beta") is not None else "rl_beta")

    def _swift_reference(self) -> str | None:
        """`swift rlhf` loads a reference model for DPO, KTO, PPO and GRPO under a full fine-tune
        (`--tuner_type full`; LoRA's disabled adapters stand for it otherwise), GRPO's where `beta`
        is not 0 (0.04 unset), as ms-swift 4.6's `RLHFArguments.__post_init__` decides. A
        `--ref_model` of another checkpoint is counted as a copy of the model, saying so."""
        if self.swift_rlhf not in ("dpo", "kto", "ppo", "grpo") or self._swift_tuner_said()[1] != "full":
            return None
        words = f"swift rlhf --rlhf_type {self.swift_rlhf}'s"
        if self.swift_rlhf == "grpo":
            words = self._kl_term(words, 0.04, "ms-swift")
        return None if words is None else self._named_reference(words)

    def _named_reference(self, words: str) -> str:
        """`words`, saying as a caveat that a `ref_model` of another checkpoint (ms-swift's,
        LlamaFactory's) is counted as a copy of the model."""
        if self.top.get("ref_model") is not None:
            self.caveats.append(f"ref_model: {_show(self.top['ref_model'])} is counted as a copy of the model")
        return words

    def _kl_term(self, whose: str, unset: float, framework: str, key: str = "beta") -> str | None:
        """`whose` reference model, for a KL term weighted by the file's `key` (`unset` where the
        file says none); None where it is 0: no KL term, no reference model."""
        said = self._said(key)
        beta = unset if said is None else _number(said)
        if beta is None:
            self.problems.append(Problem(self.path, key, f"expected a number, got {_show(said)}"))
        if not beta:
            return None
        return f"{whose}, for its KL term ({key} {_show(beta)}" + (")" if said is not None else f": {framework}'s default)")

    def _said(self, key: str) -> Any:
        """The file's value of `key`, a dotted one in a mapping (axolotl's `trl.beta`); None unsaid."""
        value: Any = self.top
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return value

    def reward_models(self) -> tuple[str, ...]:
        """`trl grpo` / `trl rloo`'s `reward_model_name_or_path` (their scripts' argument);
        `swift rlhf --rlhf_type grpo`'s `--reward_model`, one path or several (ms-swift 4.6
        loads each; PPO's, the value model's start, is not counted: said as a caveat)."""
        if self.swift_rlhf in ("grpo", "ppo") and self.top.get("reward_model") is not None:
            said = self.top["reward_model"]
            paths = [said] if isinstance(said, str) else said
            if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
                self.problems.append(Problem(self.path, "reward_model", f"expected model paths, got {_show(said)}"))
                return ()
            if self.swift_rlhf == "ppo":
                self.caveats.append("reward_model: PPO's value and reward models are not counted")
                return ()
            return tuple(paths)
        if self.trl_verb not in TRL_COMPLETION_VERBS:
            return ()
        said = self.top.get("reward_model_name_or_path")
        if isinstance(said, list) and said and all(isinstance(p, str) for p in said):  # a script's `reward_funcs=[...]`
            self.taken["reward_model"] = "reward_model_name_or_path"
            return tuple(said)
        path = self.first(("reward_model_name_or_path",), str, "reward_model")
        return () if path is None else (path,)

    def teacher(self) -> dict[str, Any]:
        """`trl distillation`'s teacher (`teacher_model_name_or_path`) and the dtype its
        `teacher_model_init_kwargs` name (a mapping, or its JSON text from the command line); None
        where they name none: TRL's script then loads the teacher in ModelConfig's `dtype`, as the
        model."""
        if self.swift_rlhf in ("gkd", "grpo"):  # loaded in the model's dtype (`get_model_processor`)
            return {"teacher_model": self.first(("teacher_model",), str, "teacher_model"), "teacher_dtype": None}
        if self.trl_verb != "distillation" or self.top.get("teacher_model_name_or_path") is None:
            return {"teacher_model": None, "teacher_dtype": None}
        kwargs = self.top.get("teacher_model_init_kwargs") or {}
        if isinstance(kwargs, str):
            try:
                kwargs = json.loads(kwargs)
            except ValueError:
                kwargs = None
        if not isinstance(kwargs, dict):
            self.problems.append(Problem(self.path, "teacher_model_init_kwargs", "expected a mapping (or its JSON), "
                                         f"got {_show(self.top['teacher_model_init_kwargs'])}"))
            kwargs = {}
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        return {"teacher_model": self.first(("teacher_model_name_or_path",), str, "teacher_model"),
                "teacher_dtype": None if dtype is None else str(dtype)}

    def loss_head(self) -> dict[str, Any]:
        """The head the run's loss goes through (`estimate/heads.py`; TRL 1.15 on): `trl
        distillation`'s chunked divergence; the fused LM head TRL's `sft`, `dpo`, `kto`, `grpo` and
        `rloo` patch the model with (a file of TRL's keys read as one of theirs, as its defaults
        are; `sft` computes the full logits instead under label smoothing, which needs them); else
        the model's own cross-entropy. And the positions scored at each sequence's end where
        only a generated completion is (`max_completion_length`, 512 unset: distillation, GRPO,
        RLOO); None: every one."""
        if self.trl_verb == "distillation" and self.top.get("teacher_model_name_or_path") is not None:
            return {"loss_head": "trl_chunked_distillation", "completion_tokens": self._completion_tokens()}
        if self.trl_verb not in TRL_FUSED_HEAD_VERBS and not (self.trl and self.trl_verb is None):
            return {"loss_head": "cross_entropy", "completion_tokens": None}
        smoothing = self.top.get("label_smoothing_factor")
        if self.trl_verb in ("sft", None) and isinstance(smoothing, (int, float)) and smoothing > 0:
            return {"loss_head": "cross_entropy", "completion_tokens": None}
        return {"loss_head": "trl_fused_lm_head",
                "completion_tokens": self._completion_tokens() if self.trl_verb in TRL_COMPLETION_VERBS else None}

    def colocated_vllm(self) -> float | None:
        """GRPO and RLOO generating with vLLM in the training processes: TRL's `use_vllm` with
        `vllm_mode` colocate (unset: colocate from TRL 1.0), ms-swift's `--use_vllm true
        --vllm_mode colocate` (4.6 requires the mode), axolotl's `trl.use_vllm` with
        `trl.vllm_mode: colocate` (0.19: server unset). vLLM takes its GPU memory utilization
        (TRL's 0.3, ms-swift's and axolotl's 0.9 unset) of each GPU's whole memory for its weights
        and KV cache beside training, which the peak does not count; said, with how much, and the
        fraction returned (a share of a device the estimate knows under `auto` alone, whose room
        takes it). None where vLLM is not colocated."""
        keys = ("use_vllm", "vllm_mode", "vllm_gpu_memory_utilization")
        if self.swift_rlhf == "grpo":  # ms-swift 4.6's `RolloutTrainerArgumentsMixin`
            framework, default, sleep_key, unset_mode = "ms-swift", 0.9, "sleep_level", None
        elif self.axolotl_rl == "grpo":  # axolotl 0.19's `TRLConfig`, `VllmConfig`
            framework, default, sleep_key, unset_mode = "axolotl", 0.9, "trl.vllm_enable_sleep_mode", "server"
            keys = ("trl.use_vllm", "trl.vllm_mode", "vllm.gpu_memory_utilization")
        elif self.trl_verb in ("grpo", "rloo"):
            framework, default, sleep_key, unset_mode = "TRL", 0.3, "vllm_enable_sleep_mode", vllm_mode()
        else:
            return None
        said_mode = self._said(keys[1])
        if self._said(keys[0]) is not True or (said_mode or unset_mode) != "colocate":
            return None
        share = self._said(keys[2])
        fraction = _number(share) if share is not None else default
        if fraction is None or not 0 <= fraction < 1:
            self.problems.append(Problem(self.path, keys[2], f"expected a fraction from 0 to 1, got {_show(share)}"))
            return None
        said = [f"{keys[1]} {'colocate' if said_mode else 'unset: TRL 1.0 on colocates'}",
                f"{keys[2]} {_show(share) if share is not None else f'{default:g} unset'}"]
        asleep = bool(self._said(sleep_key))  # TRL's and axolotl's flag; ms-swift's level, 0 unset
        self.caveats.append(
            f"{keys[0]} ({', '.join(said)}): vLLM holds {fraction:g} of each GPU's memory beside this run, not counted "
            "here: the device needs this peak plus that share"
            + (f" while vLLM is awake ({sleep_key}: {framework} has it release most of it while training)" if asleep
               else f" ({sleep_key}: {'1 or 2' if framework == 'ms-swift' else 'true'} releases most of it while "
                    "training)"))
        return fraction

    def _completion_tokens(self) -> int:
        return self.first(("max_completion_length",), int, "completion_tokens",
                          (512, "max_completion_length unset: TRL's default 512"))

    def seq_len(self) -> int | None:
        """The longest sequence a forward takes: the file's length key, else the framework's
        default. `swift rlhf --rlhf_type grpo` cuts the prompts to `max_length` and trains on each
        with its completion, encoded with no `max_length` (ms-swift 4.6's `_prepare_batch_inputs`
        under `_template_context`): the key plus `max_completion_length`. axolotl's GRPO filters
        nothing by `sequence_len` and cuts no prompt (0.19's `_drop_long_sequences`, and
        `max_prompt_length` withheld from TRL): no key gives its length (`generated_length`)."""
        if self.axolotl_rl in ("grpo", "gdpo"):
            return None
        length = self.first(SEQ_LEN_KEYS, int, "seq_len", default=self.default_seq_len())
        if self.swift_rlhf != "grpo" or length is None:
            return length
        key, completion = self._swift_completion
        self.taken["seq_len"] += f" + {key} {completion}: ms-swift's GRPO trains on the prompt, cut to that, " \
                                 "and its generated completion"
        return length + completion

    @functools.cached_property
    def _swift_completion(self) -> tuple[str, int]:
        """ms-swift's generated tokens: the first of its old names and `max_completion_length`
        (512 unset), as `RLHFArguments._init_max_completion_length` takes them."""
        key = next((k for k in ("response_length", "max_new_tokens", "max_completion_length")
                    if self.top.get(k) is not None), None)
        completion = self._typed(key, int) if key is not None else None
        return (key, completion) if completion is not None else ("max_completion_length", 512)

    def generated_length(self) -> str | None:
        """`trl grpo`, `trl rloo` and `trl distillation` train on a prompt and the completion
        generated for it, up to `max_completion_length` tokens (512 unset in TRL 0.24 to 1.16); no
        key of theirs gives the whole length, so the estimate asks for it, saying this. So does
        ms-swift's GRPO where `max_length`, which cuts its prompts, is unset (the model's longest),
        and axolotl's, whose `sequence_len` limits neither (its `trl.max_completion_length` unset
        reaches TRL as None, not TRL's default 256)."""
        if self.axolotl_rl in ("grpo", "gdpo"):
            completion = self._said("trl.max_completion_length")
            return (f"axolotl's rl: {self.axolotl_rl} trains on a prompt and a generated completion (trl.max_completion_length "
                    f"{'unset: axolotl passes TRL None' if completion is None else completion}), neither cut to sequence_len: give "
                    "--seq-len as your longest prompt plus the longest completion")
        if self.swift_rlhf == "grpo":
            key, completion = self._swift_completion
            return (f"swift rlhf --rlhf_type grpo trains on a prompt (cut to max_length: unset, the model's longest) "
                    f"and a completion of up to {key} {completion} generated tokens: give --seq-len as your longest "
                    "prompt plus that, or set max_length")
        if self.trl_verb not in ("grpo", "rloo", "distillation"):
            return None
        completion = self.top.get("max_completion_length")
        return (f"{self._trl_run} trains on a prompt and a completion of up to max_completion_length "
                f"{completion if completion is not None else '512 (unset)'} generated tokens: give --seq-len as "
                "your longest prompt plus that")

    def sequences_a_forward(self, batch: int | None) -> int | None:
        """The sequences one forward takes for `batch` samples: twice under `trl dpo`, `swift
        rlhf`'s DPO, CPO, SimPO and ORPO, and LlamaFactory's `stage: dpo`, whose collators put each
        sample's chosen and rejected completions in one batch (TRL's `concatenated_forward`,
        which ms-swift's, LlamaFactory's and axolotl's keep: its `rl: dpo`, `ipo`, `orpo`, `simpo`)."""
        method = "dpo" if self.trl_verb == "dpo" or self._llamafactory_pairs() else self.swift_rlhf or self.axolotl_rl
        if method not in ("dpo", "cpo", "simpo", "orpo", "ipo") or batch is None:
            return batch
        samples = f"{batch} sample" + ("s" if batch != 1 else "")
        self.taken["batch_size"] += f", {samples} x 2: {method.upper()} runs each sample's chosen and " \
                                    "rejected completions in one forward"
        return 2 * batch

    def _llamafactory_pairs(self) -> bool:
        """LlamaFactory's `stage: dpo` (ORPO and SimPO by its `pref_loss` too) batches each
        sample's chosen and rejected responses together (`PairwiseDataCollatorWithPadding`)."""
        return self.llamafactory and self.top.get("stage") == "dpo"

    def default_batch_size(self) -> tuple[int, str] | None:
        """The framework's micro-batch where the file names none: ms-swift's 1; TrainingArguments'
        8 under TRL and LlamaFactory, whose configs keep it (a plain TrainingArguments file's script
        may set its own, and axolotl's is its own: those the estimate asks for)."""
        if self.swift:
            return 1, "per_device_train_batch_size unset: ms-swift's default"
        if self.trl or self.llamafactory:
            framework = "TRL" if self.trl else "LlamaFactory"
            return 8, f"per_device_train_batch_size unset: TrainingArguments' default, which {framework} keeps"
        return None

    def default_seq_len(self) -> tuple[int, str] | None:
        """The framework's own sequence length where the file names none, and its words:
        LlamaFactory's `cutoff_len` 2048; `max_length` 1024 of TRL's SFTConfig, DPOConfig and
        KTOConfig (known from `trl sft` / `trl dpo` / `trl kto` only: a file alone does not say
        which trainer reads it; GRPO's and RLOO's sequences are a prompt of any length and up to
        `max_completion_length` generated tokens, which the estimate asks for)."""
        if self.llamafactory:
            return 2048, "cutoff_len unset: LlamaFactory's default"
        if self.trl_verb in ("sft", "dpo", "kto"):
            return 1024, f"max_length unset: TRL's {self.trl_verb} default"
        return None

    def first(self, keys: tuple[str, ...], kind: type, name: str, default: tuple[Any, str] | None = None) -> Any:
        """The value of the first of `keys` the file has; where it has none, the framework's
        `default` (value, words)."""
        key = next((k for k in keys if self.top.get(k) is not None), None)
        if key is None:
            if default is None:
                return None
            self.taken[name] = default[1]
            return default[0]
        value = self._typed(key, kind)
        if value is not None:
            self.taken[name] = key
        return value

    def precision(self) -> str | None:
        bf16, fp16 = self.top.get("bf16"), self.top.get("fp16")
        for key, value in (("bf16", bf16), ("fp16", fp16)):
            if value is not None and not isinstance(value, bool) and not (key == "bf16" and value == "auto"):
                self.problems.append(Problem(self.path, key, f"expected true or false, got {_show(value)}"))
                return None
        if bf16 is True or bf16 == "auto" or fp16 is True:
            key = "fp16" if fp16 is True else "bf16"  # the Trainer's order: fp16 is checked first
            self.taken["mixed_precision"] = f"{key}: {_show(self.top[key])}"
            return key
        if self.trl and bf16 is None:  # TRL's configs: `bf16 = not fp16` where it is unset
            self.taken["mixed_precision"] = "bf16 unset: TRL's default"
            return "bf16"
        if self.swift and bf16 is None and fp16 is None:  # ms-swift's `_init_mixed_precision`
            dtype = self.top.get("torch_dtype")
            if dtype is None:
                self.precision_follows_dtype = True
                return None
            self.taken["mixed_precision"] = f"torch_dtype: {_show(dtype)}, as ms-swift turns it into bf16 / fp16"
            return "bf16" if dtype == "bfloat16" else "fp16"
        return None  # false or unset: the launch's own mixed precision, which the Trainer reads first

    def lora(self) -> dict[str, Any]:
        """LlamaFactory's `finetuning_type: lora` or axolotl's `adapter: lora`, as PEFT's three
        numbers; nothing for a full fine-tune."""
        finetuning = self.top.get("finetuning_type", "lora" if self.llamafactory else None)
        if finetuning == "lora":
            rank = self._typed("lora_rank", int) if "lora_rank" in self.top else 8
            target = self.top.get("lora_target", "all")
            targets = ALL_LINEAR if target == "all" else self._names("lora_target")
            how = "finetuning_type: lora" if "finetuning_type" in self.top else "finetuning_type unset: LlamaFactory's default lora"
        elif self.top.get("adapter") == "lora":
            rank = self._typed("lora_r", int) if "lora_r" in self.top else 8
            targets = ALL_LINEAR if self.top.get("lora_target_linear") is True else self._names("lora_target_modules")
            how = "adapter: lora"
        elif self.swift:
            return self._swift_tuner()
        elif self.top.get("use_peft") is not None and self._typed("use_peft", bool):  # TRL's ModelConfig
            rank = self._typed("lora_r", int) if "lora_r" in self.top else 16
            targets = PEFT_DEFAULT if self.top.get("lora_target_modules") is None else self._names("lora_target_modules")
            how = "use_peft: true"
            if self.top.get("lora_dropout") is None:
                return self._adapters(rank, targets, 0.05, how)
        else:
            if finetuning in ("freeze", "oft"):  # LlamaFactory's other two: a full fine-tune bounds them
                self.caveats.append(f"finetuning_type: {finetuning} is counted as a full fine-tune (an upper bound)")
            return {}
        dropout = self._typed("lora_dropout", float) if self.top.get("lora_dropout") is not None else 0.0
        return self._adapters(rank, targets, dropout, how)

    def _swift_tuner(self) -> dict[str, Any]:
        """ms-swift's `--tuner_type` (`--train_type` before 4.x), `lora` unless given, with its
        `lora_rank` 8, `target_modules` all-linear and `lora_dropout` 0.05."""
        key, tuner = self._swift_tuner_said()
        if tuner != "lora":
            if tuner != "full":
                self.caveats.append(f"{key}: {_show(tuner)} is counted as a full fine-tune (an upper bound)")
            return {}
        rank = self._typed("lora_rank", int) if "lora_rank" in self.top else 8
        targets = ALL_LINEAR if self.top.get("target_modules") in (None, ALL_LINEAR, [ALL_LINEAR]) \
            else self._names("target_modules")
        dropout = self._typed("lora_dropout", float) if self.top.get("lora_dropout") is not None else 0.05
        return self._adapters(rank, targets, dropout, f"{key}: lora" if key else "tuner_type unset: ms-swift's default lora")

    def _swift_tuner_said(self) -> tuple[str | None, Any]:
        """The key that names ms-swift's tuner (`tuner_type`; `train_type` before 4.x) and the
        tuner: `lora` where neither is given."""
        key = next((k for k in ("tuner_type", "train_type") if self.top.get(k) is not None), None)
        return key, self.top[key] if key is not None else "lora"

    def _adapters(self, rank: int | None, targets: str | None, dropout: float | None, how: str) -> dict[str, Any]:
        if rank is None or targets is None or dropout is None:
            return {}
        key = next((k for k in ("use_dora", "peft_use_dora") if self.top.get(k) is not None), None)
        dora = key is not None and self._typed(key, bool) is True
        saved, saved_said, saved_key = self._modules_to_save()
        self.taken["lora"] = ", ".join([how] + ([f"{key}: true"] if dora else []) + ([saved_said] if saved else []))
        targets_key = next((k for k in ("lora_target", "lora_target_modules", "target_modules") if k in self.top), None)
        keys = tuple(f"{self.path}: {k}:" if k else "" for k in (targets_key, saved_key))
        return {"lora_rank": rank, "lora_targets": targets, "lora_dropout": dropout, "lora_dora": dora,
                "lora_modules_to_save": saved, "lora_keys": keys}

    def _modules_to_save(self) -> tuple[str, str, str | None]:
        """The modules the run trains whole beside its adapters (PEFT's `modules_to_save`), names
        joined by commas, the words saying whence, and the key that names them; nothing where
        the file names none."""
        key = next((k for k in ("additional_target", "lora_modules_to_save", "modules_to_save")
                    if self.top.get(k) not in (None, [], "")), None)
        if key is not None:
            names = self._names(key) or ""
            return names, f"{key}: {names}", key
        if self.llamafactory:
            # new tokens make LlamaFactory resize the vocabulary whatever resize_vocab says (its `patch_tokenizer`)
            key = next((k for k in ("resize_vocab", *NEW_TOKEN_KEYS) if self.top.get(k) not in (None, False, "")), None)
            if key is not None:
                return (EMBEDDINGS, f"{key}: {_show(self.top[key])}, with which LlamaFactory trains the embeddings whole",
                        None)
        return "", "", None

    def _names(self, key: str) -> str | None:
        value = self.top.get(key)
        if isinstance(value, str) and value.strip():
            return value
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return ",".join(value)
        self.problems.append(Problem(self.path, key, f"expected module names (a list, or names joined by commas), "
                                     f"got {_show(value)}"))
        return None

    def _typed(self, key: str, kind: type) -> Any:
        value = self.top[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
            return value
        self.problems.append(Problem(self.path, key, f"expected {_KIND_WORDS[kind]}, got {_show(value)}"))
        return None

    def raise_problems(self) -> None:
        if self.problems:
            raise ConfigError(self.problems)


_KIND_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _number(value: Any) -> float | None:
    """A number as TRL's argument parser reads one: `0.04`, `0`, or YAML's string `1e-3`."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _show(value: Any) -> str:
    return "true" if value is True else "false" if value is False else str(value)
