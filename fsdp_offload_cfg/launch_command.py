"""A launch command as the run it starts: `fsdp-offload-cfg estimate -- COMMAND`.

Users size a run by the command they are about to type, not by a config file alone: a TRL
recipe (`trl sft --config sft.yaml`) or a LlamaFactory YAML under `accelerate launch` holds the
run's model, length and adapters but no FSDP settings, and the accelerate file holds those but
no model. Read together, as the launch reads them, they are the run. Nothing is started.

What is read, each as the launcher itself reads it:
- the accelerate config: `accelerate launch --config_file F` (else accelerate's default file),
  TRL's `--accelerate_config F` or its `--config` YAML's `accelerate_config`
  (`discovery.launch_config_file`, the rule the workers follow), ms-swift's `--fsdp F`; with
  none, the run's own file where it holds FSDP settings (axolotl's YAML, a Trainer's file);
- the config flags typed on `accelerate launch` (`--mixed_precision`, `--fsdp_*`, `--cpu`), parsed
  by accelerate's own parser, over the file, as accelerate exports them; its `--num_processes`,
  torchrun's `--nproc_per_node` times `--nnodes`, ms-swift's and `llamafactory-cli train`'s
  `NPROC_PER_NODE` times `NNODES`,
  axolotl's `--num-processes` or its launcher's arguments after `--`;
- the training arguments after the script (or `trl VERB`, `swift sft`, `llamafactory-cli train`,
  `axolotl train`): the YAML or JSON file they name (TRL's `--config F`, else the first
  `.yaml` / `.yml` / `.json` argument: LlamaFactory's, axolotl's, HfArgumentParser's), then
  `--key value`, `--key=value`, a bare `--flag` (true), `--key v1 v2` (a list) and `key=value`
  (LlamaFactory's overrides) over that file, as HfArgumentParser, TRL and LlamaFactory let the
  command line win.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_offload_cfg.config.model import ConfigError
from fsdp_offload_cfg.config.reading import read_config_file
from fsdp_offload_cfg.config.trl_script import TrlScript, read_trl_script
from fsdp_offload_cfg.discovery import dotted_key, is_trl_cli, launch_config_file, launch_flag_keys, typed_launch_flags

RUN_FILE_SUFFIXES = (".yaml", ".yml", ".json")
TRL_SCRIPTS = ("distillation", "dpo", "grpo", "kto", "reward", "rloo", "sft")  # trl/scripts/VERB.py, run by `trl VERB`
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch")
FRAMEWORK_VERBS = {"llamafactory-cli": "train", "lmf": "train", "axolotl": "train"}  # their training verb: the file follows it


@dataclass(frozen=True)
class LaunchCommand:
    """What COMMAND says of its run; None where it says nothing."""

    command: tuple[str, ...]
    config_file: str | None = None  # the accelerate config its launcher reads
    run_file: str | None = None  # the training arguments' file (TRL's --config, a LlamaFactory YAML)
    num_processes: int | None = None
    overrides: tuple[str, ...] = ()  # the launcher's typed config flags, as `--set KEY=VALUE` items
    arguments: dict[str, Any] = field(default_factory=dict)  # the training arguments: the file's, the flags' over them
    cli: str | None = None  # the framework's CLI and verb that run it, `trl sft`, `swift sft`: its defaults hold
    num_machines: int | None = None  # `accelerate launch --num_machines`, torchrun's `--nnodes`
    arguments_from: str = ""  # in words, for the estimate to say: `sft.yaml and the command line`
    script_trl: TrlScript | None = None  # the TRL run a script of the user's own builds (`config/trl_script.py`)


def read_launch_command(command: list[str], cwd: str) -> LaunchCommand:
    """COMMAND's config file, processes, launch flags and training arguments (module docstring)."""
    is_launcher, named = launch_config_file(command, cwd)
    config_file = str(named) if named is not None else None
    if is_launcher and not is_trl_cli(command):
        script_args, launched = _accelerate_launch(command)
        return _with_arguments(command, script_args, cwd, config_file=config_file, **_the_script(command, cwd),
                               **launched)
    if is_launcher:  # TRL's CLI: `trl VERB ARGS`; launch flags (`--num_processes`) mixed in, or in its --config YAML
        verb_at = _trl_verb_at(command)
        found = _with_arguments(command, command[verb_at + 1:], cwd, config_file=config_file,
                                cli=f"trl {command[verb_at]}")
        processes = found.arguments.get("num_processes")
        return dataclasses.replace(found, overrides=_trl_launch_overrides(found.arguments),
                                   num_processes=processes if isinstance(processes, int) else None)
    if (verb_at := _verb_at(command, "swift", ("sft", "pt", "rlhf"))) is not None:
        return _swift(command, verb_at, cwd)
    if (verb_at := _verb_at(command, "axolotl", ("train",))) is not None:
        return _axolotl(command, verb_at, cwd)
    if any(_verb_at(command, cli, ("train",)) is not None for cli in ("llamafactory-cli", "lmf")):
        return _llamafactory(command, cwd)
    if _is_torchrun(command):
        script_args, launched = _torchrun(command)
        return _with_arguments(command, script_args, cwd, **_the_script(command, cwd), **launched)
    return _with_arguments(command, _script_args(command), cwd, **_the_script(command, cwd))


