"""A launch command as the run it starts (`launch_command.py`): what `estimate -- COMMAND`
reads from each launcher's command line, nothing started. The estimate's figures from it are
tested in tests/test_estimate.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_offload_cfg.config import ConfigError
from fsdp_offload_cfg.launch_command import read_launch_command


def test_accelerate_launch_gives_its_file_processes_typed_flags_and_the_scripts_arguments(tmp_path: Path):
    """The launcher's flags by accelerate's own parser (its `--cpu` is a switch, its
    `--fsdp_activation_checkpointing` takes a value); everything after the script is the script's."""
    launch = read_launch_command(
        ["accelerate", "launch", "--config_file", "fsdp.yaml", "--num_processes", "4", "--mixed_precision", "bf16",
         "--cpu", "--fsdp_activation_checkpointing", "true", "train.py", "--model_name_or_path", "m",
         "--max_length=4096", "--per_device_train_batch_size", "2", "--bf16", "--lora_target_modules", "q_proj",
         "v_proj", "--lora_dropout", "0.05", "--num_processes", "9"], str(tmp_path))
    assert (launch.config_file, launch.num_processes, launch.run_file) == (str(tmp_path / "fsdp.yaml"), 4, None)
    assert sorted(launch.overrides) == ["fsdp_config.activation_checkpointing=true", "mixed_precision=bf16",
                                        "use_cpu=true"]
    assert launch.arguments == {"model_name_or_path": "m", "max_length": 4096, "per_device_train_batch_size": 2,
                                "bf16": True, "lora_target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.05,
                                "num_processes": 9}  # the script's own flag, not the launcher's
    assert launch.arguments_from == "the command line" and launch.cli is None


def test_a_training_arguments_file_then_the_command_line_over_it(tmp_path: Path):
    """LlamaFactory's `train F key=value`, a YAML given to the script under accelerate launch,
    axolotl's `train F --key value`: the file's keys, the command line's over them."""
    (tmp_path / "sft.yaml").write_text("model_name_or_path: m\ncutoff_len: 2048\nbf16: true\n")
    for command, expected_file in [
        (["llamafactory-cli", "train", "sft.yaml", "cutoff_len=4096"], "sft.yaml"),
        (["accelerate", "launch", "--config_file", "f.yaml", "src/train.py", "sft.yaml", "--cutoff_len", "4096"], "sft.yaml"),
        (["axolotl", "train", "sft.yaml", "--cutoff_len=4096"], "sft.yaml"),
        (["python", "-m", "llamafactory.launcher", "sft.yaml", "cutoff_len=4096"], "sft.yaml"),
    ]:
        launch = read_launch_command(command, str(tmp_path))
        assert launch.run_file == str(tmp_path / expected_file), command
        assert launch.arguments == {"model_name_or_path": "m", "cutoff_len": 4096, "bf16": True}, command
        assert launch.arguments_from == f"{tmp_path / 'sft.yaml'} and the command line"
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"list\.yaml: expected a mapping at the top level"):
        read_launch_command(["axolotl", "train", "list.yaml"], str(tmp_path))


def test_trl_takes_its_config_yaml_its_verb_and_the_launch_keys_in_either(tmp_path: Path):
    """`trl sft --config sft.yaml`: the YAML's keys, the command line's over them; its
    `accelerate_config` and `num_processes` are the launch's (TRL hands them to accelerate)."""
    (tmp_path / "sft.yaml").write_text("model_name_or_path: m\nmax_length: 512\naccelerate_config: fsdp.yaml\n"
                                       "num_processes: 8\n")
    launch = read_launch_command(["trl", "sft", "--config", "sft.yaml", "--max_length", "2048"], str(tmp_path))
    assert (launch.cli, launch.config_file, launch.num_processes) == ("trl sft", str(tmp_path / "fsdp.yaml"), 8)
    assert (launch.arguments["max_length"], launch.arguments["model_name_or_path"]) == (2048, "m")
    cli = read_launch_command(["python", "-m", "trl", "dpo", "--config", "sft.yaml", "--accelerate_config", "cli.yaml",
                               "--num_processes", "2"], str(tmp_path))
    assert (cli.cli, cli.config_file, cli.num_processes) == ("trl dpo", str(tmp_path / "cli.yaml"), 2)


