"""`fsdp-offload-cfg`: validate config files, print the schema, explain what a config turns on,
estimate memory, and run a command with the plugin on (`run`, `install-hook`).

Exit codes: 0 all valid; 1 some config is invalid; 2 a file cannot be read or parsed, or the
command line is wrong (argparse's usage errors).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from fsdp_offload_cfg.config import (
    ConfigError,
    FSDPOffloadConfig,
    as_config_file,
    fsdp_keys_written,
    load_config,
    normalized_dict,
    read_config_file,
    with_the_files_other_keys,
)
from fsdp_offload_cfg.config.schema import schema_text
from fsdp_offload_cfg.config.trainer_file import (
    BATCH_KEYS,
    MODEL_KEYS,
    SEQ_LEN_KEYS,
    TRL_COMPLETION_VERBS,
    TRL_FUSED_HEAD_VERBS,
    RunArguments,
    is_trainer_layout,
    run_arguments_of,
)
from fsdp_offload_cfg.estimate.inputs import LOSS_HEADS

EXIT_OK, EXIT_INVALID, EXIT_UNREADABLE = 0, 1, 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run one verb; return the exit code instead of exiting (the console script exits with it)."""
    parser = _parser()
    argv, command = _launch_command_of(list(sys.argv[1:] if argv is None else argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else EXIT_UNREADABLE
    args.command = command if args.verb == "estimate" else getattr(args, "command", None)
    if args.verb == "estimate" and command and args.file is None:
        return args.run(args)  # the command names its config
    if getattr(args, "files", None) == [] or getattr(args, "file", "") is None:  # validate / explain, estimate
        default = _accelerate_default_config(args.verb)
        if default is None:
            return EXIT_UNREADABLE
        if args.verb == "validate":
            args.files = [default]
        else:
            args.file = default
    return args.run(args)


def _launch_command_of(argv: list[str]) -> tuple[list[str], list[str]]:
    """`estimate [FLAGS] -- COMMAND`: the flags, and the command whose run is estimated (argparse
    would take COMMAND's first word for CONFIG)."""
    verb = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), None)
    if verb is None or argv[verb] != "estimate" or "--" not in argv[verb:]:
        return argv, []
    at = argv.index("--", verb)
    return argv[:at], argv[at + 1:]


def _accelerate_default_config(verb: str) -> str | None:
    """No FILE given: the config `accelerate launch` reads without `--config_file` (the one
    `accelerate config` writes), said on stderr; None, and why, where there is none."""
    from fsdp_offload_cfg.discovery import accelerate_default_config_path

    path = accelerate_default_config_path()
    if not path.is_file():
        _print(f"fsdp-offload-cfg {verb}: no FILE given, and accelerate has no config of its own at {path} (`accelerate "
               "config` writes one there); name the config file to read", file=sys.stderr)
        return None
    _print(f"fsdp-offload-cfg {verb}: no FILE given; reading accelerate's own config, {path} (what accelerate launch "
           "reads without --config_file)", file=sys.stderr)
    return str(path)