def _the_script(command: list[str], cwd: str) -> dict[str, Any]:
    """What COMMAND's script says of the run: `cli`, the TRL verb whose own script it is; else
    `script_trl`, the TRL run a script of the user's own builds (`read_trl_script`)."""
    cli = _trl_script_cli(command)
    at = _script_at(command)
    own = _own_file(command[at], cwd) if cli is None and at is not None else None
    return {"cli": cli, "script_trl": read_trl_script(own, cwd) if own else None}


def _own_file(script: str, cwd: str) -> str | None:
    """The source file of a script of the user's own: a `.py` path as given, or a module run with
    `-m` that lies in the project (`mypkg.train`: `mypkg/train.py`, a package's `__main__.py`),
    where `python -m` finds it first; None for an installed module (a framework's)."""
    if script.endswith(".py"):
        return script
    base = Path(*script.split("."))
    return next((str(f) for f in (base.with_suffix(".py"), base / "__main__.py") if Path(cwd, f).is_file()), None)


def _trl_script_cli(command: list[str]) -> str | None:
    """`trl dpo` where COMMAND runs the script `trl dpo` launches: `trl/scripts/dpo.py` (TRL's
    repository, or its installed package: TRL's scripts document `python trl/scripts/dpo.py`, and
    `accelerate launch` or torchrun of it is how they are spread over ranks) or the module
    `trl.scripts.dpo`. Same parser, same defaults (bf16, checkpointing, ModelConfig's float32), same
    reference model: the run is `trl dpo`'s and is read so. None for any other script."""
    at = _script_at(command)
    if at is None:
        return None
    script = command[at]
    if script.endswith(".py"):
        path = Path(script)
        verb = path.stem if path.parent.parts[-2:] == ("trl", "scripts") else None
    else:
        package, _, verb = script.rpartition(".")
        verb = verb if package == "trl.scripts" else None
    return f"trl {verb}" if verb in TRL_SCRIPTS else None


def _script_at(command: list[str]) -> int | None:
    """Where the script is: the first `.py` argument after the program, or the module after
    `-m` / `--module` (python's, accelerate launch's, torchrun's); a launcher's own module
    (`python -m torch.distributed.run`) is the launcher, not the script."""
    for i, arg in enumerate(command[1:], start=1):
        if arg.endswith(".py"):
            return i
        if arg in ("-m", "--module") and i + 1 < len(command) and command[i + 1] not in LAUNCHER_MODULES:
            return i + 1
    return None


def _with_arguments(command: list[str], script_args: list[str], cwd: str, **found: Any) -> LaunchCommand:
    """The training arguments: the run file's, the command line's over them, and those a script
    of the user's own states in its code over both (code wins, as in accelerate's order)."""
    run_file, items = _run_file(script_args, cwd)
    arguments = dict(read_config_file(run_file)) if run_file is not None else {}  # a mapping, or ConfigError
    flags = _flags(items)
    arguments.update(flags)
    script = found.get("script_trl")
    coded = script.arguments if script is not None else {}
    arguments.update(coded)
    in_code = script.script if coded else None
    arguments_from = " and ".join(filter(None, (run_file, "the command line" if flags else None, in_code)))
    return LaunchCommand(tuple(command), run_file=run_file, arguments=arguments, arguments_from=arguments_from, **found)