def test_torchrun_and_a_bare_script_read_no_config(tmp_path: Path):
    run = read_launch_command(["torchrun", "--nnodes", "2", "--nproc_per_node=4", "train.py", "--max_length", "8"],
                              str(tmp_path))
    assert (run.config_file, run.num_processes, run.arguments) == (None, 8, {"max_length": 8})
    assert read_launch_command(["torchrun", "--nproc_per_node", "gpu", "t.py"], str(tmp_path)).num_processes is None
    bare = read_launch_command(["python", "train.py", "--model_name_or_path", "m", "--gradient_checkpointing"],
                               str(tmp_path))
    assert (bare.config_file, bare.num_processes, bare.arguments) == \
        (None, None, {"model_name_or_path": "m", "gradient_checkpointing": True})


def test_a_command_line_accelerate_refuses_is_refused(tmp_path: Path):
    with pytest.raises(ConfigError, match="accelerate launch refuses this command line"):
        read_launch_command(["accelerate", "launch", "--num_processes", "four", "train.py"], str(tmp_path))


def test_ms_swift_takes_its_fsdp_json_and_its_processes_from_the_environment(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch):
    """`NPROC_PER_NODE=4 NNODES=2 swift sft --fsdp fsdp.json ...`: ms-swift starts torchrun with
    those; its `--fsdp` JSON (the Trainer's layout) is the config."""
    (tmp_path / "fsdp.json").write_text('{"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_version": 2}}')
    monkeypatch.setenv("NPROC_PER_NODE", "4")
    monkeypatch.setenv("NNODES", "2")
    launch = read_launch_command(["swift", "sft", "--model", "m", "--fsdp", "fsdp.json", "--dataset", "d.json",
                                  "--lora_rank", "16"], str(tmp_path))
    assert (launch.cli, launch.config_file, launch.num_processes, launch.run_file) == \
        ("swift sft", str(tmp_path / "fsdp.json"), 8, None)
    assert launch.arguments == {"model": "m", "fsdp": "fsdp.json", "dataset": "d.json", "lora_rank": 16}
    monkeypatch.delenv("NPROC_PER_NODE")  # torchrun's default: one a node
    assert read_launch_command(["swift", "sft", "--model", "m"], str(tmp_path)).num_processes == 2


def test_ms_swift_without_its_variables_runs_one_process_and_its_yaml_env_gives_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Without NPROC_PER_NODE or NNODES ms-swift runs its script in one process, not torchrun (the
    estimate had asked for --num-processes); `swift sft run.yaml` takes those its YAML's `ENV:`
    section gives, the environment's winning (`swift/cli/main.py`)."""
    monkeypatch.delenv("NPROC_PER_NODE", raising=False)
    monkeypatch.delenv("NNODES", raising=False)
    assert read_launch_command(["swift", "sft", "--model", "m"], str(tmp_path)).num_processes == 1
    (tmp_path / "run.yaml").write_text("model: m\nfsdp: fsdp2\nENV:\n  NPROC_PER_NODE: 4\n  NNODES: 2\n")
    assert read_launch_command(["swift", "sft", "run.yaml"], str(tmp_path)).num_processes == 8
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    assert read_launch_command(["swift", "sft", "run.yaml"], str(tmp_path)).num_processes == 4


def test_trl_passes_accelerates_config_flags_from_its_yaml_and_its_command_line(tmp_path: Path):
    """TRL hands accelerate's launcher what its dataclasses do not take, from its YAML and its
    command line: accelerate's config flags among them count over the config file (they were
    dropped); a TrainingArguments name (`debug`) stays the Trainer's."""
    (tmp_path / "sft.yaml").write_text("model_name_or_path: m\nfsdp_activation_checkpointing: true\n"
                                       "mixed_precision: fp16\ndebug: underflow_overflow\n")
    launch = read_launch_command(["trl", "sft", "--config", "sft.yaml", "--fsdp_reshard_after_forward", "false",
                                  "--num_processes", "4"], str(tmp_path))
    assert sorted(launch.overrides) == ["fsdp_config.activation_checkpointing=true",
                                        "fsdp_config.reshard_after_forward=false", "mixed_precision=fp16"]
    assert launch.num_processes == 4


