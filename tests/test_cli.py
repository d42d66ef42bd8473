"""`fsdp-offload-cfg` verbs and exit codes (in-process), plus one run of the installed console script."""

from __future__ import annotations

import itertools
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fsdp_offload_cfg import cli
from fsdp_offload_cfg.config import schema

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = [str(ROOT / "examples" / name) for name in ("fsdp2.yaml", "fsdp2.json", "fsdp2_cpu.yaml")]


@pytest.fixture
def invalid(tmp_path: Path) -> str:
    path = tmp_path / "invalid.yaml"
    path.write_text("fsdp_version: 2\nactivaton_cpu_offload: true\nload_strategy: scatter\n")
    return str(path)


@pytest.fixture
def unparsable(tmp_path: Path) -> str:
    path = tmp_path / "broken.yaml"
    path.write_text("fsdp_config: [unclosed\n")
    return str(path)


def test_validate_examples_exit_0(capsys: pytest.CaptureFixture[str]):
    assert cli.main(["validate", *EXAMPLES]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{f}: OK" for f in EXAMPLES]


def test_validate_invalid_exit_1_with_one_line_per_problem(invalid: str, capsys: pytest.CaptureFixture[str]):
    assert cli.main(["validate", EXAMPLES[0], invalid]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"{EXAMPLES[0]}: OK",
        f"{invalid}: activaton_cpu_offload: unknown key; did you mean 'activation_cpu_offload'?",
        f'{invalid}: load_strategy: expected one of auto, broadcast, sharded; got "scatter"',
    ]


def test_validate_unreadable_exit_2_even_beside_invalid(invalid: str, unparsable: str, capsys: pytest.CaptureFixture[str]):
    assert cli.main(["validate", invalid, unparsable]) == 2
    assert f"{unparsable}: cannot read or parse the file" in capsys.readouterr().out
    assert cli.main(["validate", "/nonexistent/accelerate.yaml"]) == 2


def test_validate_json_format(invalid: str, unparsable: str, capsys: pytest.CaptureFixture[str]):
    assert cli.main(["validate", "--format", "json", EXAMPLES[1], invalid, unparsable]) == 2
    files = json.loads(capsys.readouterr().out)["files"]
    assert [(f["file"], f["valid"]) for f in files] == [(EXAMPLES[1], True), (invalid, False), (unparsable, False)]
    assert files[0]["problems"] == []
    assert files[1]["problems"] == [
        {"path": "activaton_cpu_offload", "message": "unknown key; did you mean 'activation_cpu_offload'?"},
        {"path": "load_strategy", "message": 'expected one of auto, broadcast, sharded; got "scatter"'},
    ]
    assert [f["unreadable"] for f in files] == [False, False, True]


def test_validate_set_overrides(capsys: pytest.CaptureFixture[str]):
    assert cli.main(["validate", EXAMPLES[0], "--set", "fsdp_config.activation_cpu_offload.mode=fast"]) == 1
    assert "fsdp_config.fsdp_activation_cpu_offload.mode: expected one of auto, async, sync" in capsys.readouterr().out
    assert cli.main(["validate", EXAMPLES[0], "--set", "load_strategy=sharded", "--set", "num_processes=16"]) == 0


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["validate", "x.yaml", "--set", "novalue"],
                                  ["validate", "x.yaml", "--format", "xml"], ["explain", "a.yaml", "b.yaml"]])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]):
    assert cli.main(argv) == 2
    assert "usage: fsdp-offload-cfg" in capsys.readouterr().err


@pytest.fixture
def accelerate_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where accelerate's own config is looked for, in a temp folder (not there yet)."""
    from accelerate.commands.config import config_args

    path = tmp_path / "accelerate" / "default_config.yaml"
    monkeypatch.setattr(config_args, "default_config_file", str(path))
    return path