_DEFAULT_FILE_HELP = "default: accelerate's own config, which accelerate launch reads without --config_file"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-offload-cfg", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--version", action=_Version, nargs=0, help="print the versions of this plugin and its stack")
    verbs = parser.add_subparsers(dest="verb", required=True,
                                  metavar="{validate,schema,explain,estimate,run,swift-plugin,install-hook,uninstall-hook}")

    validate = verbs.add_parser("validate", help="check config files; exit 0 valid, 1 invalid, 2 unreadable")
    validate.add_argument("files", nargs="*", metavar="FILE", help=_DEFAULT_FILE_HELP)
    validate.add_argument("--format", choices=("text", "json"), default="text")
    _add_set(validate)
    validate.set_defaults(run=_validate)

    schema = verbs.add_parser("schema", help="print the JSON Schema of fsdp_config")
    schema.set_defaults(run=lambda args: _print(schema_text(), end=""))

    explain = verbs.add_parser("explain", help="print the effective config and the patches it turns on")
    explain.add_argument("file", nargs="?", metavar="FILE", help=_DEFAULT_FILE_HELP)
    explain.add_argument("--format", choices=("yaml", "json"), default="yaml")
    explain.add_argument("--num-processes", type=_count, metavar="P",
                         help="ranks of the launch to plan for (default: the config's num_processes, else 1)")
    _add_set(explain)
    explain.set_defaults(run=_explain)

    estimate = verbs.add_parser(
        "estimate", help="per-rank device and host memory of a run of this config",
        usage="%(prog)s [CONFIG] [options] [-- COMMAND ...]",
        description="Per-rank device and host memory of a run. -- COMMAND: the launch command of the run "
                    "(accelerate launch, trl sft, swift sft, torchrun, llamafactory-cli train, axolotl train, python script.py), "
                    "read as it runs, nothing started: the config file its launcher reads (CONFIG, if given, "
                    "must be that one), the launch's flags over it, and the training arguments of its script "
                    "(a --config YAML, a YAML argument, --key value flags) for the flags left out here.")
    estimate.add_argument("file", nargs="?", metavar="CONFIG", help=_DEFAULT_FILE_HELP)
    estimate.add_argument("--model", metavar="MODEL",
                          help="a local model directory, its config.json, or a Hub id already in the local "
                               "Hugging Face cache, as from_pretrained takes it (nothing is downloaded). Required, "
                               "as are --seq-len and --batch-size, unless CONFIG is a Trainer's file that says it "
                               "(TrainingArguments, LlamaFactory, axolotl, TRL: the flags win over its keys)")
    estimate.add_argument("--seq-len", type=int, metavar="N")
    estimate.add_argument("--batch-size", type=int, metavar="B", help="micro-batch per rank")
    estimate.add_argument("--num-processes", type=_count, metavar="P", help="ranks (default: the config's num_processes)")
    estimate.add_argument("--optimizer", choices=("adamw", "adamw_fused", "sgd"),
                          help="adamw (the default, but for a Trainer's file): torch.optim.AdamW's defaults (foreach "
                          "on CUDA); adamw_fused: fused=True, the Trainer's adamw_torch_fused")
    estimate.add_argument("--gradient-accumulation-steps", type=int, metavar="N",
                          help="micro-batches per optimizer step (default 1): above 1, every gradient is on the "
                               "device in backward")
    estimate.add_argument("--device", choices=("cuda", "cpu"), help="where it runs (default: cpu if use_cpu, else cuda)")
    estimate.add_argument("--dtype", help="load dtype (default: the model config's dtype, else float32)")
    estimate.add_argument("--format", choices=("table", "json"), default="table")
    estimate.add_argument("--plot", metavar="PNG", help="also draw per-rank device memory per activation setting "
                          "(needs matplotlib: pip install 'fsdp-offload-cfg[plot]')")
    estimate.add_argument("--device-memory", metavar="SIZE", help="the device's memory, e.g. 80GiB: says which "
                          "activation settings fit it (a tenth kept free), draws --plot's line and sizes "
                          "--activation-budget auto (default: the config's activation_budget_device_memory, "
                          "else for --plot and auto the visible GPU's, if any)")
    estimate.add_argument("--activation-budget", metavar="SIZE",
                          help="plan each layer (keep, offload, checkpoint, both) so that activations on the device "
                               "stay within SIZE, e.g. 12GiB; or auto (auto-2GiB, auto-5%%: another margin than "
                               "10%%): what the device's memory leaves besides the states")
    estimate.add_argument("--compute-tflops", type=float, metavar="X",
                          help="the plan's compute rate (default: 350 on cuda, 0.05 on cpu)")
    estimate.add_argument("--copy-gb-per-s", type=float, metavar="X",
                          help="the plan's device<->host copy rate, each way (default: 55 on cuda, 5 on cpu)")
    estimate.add_argument("--lora-rank", type=int, metavar="R",
                          help="a LoRA fine-tune (PEFT): adapters of rank R train over the frozen model, which "
                               "then keeps no gradients or optimizer state (needs peft)")
    estimate.add_argument("--lora-targets", metavar="NAMES",
                          help="the modules that get adapters, as PEFT's target_modules: all-linear (the default: "
                               "every linear layer but the output head), peft-default (PEFT's default for the model's "
                               "type, as TRL's use_peft leaves it) or names, e.g. q_proj,v_proj")
    estimate.add_argument("--lora-dropout", type=float, metavar="P",
                          help="the adapters' dropout (default 0, PEFT's; ms-swift's is 0.05): each adapter then "
                               "saves a dropped copy of its input")
    estimate.add_argument("--lora-modules-to-save", metavar="NAMES",
                          help="modules trained whole beside the adapters (PEFT's modules_to_save), e.g. "
                               "embed_tokens,lm_head as a run adding tokens trains them; input-output-embeddings names "
                               "the model's embeddings whatever they are called (default: as the run's file says)")
    # where the adapters' module names were given, for an error naming one the model lacks: these
    # flags, or the run file's keys (`_lora_from_file`)
    estimate.set_defaults(lora_said=("--lora-targets", "--lora-modules-to-save"))
    estimate.add_argument("--lora-dora", action=argparse.BooleanOptionalAction,
                          help="the adapters are DoRA's (PEFT's use_dora): each adapted layer also saves its base "
                               "output and its adapter's output, about twice LoRA's activations (default: as the "
                               "run's file says, else LoRA)")
    estimate.add_argument("--reference-model", action=argparse.BooleanOptionalAction,
                          help="a reference model: a frozen copy of the model sharded beside it, as TRL's DPO and KTO "
                               "(and GRPO / RLOO with a KL term) hold one (default: as the run's command says)")
    estimate.add_argument("--reward-model", metavar="MODEL", action="append",
                          help="a reward model held whole on every rank, as TRL's GRPO and RLOO hold one; again for "
                               "several (default: the run's reward_model_name_or_path, ms-swift's reward_model)")
    estimate.add_argument("--teacher-model", metavar="MODEL",
                          help="a distillation teacher held whole on every rank in its checkpoint's dtype, as TRL's "
                               "distillation holds one (default: the run's teacher_model_name_or_path)")
    estimate.add_argument("--loss-head", choices=LOSS_HEADS,
                          help="what the loss goes through: the model's own cross-entropy over the full logits, TRL's "
                               "fused LM head (its SFTTrainer, DPOTrainer, KTOTrainer, GRPOTrainer, RLOOTrainer in a "
                               "script of your own) or its distillation (default: as the run's command says)")
    estimate.add_argument("--completion-tokens", type=_count, metavar="N",
                          help="the positions the loss scores at each sequence's end (a generated completion's, "
                               "GRPO's max_completion_length; default: as the run's command says, else every one)")
    _add_set(estimate)
    estimate.set_defaults(run=_estimate)

    run = verbs.add_parser("run", help="run a command with patch() first in every Python process it starts",
                           usage="fsdp-offload-cfg run [--config FILE] -- COMMAND [ARG ...]")
    run.add_argument("--config", metavar="FILE", help="the config (default: found as patch() finds it)")
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND")
    run.set_defaults(run=_run)

    swift = verbs.add_parser("swift-plugin", help="print the file to give ms-swift's --external_plugins, which turns "
                             "the plugin on in every swift training process")
    swift.set_defaults(run=_swift_plugin)

    for verb, action in (("install-hook", "install"), ("uninstall-hook", "remove")):
        hook = verbs.add_parser(verb, help=f"{action} the .pth line that runs patch() in every Python process "
                                "where FSDP_OFFLOAD_CFG_AUTOPATCH=1 is set")
        hook.add_argument("--target", metavar="DIR", help="site-packages folder (default: this environment's)")
        hook.set_defaults(run=_install_hook if verb == "install-hook" else _uninstall_hook)
    return parser