def _accelerate_launch(command: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The script's arguments, and `--num_processes`, `--num_machines` and the typed config flags
    (as `LaunchCommand` fields), by accelerate's own parser (a command line it refuses is refused
    here, with its message)."""
    from accelerate.commands.launch import launch_command_parser

    start = next(i for i, arg in enumerate(command) if arg == "launch" or arg.endswith(
        ("accelerate-launch", "accelerate.commands.launch", "launch.py"))) + 1
    try:
        parsed = launch_command_parser().parse_args(command[start:])
    except SystemExit:  # argparse said why on stderr
        raise ConfigError("fsdp-offload-cfg estimate: accelerate launch refuses this command line (above)") from None
    overrides = tuple(f"{dotted_key(key)}={_text(getattr(parsed, name))}"
                      for name, key in typed_launch_flags(command).items()
                      if key != "num_processes" and getattr(parsed, name, None) is not None)
    return list(parsed.training_script_args), {"num_processes": parsed.num_processes,
                                               "num_machines": parsed.num_machines, "overrides": overrides}


def _trl_launch_overrides(arguments: dict[str, Any]) -> tuple[str, ...]:
    """TRL hands accelerate's launcher every argument its dataclasses do not take, its YAML's and
    its command line's (`trl/cli/commands/training.py`): accelerate's config flags among them
    (`--fsdp_reshard_after_forward false`, `mixed_precision: fp16`) count over the config file as
    under `accelerate launch`. A TrainingArguments name (`debug`) is the Trainer's, not passed on."""
    from accelerate.commands.launch import launch_command_parser
    from transformers import TrainingArguments

    known = {action.dest for action in launch_command_parser()._actions}
    trainers = {f.name for f in dataclasses.fields(TrainingArguments)}
    return tuple(f"{dotted_key(key)}={_text(arguments[name])}" for name, key in launch_flag_keys().items()
                 if name in arguments and name in known and name not in trainers and key != "num_processes")


def _verb_at(command: list[str], program: str, verbs: tuple[str, ...]) -> int | None:
    """Where the verb of `program VERB` (`swift sft`, `axolotl train`) is; None for any other command."""
    at = next((i for i, arg in enumerate(command[:3]) if os.path.basename(arg) == program), None)
    return at + 1 if at is not None and at + 1 < len(command) and command[at + 1] in verbs else None


def _swift(command: list[str], verb_at: int, cwd: str) -> LaunchCommand:
    """`swift sft ARGS`: its config is `--fsdp F` (a JSON in the Trainer's layout, or the name of
    one ms-swift ships: `fsdp2`), its processes `NPROC_PER_NODE` times `NNODES` (`_swift_processes`)."""
    found = _with_arguments(command, command[verb_at + 1:], cwd, cli=f"swift {command[verb_at]}")
    fsdp = found.arguments.get("fsdp")
    config = _swift_config_path(str(fsdp), cwd) if isinstance(fsdp, str) else None
    return dataclasses.replace(found, config_file=config, num_processes=_swift_processes(found.arguments))


def _swift_processes(arguments: dict[str, Any]) -> int | None:
    """ms-swift starts torchrun with `NPROC_PER_NODE` and `NNODES` from the environment, where its
    YAML's `ENV:` section gives those the environment lacks; with neither it runs the script in
    one process (`swift/cli/main.py`). None where a count is not a number (torchrun's `auto`)."""
    yaml_env = arguments.get("ENV") if isinstance(arguments.get("ENV"), dict) else {}
    environ = {**{str(k): str(v) for k, v in yaml_env.items()}, **os.environ}
    if "NPROC_PER_NODE" not in environ and "NNODES" not in environ:
        return 1
    return _nodes_times_processes(environ, "1")


def _nodes_times_processes(environ: Mapping[str, str], per_node_unset: str) -> int | None:
    """`NPROC_PER_NODE` (else `per_node_unset`) times `NNODES` (else 1), as a launcher hands them
    to torchrun; None where either is no number."""
    per_node, nodes = environ.get("NPROC_PER_NODE", per_node_unset), environ.get("NNODES", "1")
    return int(per_node) * int(nodes) if per_node.isdigit() and nodes.isdigit() else None


def _llamafactory(command: list[str], cwd: str) -> LaunchCommand:
    """`llamafactory-cli train F`: under `FORCE_TORCHRUN=1`, or on a machine with several GPUs, it
    starts torchrun with `NPROC_PER_NODE` (default: the GPUs of the machine it runs on, which the
    estimate cannot see) times `NNODES` processes (`llamafactory/launcher.py`). Those the
    environment names are counted; else the number is asked for."""
    found = _with_arguments(command, _script_args(command), cwd)
    processes = _nodes_times_processes(os.environ, "")
    if processes is None:
        return found
    return dataclasses.replace(found, num_processes=processes, num_machines=int(os.environ.get("NNODES", "1")))