def test_axolotl_takes_its_processes_from_its_option_or_its_launchers_arguments(tmp_path: Path):
    """`axolotl train cfg.yml --num-processes 4` (or `-- --num_processes 8` for accelerate, its
    default launcher; `--launcher torchrun -- --nproc_per_node 2 --nnodes 2`; `--launcher python`,
    one process): axolotl starts its launcher with those. The estimate had asked for
    --num-processes, and read the `--` as a flag of the run."""
    (tmp_path / "cfg.yml").write_text("base_model: m\nsequence_len: 512\nfsdp_version: 2\nfsdp_config:\n"
                                      "  reshard_after_forward: true\n")
    for args, processes in ((["--num-processes", "4"], 4), (["--", "--num_processes", "8"], 8),
                            (["--launcher", "torchrun", "--", "--nproc_per_node", "2", "--nnodes", "2"], 4),
                            (["--launcher", "python"], 1), ([], None)):
        launch = read_launch_command(["axolotl", "train", "cfg.yml", *args], str(tmp_path))
        assert (launch.run_file, launch.num_processes) == (str(tmp_path / "cfg.yml"), processes), args
        assert "" not in launch.arguments and launch.arguments["sequence_len"] == 512


def test_the_machines_are_accelerates_num_machines_or_torchruns_nnodes(tmp_path: Path):
    """FSDP1's HYBRID_SHARD copies across machines: `accelerate launch --num_machines` (by
    accelerate's own parser) and torchrun's `--nnodes` say how many; none where neither is given."""
    assert read_launch_command(["accelerate", "launch", "--num_machines", "2", "--num_processes", "16", "train.py",
                                "--num_machines", "9"], str(tmp_path)).num_machines == 2  # the script's is its own
    assert read_launch_command(["torchrun", "--nnodes", "2", "--nproc_per_node", "8", "train.py"],
                               str(tmp_path)).num_machines == 2
    assert read_launch_command(["accelerate", "launch", "train.py"], str(tmp_path)).num_machines is None