def _versions() -> str:
    """This package's version and the stack's, read from the installed metadata (nothing imported:
    `--version` answers at once, and says what to paste into a bug report)."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    stack = ", ".join(f"{name} {version(name)}" for name in ("torch", "accelerate", "transformers"))
    return f"fsdp-offload-cfg {version('fsdp-offload-cfg')} ({stack}; Python {sys.version.split()[0]})"


class _Version(argparse.Action):
    """--version, printed as one line (argparse's own action wraps it at the terminal's width)."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        _print(_versions())
        parser.exit()


def _count(text: str) -> int:
    """--num-processes: 1 or more (0 read as 'unset' and planned for the config's 8; -3 was
    printed as the launch's size)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _add_set(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], type=_override, metavar="KEY=VALUE",
                        help="override a key, e.g. fsdp_config.activation_cpu_offload=true (repeatable)")


def _override(text: str) -> str:
    if "=" not in text or not text.partition("=")[0].strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return text


def _print(text: str, end: str = "\n", file: Any = None) -> int:
    """Print; a reader that went away (`validate f.yaml | head -0`) is not an error of ours: the
    rest goes to /dev/null and the verb still exits with its own status."""
    stream = file or sys.stdout
    try:
        print(text, end=end, file=stream)
        stream.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    return EXIT_OK


def _exit_code(error: ConfigError) -> int:
    return error.exit_code


def _validate(args: argparse.Namespace) -> int:
    results, code = [], EXIT_OK
    for file in args.files:
        try:
            config = load_config(file, args.overrides)
            results.append({"file": file, "valid": True, "unreadable": False, "problems": [],
                            "warnings": file_warnings(file, config)})
        except ConfigError as error:
            code = max(code, _exit_code(error))
            results.append({"file": file, "valid": False, "unreadable": error.unreadable,
                            "problems": [{"path": p.path, "message": p.message} for p in error.problems],
                            "warnings": []})
    if args.format == "json":
        _print(json.dumps({"files": results}, indent=2))
    for result in results if args.format == "text" else []:
        if result["valid"]:
            _print(f"{result['file']}: OK")
        for warning in result["warnings"]:
            _print(f"{result['file']}: warning: {warning}")
        for problem in result["problems"]:
            _print(": ".join(part for part in (result["file"], problem["path"], problem["message"]) if part))
    return code


def file_warnings(file: str, config: Any) -> list[str]:
    """What a valid file says that it may not mean: keys that do nothing under the FSDP version
    it runs, and spellings that also switch something else on."""
    from fsdp_offload_cfg.config import read_config_file

    try:
        top = read_config_file(file)
    except ConfigError:
        return []
    accelerate_file = "distributed_type" in top or "compute_environment" in top
    fsdp = top.get("fsdp_config") if isinstance(top.get("fsdp_config"), dict) else top
    return (_not_fsdp(config) if accelerate_file else []) + (
        _ignored_by_fsdp2(fsdp, config) + _ignored_by_this_accelerate(config) + _parallelism_size_warnings(config)
        + ([] if accelerate_file else _spelling_warnings(fsdp)))


def _not_fsdp(config: Any) -> list[str]:
    """An accelerate file that launches no FSDP (DeepSpeed, DDP, one process) is valid, and the
    plugin does nothing under it: a bare "OK" read as "checked and on" (its `deepspeed_config`
    is not checked at all)."""
    kind = str(config.distributed_type or "NO")
    if kind.upper() == "FSDP":
        return []
    return [f"distributed_type {kind}: this file runs no FSDP, so nothing of fsdp-offload-cfg applies to it (the launch "
            f"keys were checked{', not deepspeed_config' if kind.upper() == 'DEEPSPEED' else ''}); "
            "set distributed_type: FSDP with an fsdp_config to use it"]


# FSDP1 keys FSDP2 has no use for, and why; accelerate accepts them (a warning at most) and drops
# them, so an FSDP1 file moved to `fsdp_version: 2` by hand keeps them without a word (accelerate's
# own `accelerate to-fsdp2` removes these three; `sharding_strategy` and a true `forward_prefetch`,
# which change or stop the run, are errors: config/rules.py). A false `sync_module_states` beside
# `cpu_ram_efficient_loading` is an error too (the launch refuses it, whatever the version).
_FSDP1_ONLY = {"backward_prefetch": "FSDP2 prefetches the next layer's all-gather itself",
               "use_orig_params": "FSDP2 always trains the original parameters",
               "sync_module_states": "FSDP2 broadcasts no module states: with cpu_ram_efficient_loading "
                                     "every rank gets its shard from the loader, else each rank loads the "
                                     "checkpoint itself"}


def _ignored_by_fsdp2(fsdp: dict[str, Any], config: Any) -> list[str]:
    if config.version != 2:
        return []
    return [f"fsdp_config.{spelled} does nothing under FSDP2 ({why}; accelerate drops it): remove it"
            for key, why in _FSDP1_ONLY.items() for spelled in (f"fsdp_{key}", key)
            if fsdp.get(spelled) is not None and str(fsdp[spelled]).upper() != "NO_PREFETCH"]  # accelerate's "none"


def _ignored_by_this_accelerate(config: Any) -> list[str]:
    """Keys the installed accelerate takes and does nothing with under FSDP2 (`compat`)."""
    from fsdp_offload_cfg.compat.ignored_modules import ignored_modules_sharded_anyway

    if config.version != 2 or config.ignored_modules is None:
        return []
    message = ignored_modules_sharded_anyway()
    return [message] if message else []


def _parallelism_size_warnings(config: Any) -> list[str]:
    """accelerate stops every rank at `Accelerator()` when the `parallelism_config` sizes do not
    multiply to the number of processes (more: torch's device mesh is bigger than the world; fewer:
    accelerate's "total_size does not match num_processes"), after the launch has started them
    all; the file says it before. Read from the loaded config, so a `--set num_processes=N` counts.
    A warning, not an error: the launch's `--num_processes` replaces the file's number."""
    section, processes = config.parallelism_config or {}, config.num_processes
    sizes = {key.removeprefix("parallelism_config_"): value for key, value in section.items() if key.endswith("_size")}
    total = math.prod(sizes.values())
    # -1: the launch decides; all 1: accelerate replicates over every process; DeepSpeed's SP counts its own groups
    if processes in (None, -1) or total in (1, processes) or section.get("parallelism_config_sp_backend") == "deepspeed":
        return []
    shown = " x ".join(f"{name} {size}" for name, size in sizes.items() if size != 1)
    return [f"parallelism_config: {shown} = {total} processes, but num_processes is {processes}: accelerate stops "
            f"every rank at Accelerator() (its device mesh is one rank per process); make the sizes multiply to "
            f"num_processes, or launch with --num_processes {total}"]


def _spelling_warnings(fsdp: dict[str, Any]) -> list[str]:
    """The unprefixed `activation_cpu_offload` in a TrainingArguments-style file (ms-swift's
    `--fsdp` JSON, a Trainer `fsdp_config`) is ms-swift's own key too: it turns ms-swift's
    offloader on beside this plugin's (in an accelerate file only this plugin reads it)."""
    if "activation_cpu_offload" not in fsdp:
        return []
    return ["fsdp_config.activation_cpu_offload is also ms-swift's own key: under `swift sft` it turns on "
            "ms-swift's offloader as well, and the run stops (two offloaders on one model). Spell it "
            "fsdp_activation_cpu_offload, which only this plugin reads."]


def _explain(args: argparse.Namespace) -> int:
    from fsdp_offload_cfg.discovery import find_accelerate_launch, override_keys, with_launch_overrides

    launch = find_accelerate_launch()
    try:
        config, changed = with_launch_overrides(load_config(args.file, args.overrides),
                                                typed=launch.typed if launch is not None else None,
                                                keep=override_keys(args.overrides))
    except ConfigError as error:
        _print(str(error), file=sys.stderr)
        return _exit_code(error)
    processes = args.num_processes or config.num_processes or 1
    top = read_config_file(args.file)
    typed = fsdp_keys_written(top) | override_keys(args.overrides)  # the user's, even at their defaults
    data: dict[str, Any] = {
        "source": config.source,
        # a file `validate` accepts, that loads back to this config, and that launches as the user's did
        "config": with_the_files_other_keys(as_config_file(config, typed), top),
        "defaults": _defaults_taken(config, typed),
        "processes": processes,
        "patches": _describe_patches(config, processes),
    }
    if warnings := file_warnings(args.file, config):
        data["warnings"] = warnings
    if changed:  # run inside `accelerate launch`: its command line wins over the file, as in patch()
        data["overridden_by_launch"] = {key: {"file": old, "launch": new} for key, (old, new) in changed.items()}
    if args.format == "json":
        return _print(json.dumps(data, indent=2))
    import yaml

    return _print(yaml.safe_dump(data, sort_keys=False), end="")


def _estimate(args: argparse.Namespace) -> int:
    from fsdp_offload_cfg.estimate import EstimateError, estimate_memory  # torch only once the inputs are checked
    from fsdp_offload_cfg.estimate.source import ModelSourceError

    try:
        capacity = _plot_inputs(args)
        config, run = _config_and_run(args)
        config, taken = _with_the_files_run(args, config, run)
        head, head_said = _loss_head(args, run)
        if missing := [flag for flag, value in (("--model", args.model), ("--seq-len", args.seq_len),
                                                ("--batch-size", args.batch_size)) if value is None]:
            _print(f"fsdp-offload-cfg estimate: the following arguments are required: {', '.join(missing)} "
                   f"({_unsaid(run.file if run else args.file, missing, run)})", file=sys.stderr)
            return EXIT_UNREADABLE
        report = estimate_memory(config, args.model, seq_len=args.seq_len,
                                 batch_size=args.batch_size, num_processes=args.num_processes,
                                 optimizer=args.optimizer, device=args.device, dtype=args.dtype,
                                 gradient_accumulation_steps=args.gradient_accumulation_steps,
                                 lora=_lora_input(args), machines=args.num_machines or 1,
                                 reference=_given_or(args.reference_model, bool(run and run.reference_model)),
                                 reward_model=_given_or(args.reward_model, run.reward_models if run else None),
                                 teacher_model=_given_or(args.teacher_model, run.teacher_model if run else None),
                                 teacher_dtype=run.teacher_dtype if run and not args.teacher_model else None,
                                 companions_sharded=bool(run and run.companions_sharded),
                                 loss_head=head,
                                 completion_tokens=_given_or(args.completion_tokens,
                                                             run.completion_tokens if run else None),
                                 colocated_share=run.vllm_share if run else None,
                                 **_plan_inputs(args))
        if head_said:
            report["assumptions"].insert(0, head_said)
        if taken:
            report["assumptions"].insert(0, f"from the training arguments in {run.file if run else args.file}: "
                                            f"{'; '.join(taken)}")
        if "plan" not in report and (args.compute_tflops is not None or args.copy_gb_per_s is not None):
            _print("fsdp-offload-cfg estimate: --compute-tflops / --copy-gb-per-s time the activation budget's plan "
                   "(--activation-budget, or the config's activation_memory_budget); ignored without one",
                   file=sys.stderr)
        if args.plot:
            from fsdp_offload_cfg.estimate.inputs import visible_device_bytes
            from fsdp_offload_cfg.estimate.plot import save_memory_plot

            save_memory_plot(report, args.plot, capacity or visible_device_bytes(report["inputs"]["device"]))
            _print(f"fsdp-offload-cfg estimate: device memory per activation setting drawn in {args.plot}",
                   file=sys.stderr)
    except ConfigError as error:
        _print(str(error), file=sys.stderr)
        return _exit_code(error)
    except ModelSourceError as error:
        _print(f"fsdp-offload-cfg estimate: {error}", file=sys.stderr)
        return EXIT_UNREADABLE
    except EstimateError as error:
        _print(f"fsdp-offload-cfg estimate: {error}", file=sys.stderr)
        return EXIT_INVALID
    from fsdp_offload_cfg.estimate.report import format_table

    return _print(json.dumps(report, indent=2) if args.format == "json" else format_table(report))


def _config_and_run(args: argparse.Namespace) -> tuple[FSDPOffloadConfig, RunArguments | None]:
    """The config and the run's training arguments: from CONFIG where it is a Trainer's file, or
    from `-- COMMAND` (`launch_command.py`): the config file its launcher reads (CONFIG,
    where given, must be that one), the launch's typed flags over it, and the training arguments
    of its script over those of a Trainer's config file."""
    from fsdp_offload_cfg.launch_command import read_launch_command

    if not args.command:
        config, top = load_config(args.file, args.overrides), read_config_file(args.file)
        args.num_machines = _num_machines(top)
        return config, run_arguments_of(top, args.file) if is_trainer_layout(top) else None

    launch = read_launch_command(args.command, os.getcwd())
    file = _config_of_command(args.file, launch)
    config = load_config(file, [*launch.overrides, *args.overrides])  # --set wins over the launch's flags
    args.num_processes = args.num_processes or launch.num_processes
    top = read_config_file(file)
    args.num_machines = launch.num_machines or _num_machines(top)
    args.script_trl = script = launch.script_trl
    arguments = {**(top if is_trainer_layout(top) else {}), **launch.arguments}
    if not arguments and launch.cli is None and not (script is not None and script.trl_defaults):
        return config, None
    base = file if is_trainer_layout(top) and file != launch.run_file else None
    source = " and ".join(filter(None, (base, launch.arguments_from))) or (
        script.script if script is not None else " ".join(launch.command[:2]))
    return config, run_arguments_of(arguments, source, launch.cli, script)


def _num_machines(top: dict[Any, Any]) -> int | None:
    """An accelerate file's `num_machines` (FSDP1's HYBRID_SHARD copies across them)."""
    machines = top.get("num_machines")
    return machines if isinstance(machines, int) and not isinstance(machines, bool) else None


def _config_of_command(given: str | None, launch: Any) -> str:
    """The config file of `-- COMMAND`: the one its launcher reads, else its training arguments'
    file where that holds FSDP settings (axolotl's); CONFIG where given, as long as the launcher
    reads no other."""
    named = launch.config_file if launch.config_file and os.path.isfile(launch.config_file) else None
    if given is not None and named is not None and os.path.realpath(given) != os.path.realpath(named):
        raise ConfigError(f"fsdp-offload-cfg estimate: CONFIG {given} and the command's own config {named} differ: "
                          "name one (the command's is what its run reads)", unreadable=True)
    if given or named:
        return given or named
    if launch.run_file is not None and is_trainer_layout(read_config_file(launch.run_file)):
        return launch.run_file
    if launch.config_file is not None:
        raise ConfigError(f"fsdp-offload-cfg estimate: the command's config {launch.config_file} does not exist",
                          unreadable=True)
    raise ConfigError("fsdp-offload-cfg estimate: the command names no accelerate config (accelerate launch "
                      "--config_file F, trl --accelerate_config F) and accelerate has no default one, and its "
                      "training arguments hold no fsdp / fsdp_config: name the config as CONFIG, before the --",
                      unreadable=True)


def _with_the_files_run(args: argparse.Namespace, config: FSDPOffloadConfig,
                        run: RunArguments | None) -> tuple[FSDPOffloadConfig, list[str]]:
    """Where CONFIG is a Trainer's file (`run`, `config/trainer_file.py`): the flags it leaves out
    taken from its training arguments (a flag given wins), and the config with the run's precision
    and layer checkpointing. Returns the config and what was taken, in words."""
    taken = _flags_from_file(args, run, args.num_processes or config.num_processes or 1)
    if run is None:
        return config, taken
    config, said = _config_from_file(config, run, _load_dtype(args) if run.precision_follows_dtype else None)
    reference = [f"a reference model: {run.reference_model}"] if run.reference_model else []
    return config, [*taken, *said, *_lora_from_file(args, run), *reference, *run.caveats]


def _load_dtype(args: argparse.Namespace) -> str | None:
    """The dtype the run loads in: --dtype (or the file's), else the checkpoint's `config.json`."""
    from fsdp_offload_cfg.estimate.source import model_config_file

    if args.dtype is not None or args.model is None:
        return args.dtype
    with open(model_config_file(args.model), encoding="utf-8") as f:
        model_config = json.load(f)
    return model_config.get("dtype") or model_config.get("torch_dtype") or "float32"


def _flags_from_file(args: argparse.Namespace, run: RunArguments | None, processes: int) -> list[str]:
    """The scalar flags left out, from the file where it says them, else their defaults
    (ms-swift's accumulation: its `ceil(16 / batch / processes)`)."""
    taken = []
    if run is not None and run.accumulation_target and args.gradient_accumulation_steps is None and run.batch_size:
        steps = max(1, math.ceil(run.accumulation_target / (args.batch_size or run.batch_size) / processes))
        run = dataclasses.replace(run, gradient_accumulation_steps=steps, taken={
            **run.taken, "gradient_accumulation_steps": f"gradient_accumulation_steps unset: ms-swift's "
                                                        f"ceil({run.accumulation_target} / batch / processes)"})
    for flag, name in (("--model", "model"), ("--seq-len", "seq_len"), ("--batch-size", "batch_size"),
                       ("--gradient-accumulation-steps", "gradient_accumulation_steps"), ("--optimizer", "optimizer"),
                       ("--dtype", "dtype")):
        if run is not None and getattr(args, name) is None and getattr(run, name) is not None:
            setattr(args, name, getattr(run, name))
            taken.append(f"{flag} {getattr(run, name)} ({run.taken[name]})")
    if run is not None and run.seq_len_follows_model and args.seq_len is None and args.model is not None:
        taken += _seq_len_of_model(args)
    args.gradient_accumulation_steps = 1 if args.gradient_accumulation_steps is None else args.gradient_accumulation_steps
    args.optimizer = args.optimizer or "adamw"
    return taken


def _seq_len_of_model(args: argparse.Namespace) -> list[str]:
    """ms-swift's unset `max_length`: the model's longest sequence, from its config.json."""
    from fsdp_offload_cfg.config.trainer_file import model_max_length
    from fsdp_offload_cfg.estimate.source import model_config_file

    with open(model_config_file(args.model), encoding="utf-8") as f:
        args.seq_len = model_max_length(json.load(f))
    if args.seq_len is None:
        return []  # the config names none: the usage error asks for --seq-len
    return [f"--seq-len {args.seq_len} (max_length unset: ms-swift's default, the model's max_position_embeddings "
            "or the like in its config.json)"]


def _config_from_file(config: FSDPOffloadConfig, run: RunArguments,
                      load_dtype: str | None = None) -> tuple[FSDPOffloadConfig, list[str]]:
    """The config with the file's mixed precision (over the launch's, as the Trainer sets it) and
    layer checkpointing (where no activation budget decides it). `load_dtype`: the run's, where its
    precision follows it (ms-swift: bf16 over bfloat16, else fp16)."""
    said = []
    if load_dtype is not None:
        taken = f"torch_dtype unset: ms-swift's bf16 / fp16 by the load dtype, {load_dtype}"
        run = dataclasses.replace(run, mixed_precision="bf16" if load_dtype == "bfloat16" else "fp16",
                                  taken={**run.taken, "mixed_precision": taken})
    if run.mixed_precision is not None and config.mixed_precision != run.mixed_precision:
        # the Trainer's own: its `bf16` / `fp16` replace the launch's ACCELERATE_MIXED_PRECISION
        over = f", over the launch's {config.mixed_precision}" if config.mixed_precision else ""
        config = dataclasses.replace(config, mixed_precision=run.mixed_precision)
        said.append(f"mixed precision {run.mixed_precision} ({run.taken['mixed_precision']}{over})")
    elif config.mixed_precision is None:
        said.append("no mixed precision: the file turns on neither bf16 nor fp16 (where the run does, through the "
                    "launch's --mixed_precision or a framework's default: estimate its command after --, which "
                    "reads both, or add bf16: true to the file estimated)")
    if run.gradient_checkpointing and not config.activation_checkpointing and config.activation_memory_budget is None:
        config = dataclasses.replace(config, activation_checkpointing=True)
        said.append(f"every layer checkpointed ({run.taken['gradient_checkpointing']})")
    return config, said


def _lora_from_file(args: argparse.Namespace, run: RunArguments) -> list[str]:
    """The file's LoRA where --lora-rank is not given (its other flags still win); a quantized base
    refused unless --lora-rank asks for LoRA over it as loaded."""
    from fsdp_offload_cfg.estimate import EstimateError

    said = []
    if run.quantized is not None:
        if args.lora_rank is None:
            raise EstimateError(f"{args.file}: {run.quantized}: the estimate counts no 4- or 8-bit weights; pass "
                                "--lora-rank R to estimate LoRA over the base in its load dtype (an upper bound)")
        said.append(f"the base in its load dtype, not quantized ({run.quantized})")
    if run.lora_rank is not None and args.lora_rank is None:
        args.lora_rank, from_file = run.lora_rank, [f"rank {run.lora_rank}"]
        if args.lora_targets is None:
            args.lora_targets = run.lora_targets
            from_file.append(f"on {run.lora_targets}")
            args.lora_said = (run.lora_keys[0] or args.lora_said[0], args.lora_said[1])
        if args.lora_dropout is None:
            args.lora_dropout = run.lora_dropout
            from_file += [f"dropout {run.lora_dropout:g}"] if run.lora_dropout else []
        if args.lora_dora is None:
            args.lora_dora = run.lora_dora
        if args.lora_modules_to_save is None and run.lora_modules_to_save:
            args.lora_modules_to_save = run.lora_modules_to_save
            from_file.append(f"with {run.lora_modules_to_save} trained whole")
            args.lora_said = (args.lora_said[0], run.lora_keys[1] or args.lora_said[1])
        said.append(f"{'DoRA' if args.lora_dora else 'LoRA'} {' '.join(from_file)} ({run.taken['lora']})")
    return said


def _loss_head(args: argparse.Namespace, run: RunArguments | None) -> tuple[str, str | None]:
    """The head the loss goes through, and, for a script of the user's own that builds one of
    TRL's trainers (`config/trl_script.py`), the sentence that says how it was read:
    --loss-head; else the run's (a TRL verb's, `trl sft`, or that of a script building its
    trainer with TRL's config); else, for a script converting the Trainer's arguments, its
    trainer's head (the fused LM head; with --teacher-model, DistillationTrainer's divergence);
    else the model's own cross-entropy. A user script building `SFTTrainer` was estimated with
    full logits over the vocabulary, which TRL never makes."""
    ran = run.loss_head if run else "cross_entropy"
    script = getattr(args, "script_trl", None)
    if args.loss_head is not None or script is None:
        return _given_or(args.loss_head, ran), _script_said(script, None)
    head = ran
    if script.verb == "distillation" and ran == "cross_entropy" and args.teacher_model is not None:
        head = "trl_chunked_distillation"
    elif not script.trl_defaults and script.verb in TRL_FUSED_HEAD_VERBS and ran == "cross_entropy":
        head = "trl_fused_lm_head"
    return head, _script_said(script, head)


def _script_said(script: Any, head: str | None) -> str | None:
    """How the estimate read a script that builds a TRL trainer: whose defaults, the head it chose
    (`head`, None where a flag chose it), what the source states in no literal."""
    if script is None:
        return None
    said = f"{script.script} builds TRL's {script.trainer} ({script.config_from}): " + (
        "TRL's defaults where neither the script nor the command line sets a value" if script.trl_defaults else
        "the Trainer's defaults, which TRL keeps in converting them")
    if head == "trl_fused_lm_head":
        said += ("; its loss through TRL's fused LM head, no logits over the whole vocabulary (--loss-head "
                 "cross_entropy counts them)")
        if not script.trl_defaults:  # TRL's defaults count both (the reader's `reference_model`, `completion_tokens`)
            said += ("; its reference model counts with --reference-model" if script.verb in ("dpo", "kto") else
                     "; only the completion's positions with --completion-tokens" if script.verb in TRL_COMPLETION_VERBS
                     else "")
    elif head == "trl_chunked_distillation":
        said += "; its loss through TRL's chunked divergence against its teacher"
    elif script.verb == "distillation" and head is not None:
        said += "; --teacher-model counts its teacher and its chunked divergence (counted here: the model's own loss)"
    if script.unread:
        said += f"; not literals in its source, so not read from it: {', '.join(script.unread)}"
    return said


def _given_or(flag: Any, from_the_run: Any) -> Any:
    """A flag given on the command line wins over what the run's arguments say (accelerate's order)."""
    return from_the_run if flag is None else flag


def _unsaid(file: str | None, missing: list[str], run: RunArguments | None) -> str:
    """Where each missing flag could have come from, for the usage error: the length in the
    run's own words where no key gives it (GRPO's: a prompt and its completion)."""
    keys = {"--model": MODEL_KEYS, "--seq-len": SEQ_LEN_KEYS, "--batch-size": BATCH_KEYS}
    if run is None and file is None:  # `estimate -- COMMAND` whose script gets no arguments
        return "the command gives its script no training arguments that could give them"
    if run is None:
        return f"{file} is not a Trainer's file, whose training arguments could give them"
    words = run.seq_len_said if "--seq-len" in missing else None
    keyless = [flag for flag in missing if not (flag == "--seq-len" and words)]
    said = [f"{file} has none of " + "; none of ".join(", ".join(keys[flag]) for flag in keyless)] if keyless else []
    return "; ".join(said + ([words] if words else []))


def _lora_input(args: argparse.Namespace) -> Any:
    """--lora-rank and the flags that describe its adapters (refused without it: they would
    silently estimate a full fine-tune)."""
    from fsdp_offload_cfg.estimate import EstimateError, Lora
    from fsdp_offload_cfg.estimate.adapters import ALL_LINEAR

    if args.lora_rank is None:
        given = [flag for flag, value in (("--lora-targets", args.lora_targets), ("--lora-dropout", args.lora_dropout),
                                          ("--lora-dora", args.lora_dora),
                                          ("--lora-modules-to-save", args.lora_modules_to_save)) if value is not None]
        if given:
            raise EstimateError(f"{' and '.join(given)} describe the adapters of --lora-rank, which is not given: "
                                "pass --lora-rank R for a LoRA fine-tune")
        return None
    return Lora(args.lora_rank, args.lora_targets or ALL_LINEAR, args.lora_dropout or 0.0, bool(args.lora_dora),
                args.lora_modules_to_save or "", said=args.lora_said)


def _plan_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """--activation-budget and the plan's rates (a rate left out takes the config's, else the
    device's default; a budget left out takes the config's `activation_memory_budget`)."""
    from fsdp_offload_cfg._sizes import parse_auto, size_in_bytes
    from fsdp_offload_cfg.estimate import EstimateError
    from fsdp_offload_cfg.estimate.plot import parse_size

    rates = {"--compute-tflops": args.compute_tflops, "--copy-gb-per-s": args.copy_gb_per_s}
    for option, value in rates.items():
        if value is not None and value <= 0:
            raise EstimateError(f"{option} must be positive, got {value:g}")
    budget = None
    if args.activation_budget:
        budget = parse_auto(args.activation_budget) or size_in_bytes(args.activation_budget)
        if budget is None:
            raise EstimateError(f"--activation-budget: expected a size from 1 byte to 1 PiB (such as 12GiB), or auto, "
                                f"auto-2GiB, auto-5% (a margin below the device's size); got {args.activation_budget!r}")
    return {"activation_budget": budget, "device_memory": parse_size(args.device_memory) if args.device_memory else None,
            "compute_flops": None if args.compute_tflops is None else args.compute_tflops * 1e12,
            "copy_bytes": None if args.copy_gb_per_s is None else args.copy_gb_per_s * 1e9}


def _plot_inputs(args: argparse.Namespace) -> int | None:
    """Check --plot's inputs before the estimate's minutes: matplotlib present, a folder to write
    to, a size that parses."""
    from fsdp_offload_cfg.estimate import EstimateError
    from fsdp_offload_cfg.estimate.plot import parse_size, require_matplotlib

    if args.plot:
        require_matplotlib()
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            raise EstimateError(f"--plot: the folder {folder} does not exist (create it, or pick another path)")
    return parse_size(args.device_memory) if args.device_memory else None


def _defaults_taken(config: FSDPOffloadConfig, typed: frozenset[str]) -> dict[str, Any]:
    """The keys `config` leaves at their defaults, with those defaults (what `config` does not show:
    a key the user wrote at its default value is theirs, shown there; `load_strategy` only where
    meta loading is on: elsewhere it does nothing)."""
    from fsdp_offload_cfg.integrations import loader_enabled

    written = as_config_file(config, typed)
    written = {**written, **written.get("fsdp_config", {})}  # launch keys and fsdp_config keys
    unused = set() if loader_enabled(config) else {"load_strategy"}
    return {k: v for k, v in normalized_dict(config).items()
            if k not in written and k not in unused and k != "source" and v is not None}


def _describe_patches(config: FSDPOffloadConfig, processes: int) -> list[str]:
    """The patches a launch of this config would apply on this machine: inside a launch, this
    process's context; otherwise a launch of `processes` ranks (this CLI runs as one process)."""
    from fsdp_offload_cfg.patching import LaunchContext, describe_patches

    here = LaunchContext.from_environ()
    return describe_patches(config, here if here.distributed else LaunchContext.for_processes(processes))


def _run(args: argparse.Namespace) -> int:
    """Exec COMMAND with the autopatch switch on and `_bootstrap` first on PYTHONPATH."""
    from fsdp_offload_cfg import autopatch

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        _print("fsdp-offload-cfg run: no command given (usage: fsdp-offload-cfg run [--config FILE] -- COMMAND ...)",
               file=sys.stderr)
        return EXIT_UNREADABLE
    env = dict(os.environ)
    try:
        config = _config_of_run(args.config, command)
        if config is not None:
            load_config(config)  # a bad file stops here, before any process starts
    except ConfigError as error:
        _print(str(error), file=sys.stderr)
        return _exit_code(error)
    if args.config is not None:
        env["FSDP_OFFLOAD_CFG"] = os.path.abspath(args.config)
    bootstrap = os.path.join(os.path.dirname(os.path.abspath(autopatch.__file__)), "_bootstrap")
    env["PYTHONPATH"] = os.pathsep.join([bootstrap, *filter(None, [env.get("PYTHONPATH")])])
    env[autopatch.SWITCH] = "1"
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        _print(f"fsdp-offload-cfg run: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    return EXIT_OK  # not reached: exec replaced this process


def _config_of_run(given: str | None, command: list[str]) -> str | None:
    """The config `run` checks before starting anything: `--config`, else the one the wrapped
    launcher names (`accelerate launch --config_file F`, `trl sft --accelerate_config F`), which
    the workers find the same way. Two different files named: a `ConfigError` with exit code 2,
    as for any command line that cannot run."""
    from fsdp_offload_cfg.discovery import launch_config_file

    _, named = launch_config_file(command, os.getcwd())
    named_file = str(named) if named is not None and named.is_file() else None
    if given is not None and named_file is not None and os.path.realpath(given) != os.path.realpath(named_file):
        raise ConfigError(f"fsdp-offload-cfg run: --config {given} and the command's own config {named_file} are "
                          "two files; name one (the command's is the one the launcher reads)", unreadable=True)
    return given if given is not None else named_file


def _hook_path(args: argparse.Namespace) -> str:
    import sysconfig

    from fsdp_offload_cfg.autopatch import PTH_NAME

    return os.path.join(os.path.abspath(args.target or sysconfig.get_paths()["purelib"]), PTH_NAME)


def _install_hook(args: argparse.Namespace) -> int:
    from fsdp_offload_cfg import hook_record
    from fsdp_offload_cfg.autopatch import SWITCH, pth_line

    path = _hook_path(args)
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        _print(f"fsdp-offload-cfg install-hook: {folder} is not a folder (give --target an existing "
               "site-packages folder, or leave it out for this environment's)", file=sys.stderr)
        return EXIT_UNREADABLE
    with open(path, "w", encoding="utf-8") as f:
        f.write(pth_line(path))
    recorded = hook_record.add(path)
    who = ("every Python process of this environment" if _is_site_dir(folder) else
           f"every Python process that adds {folder} as a site folder (it is not one of this Python's)")
    _print(f"{path}: {who} now calls fsdp_offload_cfg.patch() first when {SWITCH}=1 is set, and imports "
           f"nothing otherwise")
    return _print("removed by `pip uninstall fsdp-offload-cfg` with the package" if recorded else
                  f"not removed with the package (it lives outside it): `fsdp-offload-cfg uninstall-hook "
                  f"--target {folder}` removes it")


def _is_site_dir(folder: str) -> bool:
    import site
    import sysconfig

    dirs = [*site.getsitepackages(), site.getusersitepackages(), *sysconfig.get_paths().values()]
    return any(os.path.realpath(folder) == os.path.realpath(d) for d in dirs if d)


def _uninstall_hook(args: argparse.Namespace) -> int:
    from fsdp_offload_cfg import hook_record

    path = _hook_path(args)
    hook_record.remove(path)
    if os.path.exists(path):
        os.remove(path)
        return _print(f"{path}: removed")
    return _print(f"{path}: not installed")


def _swift_plugin(_args: argparse.Namespace) -> int:
    """The path only, so that `--external_plugins $(fsdp-offload-cfg swift-plugin)` works in a shell."""
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugins", "swift")
    return _print(os.path.join(folder, "fsdp_offload_cfg_for_swift.py"))