def _axolotl(command: list[str], verb_at: int, cwd: str) -> LaunchCommand:
    """`axolotl train cfg.yml [OPTIONS] [-- LAUNCHER ARGS]`: its YAML is the run and its config;
    it starts `accelerate launch` (its default `--launcher`) with `--num_processes` from its
    `--num-processes` and the arguments after `--`, or `torchrun` with those, or one Python
    process (`axolotl/cli/utils/train.py`, 0.19)."""
    args = command[verb_at + 1:]
    own, launcher_args = (args[:args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args, [])
    found = _with_arguments(command, own, cwd)
    launcher, processes = found.arguments.get("launcher", "accelerate"), found.arguments.get("num_processes")
    if launcher == "python":
        return dataclasses.replace(found, num_processes=1)
    if launcher == "torchrun":
        _, launched = _torchrun(["torchrun", *launcher_args, "train.py"])
    else:  # its YAML, not the launcher's config flags, sets the run: only the counts are taken
        counted = ["--num_processes", str(processes)] if processes is not None else []
        _, launched = _accelerate_launch(["accelerate", "launch", *counted, *launcher_args, "train.py"])
    return dataclasses.replace(found, num_processes=launched["num_processes"], num_machines=launched["num_machines"])


def _swift_config_path(name: str, cwd: str) -> str:
    """ms-swift's `--fsdp`: a JSON path, else the name of one it ships (`swift/config/fsdp2.json`)."""
    path = _in(cwd, name)
    if os.path.isfile(path) or importlib.util.find_spec("swift") is None:
        return path
    from importlib import resources

    shipped = str(resources.files("swift").joinpath("config", f"{name}.json"))
    return shipped if os.path.isfile(shipped) else path


def _is_torchrun(command: list[str]) -> bool:
    return any(os.path.basename(arg) == "torchrun" or arg == "torch.distributed.run" for arg in command[:3])


def _torchrun(command: list[str]) -> tuple[list[str], dict[str, Any]]:
    """torchrun's script arguments, and its processes (`--nproc_per_node` times `--nnodes`) and
    nodes, as `LaunchCommand` fields."""
    script = _script_at(command)
    per_node, nodes = _int_flag(command, "nproc_per_node"), _int_flag(command, "nnodes")
    return (command[script + 1:] if script is not None else []), {
        "num_processes": per_node * (nodes or 1) if per_node else None, "num_machines": nodes}


def _trl_verb_at(command: list[str]) -> int:
    """Where the verb of `trl VERB` (or `python -m trl VERB`) is."""
    for i, arg in enumerate(command):
        if os.path.basename(arg) == "trl":
            return i + 1
        if arg == "-m" and i + 1 < len(command) and command[i + 1].startswith("trl"):
            return i + 2
    raise AssertionError("not a TRL command line")  # discovery.is_trl_cli said it was


def _script_args(command: list[str]) -> list[str]:
    """The arguments after the script: `python train.py ARGS`, `python -m pkg ARGS`,
    `llamafactory-cli train ARGS`, `axolotl train ARGS`, `./train.py ARGS`."""
    for i, arg in enumerate(command):
        if arg == "-m":
            return command[i + 2:]
        if arg.endswith(".py"):
            return command[i + 1:]
        if FRAMEWORK_VERBS.get(os.path.basename(arg)) in command[i + 1:i + 2]:
            return command[i + 2:]
    return command[1:]


def _run_file(args: list[str], cwd: str) -> tuple[str | None, list[str]]:
    """The training arguments' file (TRL's `--config F`, else the first YAML or JSON argument that
    is no flag's value) and the other arguments."""
    rest = list(args)
    if "--config" in rest[:-1]:
        at = rest.index("--config")
        path = rest[at + 1]
        del rest[at:at + 2]
        return _in(cwd, path), rest
    for i, arg in enumerate(rest):
        if arg.endswith(RUN_FILE_SUFFIXES) and not arg.startswith("-") and "=" not in arg and \
                (i == 0 or not rest[i - 1].startswith("--") or "=" in rest[i - 1]):
            return _in(cwd, arg), rest[:i] + rest[i + 1:]
    return None, rest


def _flags(items: list[str]) -> dict[str, Any]:
    """`--key value`, `--key=value`, `--flag` (true), `--key v1 v2` (a list), `key=value`, each
    value read as YAML reads a scalar (`8`, `true`, `0.05`, `bf16`)."""
    values: dict[str, Any] = {}
    i = 0
    while i < len(items):
        arg = items[i]
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if eq:
                values[name.replace("-", "_")] = _scalar(value)
                i += 1
                continue
            taken = []
            while i + 1 < len(items) and not items[i + 1].startswith("--"):
                taken.append(_scalar(items[i + 1]))
                i += 1
            values[name.replace("-", "_")] = True if not taken else taken[0] if len(taken) == 1 else taken
        elif "=" in arg and not arg.startswith("-"):
            name, _, value = arg.partition("=")
            values[name] = _scalar(value)
        i += 1
    return values


def _scalar(text: str) -> Any:
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, (str, int, float, bool)) else text


def _int_flag(command: list[str], name: str) -> int | None:
    """`--name N` or `--name=N` (dashes or underscores) as an integer; None where absent or not one."""
    for i, arg in enumerate(command):
        flag, eq, value = arg.partition("=")
        if flag.replace("-", "_") == f"__{name}":
            text = value if eq else (command[i + 1] if i + 1 < len(command) else "")
            return int(text) if text.isdigit() else None
    return None


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _in(cwd: str, path: str) -> str:
    return path if Path(path).is_absolute() else str(Path(cwd) / path)