def test_without_a_file_the_verbs_read_accelerates_own_config(accelerate_default: Path,
                                                               capsys: pytest.CaptureFixture[str]):
    """`accelerate launch train.py` reads the config `accelerate config` wrote; `fsdp-offload-cfg
    validate` with no FILE stopped with a usage error instead of checking that one."""
    accelerate_default.parent.mkdir()
    accelerate_default.write_text((ROOT / "examples" / "fsdp2.yaml").read_text())
    assert cli.main(["validate"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [f"{accelerate_default}: OK"]
    assert f"reading accelerate's own config, {accelerate_default}" in captured.err, captured.err
    assert cli.main(["explain"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["source"] == str(accelerate_default)


def test_without_a_file_and_without_accelerates_config_the_verbs_say_where_they_looked(
        accelerate_default: Path, capsys: pytest.CaptureFixture[str]):  # fmt: skip
    for verb in (["validate"], ["explain"], ["estimate", "--model", "m", "--seq-len", "8", "--batch-size", "1"]):
        assert cli.main(verb) == 2, verb
        err = capsys.readouterr().err
        assert f"no FILE given, and accelerate has no config of its own at {accelerate_default}" in err, err
        assert "`accelerate config` writes one there" in err and "Traceback" not in err, err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]):
    assert cli.main(["--help"]) == 0
    assert "validate" in capsys.readouterr().out


def test_schema_prints_the_schema(capsys: pytest.CaptureFixture[str]):
    assert cli.main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == schema.load_schema()


def test_explain_yaml_and_json(capsys: pytest.CaptureFixture[str]):
    assert cli.main(["explain", EXAMPLES[0], "--set", "load_strategy=sharded"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert data["source"] == EXAMPLES[0]
    assert data["config"]["fsdp_config"]["load_strategy"] == "sharded"
    assert data["config"]["fsdp_config"]["activation_cpu_offload"]["enabled"] is True
    assert data["defaults"]["forward_prefetch"] is False  # what the file leaves unset, with its value
    assert data["patches"] and all(isinstance(p, str) for p in data["patches"])
    assert cli.main(["explain", "--format", "json", EXAMPLES[2]]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["num_processes"] == 2
    written = set(data["config"]) | set(data["config"]["fsdp_config"])
    assert not written & set(data["defaults"]), "a key the config writes is not a default"


def test_explain_shows_a_key_the_user_wrote_at_its_default_as_theirs(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]):
    """`fsdp_offload_params: false` (accelerate's own `accelerate config` writes it) was missing from
    the config and listed under `defaults`, as if the file had left it out; so was a `--set` of a
    default. A key the file leaves unset, or sets to a null that means unset, stays a default."""
    from fsdp_offload_cfg.config import load_config

    file = tmp_path / "fsdp2.yaml"
    text = Path(EXAMPLES[2]).read_text()
    assert "fsdp_offload_params: false" in text and "fsdp_activation_checkpointing: false" in text
    file.write_text(text.replace("fsdp_config:\n", "fsdp_config:\n  fsdp_min_num_params: null\n"))
    assert cli.main(["explain", str(file), "--set", "fsdp_config.fsdp_use_orig_params=true"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    fsdp, defaults = data["config"]["fsdp_config"], data["defaults"]
    for key in ("offload_params", "activation_checkpointing"):
        assert fsdp[key] is False and key not in defaults, (key, fsdp, defaults)
    assert fsdp["use_orig_params"] is True and "use_orig_params" not in defaults
    assert defaults["forward_prefetch"] is False and "forward_prefetch" not in fsdp
    assert "min_num_params" not in fsdp
    shown = tmp_path / "shown.yaml"
    shown.write_text(yaml.safe_dump(data["config"]))
    assert load_config(str(shown)) == load_config(str(file))


TRAINER_JSON = {"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_version": 2, "activation_cpu_offload": {"mode": "sync"}}}
BARE_MAPPING = {"fsdp_version": 2, "fsdp_reshard_after_forward": 1 == 1, "fsdp_transformer_layer_cls_to_wrap": "A,B"}


@pytest.mark.parametrize("source", [*EXAMPLES, "trainer.json", "bare.yaml"])
def test_explains_config_validates_when_fed_back_and_loads_back_equal(
        source: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from fsdp_offload_cfg.config import load_config

    if source == "trainer.json":
        source = str(tmp_path / source)
        Path(source).write_text(json.dumps(TRAINER_JSON))
    elif source == "bare.yaml":
        source = str(tmp_path / source)
        Path(source).write_text(yaml.safe_dump(BARE_MAPPING))
    assert cli.main(["explain", source, "--set", "activation_checkpointing=true"]) == 0
    fed_back = tmp_path / "effective.yaml"
    fed_back.write_text(yaml.safe_dump(yaml.safe_load(capsys.readouterr().out)["config"]))
    assert cli.main(["validate", str(fed_back)]) == 0, capsys.readouterr().out
    assert load_config(fed_back) == load_config(source, ["activation_checkpointing=true"])


def test_explain_lists_the_patches_a_launch_would_apply(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert cli.main(["explain", "--format", "json", EXAMPLES[2]]) == 0  # 2 CPU processes
    names = [p.split(":")[0] for p in json.loads(capsys.readouterr().out)["patches"]]
    expected = {"loader-from-pretrained", "fsdp2-prepare-model"}
    if not torch.cuda.is_available():
        expected |= {"cpu-fsdp-state", "cpu-fsdp-accelerator-state"}
    assert expected <= set(names), names
    assert "WORLD_SIZE" not in os.environ  # the CLI leaves the environment as it found it


def test_explain_inside_a_launch_shows_what_the_command_line_overrode(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]):
    """What `accelerate launch --config_file fsdp2_cpu.yaml --mixed_precision bf16
    --fsdp_cpu_ram_efficient_loading false` exports to its processes."""
    for key in [k for k in os.environ if k.startswith(("FSDP_", "ACCELERATE_"))]:
        monkeypatch.delenv(key)
    file_env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_SHARDING_STRATEGY": "1",
                "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer"}
    for key, value in {**file_env, "ACCELERATE_MIXED_PRECISION": "bf16", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false"}.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["explain", "--format", "json", EXAMPLES[2]]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["overridden_by_launch"] == {
        "cpu_ram_efficient_loading": {"file": True, "launch": False}, "mixed_precision": {"file": "no", "launch": "bf16"}}
    assert data["config"]["mixed_precision"] == "bf16" and data["config"]["fsdp_config"]["cpu_ram_efficient_loading"] is False
    assert data["config"]["fsdp_config"]["activation_cpu_offload"]["enabled"] is True  # a plugin key: only the file has it


def test_explain_errors_go_to_stderr(invalid: str, capsys: pytest.CaptureFixture[str]):
    assert cli.main(["explain", invalid]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and f"{invalid}: load_strategy:" in captured.err
    assert cli.main(["explain", "/nonexistent/accelerate.yaml"]) == 2


def test_python_dash_m(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    monkeypatch.setattr(sys, "argv", ["fsdp_offload_cfg", "validate", EXAMPLES[2]])
    with pytest.raises(SystemExit) as info:
        runpy.run_module("fsdp_offload_cfg", run_name="__main__")
    assert info.value.code == 0 and capsys.readouterr().out == f"{EXAMPLES[2]}: OK\n"


def test_installed_console_script(invalid: str):
    script = Path(sys.executable).parent / "fsdp-offload-cfg"
    proc = subprocess.run([str(script), "validate", "--format", "json", *EXAMPLES, invalid],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert [f["valid"] for f in json.loads(proc.stdout)["files"]] == [True, True, True, False]


def test_explain_plans_the_launch_it_is_asked_about(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """explain assumed one process (no gloo patches for a 2-rank run) and listed
    `load_strategy` for a config whose meta loading is off."""
    path = tmp_path / "offload_only.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  activation_cpu_offload: true\n"
                    "  fsdp_cpu_ram_efficient_loading: false\n")
    assert cli.main(["explain", "--format", "json", str(path), "--num-processes", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = [p.split(":")[0] for p in data["patches"]]
    assert data["processes"] == 2
    if not torch.cuda.is_available():
        assert {"cpu-fsdp-state", "cpu-fsdp-accelerator-state"} <= set(names), names
    assert "load_strategy" not in data["defaults"], data["defaults"]
    assert cli.main(["explain", "--format", "json", str(path)]) == 0
    single = json.loads(capsys.readouterr().out)
    assert single["processes"] == 1 and "cpu-fsdp-state" not in [p.split(":")[0] for p in single["patches"]]


def test_validate_and_explain_warn_on_a_spelling_another_framework_reads(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]):
    """ms-swift reads the unprefixed `activation_cpu_offload` of its --fsdp JSON itself."""
    colliding = tmp_path / "swift_fsdp.json"
    colliding.write_text('{"fsdp": "full_shard auto_wrap", "fsdp_config": {"activation_cpu_offload": true}}')
    assert cli.main(["validate", str(colliding)]) == 0
    out = capsys.readouterr().out
    assert f"{colliding}: warning: fsdp_config.activation_cpu_offload is also ms-swift's own key" in out, out
    assert cli.main(["explain", "--format", "json", str(colliding)]) == 0
    assert "fsdp_activation_cpu_offload" in json.loads(capsys.readouterr().out)["warnings"][0]
    prefixed = tmp_path / "ours_only.json"
    prefixed.write_text('{"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_activation_cpu_offload": true}}')
    assert cli.main(["validate", str(prefixed)]) == 0 and "warning" not in capsys.readouterr().out
    assert cli.main(["validate", EXAMPLES[2]]) == 0 and "warning" not in capsys.readouterr().out  # accelerate YAML


def test_validate_and_explain_warn_on_fsdp1_keys_a_file_for_fsdp2_keeps(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]):
    """An FSDP1 file moved to `fsdp_version: 2` keeps keys FSDP2 drops: validate said OK and
    nothing else; accelerate drops them at launch, with a warning among each rank's logs at most.
    `sync_module_states` said nothing either (`accelerate to-fsdp2` removes it with the other two)."""
    moved = tmp_path / "moved_to_fsdp2.yaml"
    moved.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_backward_prefetch: BACKWARD_PRE\n"
                     "  fsdp_use_orig_params: true\n  fsdp_sync_module_states: true\n"
                     "  fsdp_cpu_ram_efficient_loading: false\n")
    assert cli.main(["validate", str(moved)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{moved}: OK",
                   f"{moved}: warning: fsdp_config.fsdp_backward_prefetch does nothing under FSDP2 (FSDP2 prefetches "
                   "the next layer's all-gather itself; accelerate drops it): remove it",
                   f"{moved}: warning: fsdp_config.fsdp_use_orig_params does nothing under FSDP2 (FSDP2 always trains "
                   "the original parameters; accelerate drops it): remove it",
                   f"{moved}: warning: fsdp_config.fsdp_sync_module_states does nothing under FSDP2 (FSDP2 broadcasts "
                   "no module states: with cpu_ram_efficient_loading every rank gets its shard from the loader, else "
                   "each rank loads the checkpoint itself; accelerate drops it): remove it"], out
    assert cli.main(["explain", "--format", "json", str(moved)]) == 0
    assert len(json.loads(capsys.readouterr().out)["warnings"]) == 3
    # removing it is what the warning says to do: the file stays valid with meta loading on (the
    # launch's --fsdp_sync_module_states defaults to true), and says nothing more
    removed = tmp_path / "removed.yaml"
    removed.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_cpu_ram_efficient_loading: true\n")
    assert cli.main(["validate", str(removed)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{removed}: OK"]
    # the same keys under FSDP1, and NO_PREFETCH (accelerate's "none") under FSDP2, say nothing
    fsdp1 = tmp_path / "fsdp1.yaml"
    fsdp1.write_text(moved.read_text().replace("fsdp_version: 2", "fsdp_version: 1"))
    none = tmp_path / "no_prefetch.yaml"
    none.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_backward_prefetch: NO_PREFETCH\n"
                    "  fsdp_cpu_ram_efficient_loading: false\n")
    lower = tmp_path / "no_prefetch_lower.yaml"  # accelerate upper-cases the name before it compares
    lower.write_text(none.read_text().replace("NO_PREFETCH", "no_prefetch"))
    assert cli.main(["validate", str(fsdp1), str(none), str(lower)]) == 0
    assert "warning" not in capsys.readouterr().out


def test_swift_plugin_prints_a_file_alone_in_its_folder(capsys: pytest.CaptureFixture[str]):
    """ms-swift puts an `--external_plugins` file's folder first on `sys.path`: anything else there
    (our `integrations/accelerate.py`, `transformers.py`) would shadow the real packages."""
    assert cli.main(["swift-plugin"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.is_file() and path.suffix == ".py"
    assert [p.name for p in path.parent.iterdir() if p.name != "__pycache__"] == [path.name]
    assert "fsdp_offload_cfg.patch()" in path.read_text()


def test_the_quick_verbs_import_no_torch():
    """`--help`, `--version`, `validate` and `schema` answer without torch, transformers or
    accelerate (importing them took 3-6 s a verb)."""
    code = ("import contextlib, io, sys; from fsdp_offload_cfg import cli\n"
            f"for argv in (['--help'], ['--version'], ['schema'], ['validate', *{EXAMPLES!r}]):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        assert cli.main(argv) == 0, argv\n"
            "print(sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_estimate_says_a_wrong_input_before_importing_torch(tmp_path: Path, invalid: str):
    """A mistyped model path, a Hub id not in the cache, a typo in the config or a flag's value is
    the estimate's most common first answer; it came after torch's import (10-14 s on the 2-core
    machine, against 0.6 s for `validate`). Each is now said without torch, transformers or
    accelerate imported, with the exit code and words it had."""
    llama = str(ROOT / "examples" / "llama3-8b")
    no_type = tmp_path / "no_type"
    no_type.mkdir()
    (no_type / "config.json").write_text('{"hidden_size": 8}')
    model = ["--model", llama, "--seq-len", "4096", "--batch-size", "1"]
    cases = [  # argv, exit code, what stderr names
        (["estimate", invalid, *model], 1, "activaton_cpu_offload"),
        (["estimate", EXAMPLES[0], "--model", str(tmp_path / "absent"), "--seq-len", "8", "--batch-size", "1"], 2,
         "cannot read the model config"),
        (["estimate", EXAMPLES[0], "--model", "someone/not-cached", "--seq-len", "8", "--batch-size", "1"], 2,
         "hf download someone/not-cached config.json"),
        (["estimate", EXAMPLES[0], "--model", str(no_type), "--seq-len", "8", "--batch-size", "1"], 2,
         "no 'model_type' key"),
        (["estimate", EXAMPLES[0], *model, "--device-memory", "80XB"], 1, "--device-memory"),
        (["estimate", EXAMPLES[0], *model, "--activation-budget", "lots"], 1, "--activation-budget"),
        (["estimate", EXAMPLES[0], *model, "--dtype", "float8"], 1, "--dtype"),
        (["estimate", EXAMPLES[0], *model, "--activation-budget", "auto", "--device", "cpu"], 1, "--device-memory"),
        (["estimate", EXAMPLES[0], "--model", llama, "--seq-len", "0", "--batch-size", "1"], 1, "--seq-len"),
        (["estimate", EXAMPLES[0], *model, "--lora-rank", "0"], 1, "--lora-rank must be >= 1"),
        (["estimate", EXAMPLES[0], *model, "--lora-targets", "q_proj"], 1, "pass --lora-rank R"),
    ]
    code = ("import contextlib, io, json, sys; from fsdp_offload_cfg import cli\n"
            f"answers = []\n"
            f"for argv in {[argv for argv, _, _ in cases]!r}:\n"
            "    err = io.StringIO()\n"
            "    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):\n"
            "        answers.append((cli.main(argv), err.getvalue()))\n"
            "print(json.dumps([answers, sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules)]))")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    answers, imported = json.loads(proc.stdout)
    for (argv, rc, named), (got_rc, err) in zip(cases, answers):
        assert (got_rc, named in err) == (rc, True), (argv, got_rc, err)
    assert imported == [], imported


def test_version_names_the_plugin_and_its_stack_on_one_line(capsys: pytest.CaptureFixture[str]):
    """Each package's installed version, as pip lists it (a CUDA wheel of torch says 2.15.0 there
    and 2.15.0+cu132 in `torch.__version__`), of the package this Python imports."""
    from importlib import metadata

    import accelerate
    import transformers

    import fsdp_offload_cfg

    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(f"fsdp-offload-cfg {fsdp_offload_cfg.__version__} ("), out
    for name, module in (("torch", torch), ("accelerate", accelerate), ("transformers", transformers)):
        installed = metadata.version(name)
        assert f"{name} {installed}" in out and module.__version__.startswith(installed), (out, module.__version__)


def test_help_describes_every_verb_in_whole_sentences(capsys: pytest.CaptureFixture[str]):
    assert cli.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "run a command with the plugin on (`run`, `install-hook`)." in out, out


@pytest.mark.parametrize("argv", [["explain", "--num-processes", "0"], ["explain", "--num-processes", "-3"],
                                  ["estimate", "--num-processes", "0", "--model", "m", "--seq-len", "8",
                                   "--batch-size", "1"]])
def test_a_process_count_below_one_is_a_usage_error_naming_the_option(argv: list[str], capsys: pytest.CaptureFixture[str]):
    assert cli.main([*argv, EXAMPLES[0]]) == 2
    err = capsys.readouterr().err
    option = next(a for a, v in itertools.pairwise(argv) if a.startswith("--") and v.lstrip("-").isdigit() and int(v) < 1)
    assert f"argument {option}: must be 1 or more" in err, err


def test_explains_config_keeps_the_files_other_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """explain's config is a file to launch: it dropped every key of the user's accelerate file
    that this plugin's config does not hold, so launching it ran without compilation
    (`dynamo_config`) and on one machine (`num_machines`, `machine_rank`, `main_process_ip`). They
    come back as the file has them, in its order; keys the config holds take its values (a
    `--set` wins)."""
    source = yaml.safe_load(Path(EXAMPLES[2]).read_text())
    source.update(num_machines=2, machine_rank=1, main_process_ip="10.0.0.1", main_process_port=29500,
                  dynamo_config={"dynamo_backend": "INDUCTOR", "dynamo_use_regional_compilation": True})
    path = tmp_path / "multi_node.yaml"
    path.write_text(yaml.safe_dump(source, sort_keys=False))
    assert cli.main(["explain", "--format", "json", str(path), "--set", "num_processes=4"]) == 0
    written = json.loads(capsys.readouterr().out)["config"]
    assert list(written) == list(source)
    for key in ("num_machines", "machine_rank", "main_process_ip", "main_process_port", "dynamo_config",
                "compute_environment", "rdzv_backend", "main_training_function"):
        assert written[key] == source[key], key
    assert written["num_processes"] == 4 and written["fsdp_config"]["activation_cpu_offload"]["enabled"] is True
    fed_back = tmp_path / "effective.yaml"
    fed_back.write_text(yaml.safe_dump(written, sort_keys=False))
    assert cli.main(["validate", str(fed_back)]) == 0


@pytest.mark.parametrize(("body", "named"), [("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n",
                                              "not deepspeed_config"),
                                             ("distributed_type: 'NO'\n", "distributed_type NO")])
def test_a_file_that_runs_no_fsdp_is_valid_and_says_the_plugin_does_nothing(tmp_path: Path, body: str, named: str,
                                                                            capsys: pytest.CaptureFixture[str]):
    """A DeepSpeed or single-process accelerate file validated with a bare "OK", read as checked
    and on; its deepspeed_config was never looked at."""
    path = tmp_path / "other.yaml"
    path.write_text(body)
    assert cli.main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: OK" in out and "nothing of fsdp-offload-cfg applies" in out and named in out, out