def test_trls_own_scripts_are_read_as_the_trl_verb_that_runs_them(tmp_path: Path):
    """`trl dpo` launches `trl/scripts/dpo.py`; the same script under `accelerate launch`, torchrun
    or python (TRL's scripts document `python trl/scripts/dpo.py`), by path or as the module
    `trl.scripts.dpo`, is the same run with the same defaults and reference model. Before, it was
    read as a script of the user's own: no reference model, one sequence a DPO sample."""
    for command in (
        ["accelerate", "launch", "--config_file", "f.yaml", "trl/scripts/dpo.py", "--max_length", "8"],
        ["accelerate", "launch", "--num_processes", "2", "-m", "trl.scripts.dpo", "--max_length", "8"],
        ["accelerate", "launch", "--module", "trl.scripts.dpo", "--max_length", "8"],
        ["python", "-m", "accelerate.commands.launch", "/venv/lib/python3.12/site-packages/trl/scripts/dpo.py",
         "--max_length", "8"],
        ["torchrun", "--nproc_per_node", "2", "-m", "trl.scripts.dpo", "--max_length", "8"],
        ["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "trl/scripts/dpo.py", "--max_length", "8"],
        ["python", "trl/scripts/dpo.py", "--max_length", "8"],
        ["python", "-m", "trl.scripts.dpo", "--max_length", "8"],
    ):
        launch = read_launch_command(command, str(tmp_path))
        assert (launch.cli, launch.arguments) == ("trl dpo", {"max_length": 8}), command
    for own in (["accelerate", "launch", "scripts/dpo.py"], ["python", "examples/scripts/dpo_vlm.py"],
                ["torchrun", "-m", "trl.scripts.vllm_serve"], ["python", "trl/scripts/utils.py"]):
        assert read_launch_command(own, str(tmp_path)).cli is None, own


def test_llamafactory_cli_takes_its_processes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`NPROC_PER_NODE=4 NNODES=2 llamafactory-cli train sft.yaml`: LlamaFactory starts torchrun with
    those; without NPROC_PER_NODE it starts one process per GPU of the machine it runs on, which
    the estimate does not see: the number stays unknown (the estimate asks for it). Before, the
    environment's count was not read."""
    (tmp_path / "sft.yaml").write_text("model_name_or_path: m\ncutoff_len: 2048\n")
    monkeypatch.setenv("NPROC_PER_NODE", "4")
    monkeypatch.setenv("NNODES", "2")
    for cli in ("llamafactory-cli", "lmf"):
        launch = read_launch_command([cli, "train", "sft.yaml", "cutoff_len=4096"], str(tmp_path))
        assert (launch.num_processes, launch.num_machines, launch.arguments["cutoff_len"]) == (8, 2, 4096), cli
    monkeypatch.delenv("NNODES")
    assert read_launch_command(["llamafactory-cli", "train", "sft.yaml"], str(tmp_path)).num_processes == 4
    monkeypatch.delenv("NPROC_PER_NODE")
    assert read_launch_command(["llamafactory-cli", "train", "sft.yaml"], str(tmp_path)).num_processes is None


SCRIPTS = {
    "from trl import SFTConfig, SFTTrainer\ntrainer = SFTTrainer(model=m, args=SFTConfig())\ntrainer.train()\n":
        "SFTTrainer",
    "from trl import DPOTrainer as Trainer\nTrainer(model)\n": "DPOTrainer",
    "import trl\ntrl.GRPOTrainer(model)\n": "GRPOTrainer",
    "import trl.trainer as tt\ntt.KTOTrainer(model)\n": "KTOTrainer",
    "from trl import SFTTrainer\nclass Mine(SFTTrainer):\n    pass\nclass Ours(Mine):\n    pass\nOurs(model)\n":
        "SFTTrainer",
    "from trl.trainer.distillation_trainer import DistillationTrainer\nDistillationTrainer(model)\n":
        "DistillationTrainer",
    # imported, never built: the Trainer runs
    "from trl import SFTTrainer\nfrom transformers import Trainer\nTrainer(model)\n": None,
    "from mylib import SFTTrainer\nSFTTrainer(model)\n": None,  # not TRL's
    "def broken(:\n": None,
}


@pytest.mark.parametrize("source", list(SCRIPTS), ids=range(len(SCRIPTS)))
def test_a_script_of_the_users_own_names_the_trl_trainer_it_builds(tmp_path: Path, source: str):
    """A script of the user's own that builds one of TRL's trainers runs TRL's loss (its fused LM
    head, no logits); read from the script's source, under each launcher. TRL's own scripts are
    their verbs (`cli`), not this."""
    (tmp_path / "train.py").write_text(source)
    for command in (["accelerate", "launch", "--config_file", "f.yaml", "train.py", "--max_length", "8"],
                    ["torchrun", "--nproc_per_node", "2", "train.py"], ["python", "train.py"]):
        launch = read_launch_command(command, str(tmp_path))
        trainer = launch.script_trl.trainer if launch.script_trl else None
        assert (launch.cli, trainer) == (None, SCRIPTS[source]), command
    assert read_launch_command(["python", "trl/scripts/sft.py"], str(tmp_path)).script_trl is None
    assert read_launch_command(["python", "gone.py"], str(tmp_path)).script_trl is None


# TRL's quickstart, everything in the code; what the estimate reads of it
QUICKSTART = """\
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM
from trl import SFTConfig, SFTTrainer

model_id = "Qwen/Qwen2.5-0.5B"
model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.bfloat16)
args = SFTConfig(output_dir="out", max_length=2048, per_device_train_batch_size=2, learning_rate=lr,
                 model_init_kwargs={"attn_implementation": "sdpa"})
trainer = SFTTrainer(model=model, args=args, train_dataset=data,
                     peft_config=LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
trainer.train()
"""
TRL_SCRIPTS_READ = {
    QUICKSTART: ("SFTConfig", "its args= SFTConfig(...)", {
        "output_dir": "out", "max_length": 2048, "per_device_train_batch_size": 2,
        "model_init_kwargs": {"attn_implementation": "sdpa"}, "model_name_or_path": "Qwen/Qwen2.5-0.5B",
        "dtype": "bfloat16", "use_peft": True, "lora_r": 16, "lora_dropout": 0.0,
        "lora_target_modules": ["q_proj", "v_proj"], "use_dora": False}, ("learning_rate",), False),
    # DoRA and modules trained whole: PEFT's use_dora and modules_to_save, read as TRL's ModelConfig keys
    ("from peft import LoraConfig\nimport trl\n"
     "trl.SFTTrainer('m', peft_config=LoraConfig(r=4, use_dora=True, modules_to_save=['lm_head']))\n"):
        ("SFTConfig", "no args=: SFTTrainer builds its own SFTConfig", {
            "model_name_or_path": "m", "use_peft": True, "lora_r": 4, "lora_dropout": 0.0, "use_dora": True,
            "lora_modules_to_save": ["lm_head"]}, (), False),
    # no args=: the trainer builds its own config; a model by name
    "import trl\ntrl.DPOTrainer('m', train_dataset=d)\n":
        ("DPOConfig", "no args=: DPOTrainer builds its own DPOConfig", {"model_name_or_path": "m"}, (), False),
    # TRL's script pattern: a parser of TRL's config and ModelConfig, everything from the command line
    ("from trl import GRPOConfig, GRPOTrainer, ModelConfig, TrlParser\n"
     "training_args, model_args = TrlParser((GRPOConfig, ModelConfig)).parse_args_and_config()\n"
     "GRPOTrainer(model=model_args.model_name_or_path, args=training_args, peft_config=get_peft_config(model_args))\n"):
        ("GRPOConfig", "the script names GRPOConfig", {}, ("model", "peft_config"), True),
    # the Trainer's arguments, which TRL converts keeping their values
    ("from transformers import TrainingArguments\nfrom trl import SFTTrainer as T\n"
     "T('m', args=TrainingArguments(output_dir='o', bf16=True, **extra))\n"):
        ("TrainingArguments", "its args= TrainingArguments(...)", {"output_dir": "o", "bf16": True,
                                                                   "model_name_or_path": "m"}, ("**extra",), False),
    # GRPO's reward models are the strings among its reward_funcs (a function is none)
    ("from trl import GRPOTrainer\nrm = 'rm-b'\ndef length(completions, **kw):\n    return [0.0]\n"
     "GRPOTrainer('m', ['rm-a', length, rm])\n"):
        ("GRPOConfig", "no args=: GRPOTrainer builds its own GRPOConfig",
         {"model_name_or_path": "m", "reward_model_name_or_path": ["rm-a", "rm-b"]}, (), False),
    # TRL's examples: a LoraConfig of ModelConfig's values, kept for the command line's (ModelConfig's defaults);
    # a name assigned twice has no one value; torch's dtypes are literals; peft_config=None is no LoRA
    ("import torch\nfrom peft import LoraConfig\nfrom trl import ModelConfig, SFTConfig, SFTTrainer\n"
     "model_args = ModelConfig()\ncfg = LoraConfig(r=model_args.lora_r, lora_dropout=model_args.lora_dropout)\n"
     "model = AutoModel.from_pretrained('a')\nmodel = other(model)\n"
     "SFTTrainer(model, args=SFTConfig(model_init_kwargs={'dtype': torch.bfloat16}), peft_config=cfg)\n"):
        ("SFTConfig", "its args= SFTConfig(...)", {"model_init_kwargs": {"dtype": "bfloat16"}, "use_peft": True,
                                                   "use_dora": False},
         ("model", "LoraConfig.r", "LoraConfig.lora_dropout"), True),
    ("import torch as t\nimport trl\nfrom transformers import AutoModelForCausalLM\n"
     "m = AutoModelForCausalLM.from_pretrained('a', torch_dtype=t.float16)\n"
     "trl.SFTTrainer(m, args=trl.SFTConfig(model_init_kwargs={'dtype': t.bfloat16}), peft_config=None)\n"):
        ("SFTConfig", "its args= SFTConfig(...)", {"model_init_kwargs": {"dtype": "bfloat16"}, "model_name_or_path": "a",
                                                   "dtype": "float16"}, (), False),
    # a distillation teacher loaded by name
    ("from transformers import AutoModelForCausalLM as A\nfrom trl import DistillationTrainer\n"
     "DistillationTrainer('s', A.from_pretrained('t', torch_dtype='bfloat16'), args=cfg)\n"):
        ("DistillationConfig", "its args= cannot be told from the source: DistillationConfig assumed",
         {"model_name_or_path": "s", "teacher_model_name_or_path": "t",
          "teacher_model_init_kwargs": {"dtype": "bfloat16"}}, (), False),
}


@pytest.mark.parametrize("source", list(TRL_SCRIPTS_READ), ids=range(len(TRL_SCRIPTS_READ)))
def test_a_trl_script_of_the_users_own_is_read_for_its_arguments(tmp_path: Path, source: str):
    """Whose defaults hold (TRL's config's, or the Trainer's it converts), and the values the
    source states as literals: the config's keywords, the model and its dtype, a LoraConfig with
    PEFT's defaults (r 8, dropout 0) where it says nothing; what is not a literal, by name."""
    from fsdp_offload_cfg.config.trl_script import read_trl_script

    (tmp_path / "train.py").write_text(source)
    read = read_trl_script("train.py", str(tmp_path))
    config, config_from, arguments, unread, model_config = TRL_SCRIPTS_READ[source]
    assert (read.config, read.config_from, read.arguments, read.unread, read.model_config) == \
        (config, config_from, arguments, unread, model_config)
    assert read.trl_defaults == (config != "TrainingArguments")


def test_a_trl_scripts_literals_win_over_the_command_line(tmp_path: Path):
    """Code over the command line over the run file, as accelerate orders what the user typed."""
    (tmp_path / "train.py").write_text(QUICKSTART)
    (tmp_path / "run.yaml").write_text("max_length: 512\nnum_train_epochs: 3\n")
    launch = read_launch_command(["accelerate", "launch", "train.py", "run.yaml", "--max_length", "1024",
                                  "--per_device_train_batch_size", "4", "--seed", "7"], str(tmp_path))
    assert {k: launch.arguments[k] for k in ("max_length", "per_device_train_batch_size", "num_train_epochs", "seed")} \
        == {"max_length": 2048, "per_device_train_batch_size": 2, "num_train_epochs": 3, "seed": 7}
    assert launch.arguments_from == f"{tmp_path / 'run.yaml'} and the command line and train.py"


def test_the_dtype_trl_loads_a_model_given_by_name_in_is_the_installed_trls():
    """`named_model_dtype` against the installed TRL's own `create_model_from_path`: float32 where
    its `dtype` defaults so (0.27 on), the checkpoint's own (None) where it passes "auto" or
    nothing (0.24-0.26, read from their wheels)."""
    import inspect

    from fsdp_offload_cfg.config.trl_defaults import named_model_dtype

    trl_utils = pytest.importorskip("trl.trainer.utils")
    source = inspect.getsource(trl_utils.create_model_from_path)
    assert (named_model_dtype() == "float32") == ('kwargs.get("dtype", "float32")' in source)


def test_grpos_vllm_mode_unset_is_the_installed_trls():
    """`trl_defaults.vllm_mode` against the installed TRL's GRPOConfig and RLOOConfig: colocate
    from 1.0, server before (0.24-0.29, read from their wheels)."""
    import dataclasses

    from fsdp_offload_cfg.config.trl_defaults import vllm_mode

    trl = pytest.importorskip("trl")
    for config in (trl.GRPOConfig, trl.RLOOConfig):
        assert {f.name: f.default for f in dataclasses.fields(config)}["vllm_mode"] == vllm_mode(), config


def test_a_module_of_the_project_run_with_m_is_read_as_its_file(tmp_path: Path):
    """`accelerate launch -m mypkg.train`, `python -m mypkg` (its `__main__.py`): the module's file in
    the project is read as a `.py` script is; an installed module is not the user's source."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "train.py").write_text("from trl import SFTTrainer\nSFTTrainer('m')\n")
    (tmp_path / "mypkg" / "__main__.py").write_text("import trl\ntrl.DPOTrainer('m')\n")
    found = {tuple(command): read_launch_command(command, str(tmp_path)).script_trl
             for command in (["accelerate", "launch", "-m", "mypkg.train"], ["python", "-m", "mypkg"],
                             ["torchrun", "--nproc_per_node", "2", "-m", "mypkg.train"], ["python", "-m", "json.tool"])}
    assert [(s.script, s.trainer) if s else None for s in found.values()] == [
        (str(Path("mypkg", "train.py")), "SFTTrainer"), (str(Path("mypkg", "__main__.py")), "DPOTrainer"),
        (str(Path("mypkg", "train.py")), "SFTTrainer"), None]
