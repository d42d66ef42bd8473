"""patch() / unpatch(): registry, reversibility, idempotence, version guard, discovery (in-process)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

import fsdp_offload_cfg
from fsdp_offload_cfg import ConfigError, FSDPOffloadConfig, integrations, patching, registry
from fsdp_offload_cfg.discovery import (
    AccelerateLaunch,
    _config_file_arg,
    _is_accelerate_launch,
    discover_config,
    typed_launch_keys,
)
from fsdp_offload_cfg.offload.options import ActivationOffloadConfig
from fsdp_offload_cfg.testing.logs import MessageLog

EVERYTHING_ON = FSDPOffloadConfig(
    distributed_type="FSDP",
    version=2,
    cpu_ram_efficient_loading=True,
    activation_cpu_offload=ActivationOffloadConfig(enabled=True),
    source="<test>",
)
FSDP1_OFFLOAD = FSDPOffloadConfig(
    distributed_type="FSDP", version=1, reshard_after_forward="FULL_SHARD", sync_module_states=False,
    activation_cpu_offload=ActivationOffloadConfig(enabled=True),
)


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):
    # A launcher's variables make `cpu_fsdp_needed` true, as under torchrun on a CPU machine. The
    # machine is one without a GPU whatever runs the tests: a GPU visible there must not turn these
    # into GPU runs (tests/test_gpu_visible.py runs this file with one visible).
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(registry, "has_accelerator_device", lambda: False)
    monkeypatch.setattr(registry.allocator, "cuda_allocator_here", lambda: False)  # no allocator change either
    for key in list(os.environ):
        if key.startswith("FSDP_") or key.startswith("ACCELERATE_"):
            monkeypatch.delenv(key)
    fsdp_offload_cfg.unpatch()
    yield
    fsdp_offload_cfg.unpatch()


def _raw(p: patching.Patch) -> Any:
    return registry.resolve(p)[2]


def _installed(p: patching.Patch) -> bool:
    """A framework's patch whose framework is not installed (TRL on Python 3.10) has no target."""
    return importlib.util.find_spec(p.module.split(".")[0]) is not None


def _snapshot(patches: list[patching.Patch] | None = None) -> dict[str, Any]:
    return {p.name: _raw(p) for p in (integrations.PATCHES if patches is None else patches) if _installed(p)}


def test_registry_targets_where_symbols_are_looked_up():
    targets = {(p.module, p.attribute) for p in integrations.PATCHES}
    # accelerate.accelerator imports fsdp2_prepare_model by name: the patch must go there.
    assert ("accelerate.accelerator", "fsdp2_prepare_model") in targets
    assert all(p.requires for p in integrations.PATCHES)


def test_direct_fsdp2_prepare_model_lookups_are_patched_too():
    """LlamaFactory and TRL call `accelerate.utils.fsdp_utils.fsdp2_prepare_model` (or the
    `accelerate.utils` export) themselves, e.g. on a DPO reference model."""
    import accelerate.accelerator
    import accelerate.utils
    import accelerate.utils.fsdp_utils

    originals = [accelerate.utils.fsdp_utils.fsdp2_prepare_model, accelerate.utils.fsdp2_prepare_model,
                 accelerate.accelerator.fsdp2_prepare_model]
    with fsdp_offload_cfg.patch(EVERYTHING_ON):
        patched = [accelerate.utils.fsdp_utils.fsdp2_prepare_model, accelerate.utils.fsdp2_prepare_model,
                   accelerate.accelerator.fsdp2_prepare_model]
        assert all(new is not old and new.__wrapped__ is old for new, old in zip(patched, originals))
    assert [accelerate.utils.fsdp_utils.fsdp2_prepare_model, accelerate.utils.fsdp2_prepare_model,
            accelerate.accelerator.fsdp2_prepare_model] == originals


def test_functions_swapped_during_a_sharded_load_are_declared_and_exist():
    sharded = dataclasses.replace(EVERYTHING_ON, load_strategy="sharded")
    (loader,) = [p for p in integrations.PATCHES if p.name == "loader-from-pretrained"]
    swaps = loader.swaps(sharded)
    assert ("transformers.modeling_utils", "_get_resolved_checkpoint_files") in swaps and len(swaps) >= 2
    assert all(callable(getattr(importlib.import_module(m), a)) for m, a in swaps)
    assert loader.swaps(EVERYTHING_ON) == swaps  # every strategy builds without reading where it can


def test_a_missing_swap_target_refuses_before_anything_changes(monkeypatch: pytest.MonkeyPatch):
    import transformers.modeling_utils as mu

    before = _snapshot()
    monkeypatch.delattr(mu, "_get_resolved_checkpoint_files")
    with pytest.raises(patching.UnsupportedVersionError, match="_get_resolved_checkpoint_files while it runs"):
        fsdp_offload_cfg.patch(dataclasses.replace(EVERYTHING_ON, load_strategy="sharded"))
    assert _snapshot() == before and fsdp_offload_cfg.active_config() is None


def test_unpatch_restores_every_original_object_and_env():
    before = _snapshot()
    env_before = dict(os.environ)
    session = fsdp_offload_cfg.patch(EVERYTHING_ON)
    applied = set(session.patch_names)
    assert {"fsdp2-prepare-model", "loader-from-pretrained", "cpu-fsdp-state"} <= applied
    for p in integrations.PATCHES:
        if p.name in applied:
            assert _raw(p) is not before[p.name], p.name
    assert os.environ["ACCELERATE_USE_FSDP"] == "true"
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"
    fsdp_offload_cfg.unpatch()
    after = _snapshot()
    for name, original in before.items():
        assert after[name] is original, name
    assert dict(os.environ) == env_before
    import accelerate.accelerator as acc

    assert acc.fsdp2_prepare_model is importlib.import_module("accelerate.utils.fsdp_utils").fsdp2_prepare_model


def test_unpatch_leaves_a_frameworks_replacement_made_after_patch():
    """axolotl replaces `accelerate.accelerator.fsdp2_prepare_model` with its copy after `patch()`:
    unpatching put accelerate's original back over it, undoing axolotl's patch in its own run."""
    import accelerate.accelerator as acc

    before = _snapshot()
    fsdp_offload_cfg.patch(EVERYTHING_ON)

    def theirs(accelerator: Any, model: Any) -> Any:
        return model

    acc.fsdp2_prepare_model = theirs
    try:
        fsdp_offload_cfg.unpatch()
        assert acc.fsdp2_prepare_model is theirs
        after = _snapshot()
        for name, original in before.items():  # everything else is back
            if name != "fsdp2-prepare-model":
                assert after[name] is original, name
    finally:
        acc.fsdp2_prepare_model = before["fsdp2-prepare-model"]


def _prepare_of_a_framework(accelerator: Any, model: Any) -> Any:
    """A framework's own `fsdp2_prepare_model`, installed after `patch()`, that fills nothing."""
    return model


def test_a_model_left_on_meta_names_the_patch_a_framework_replaced_after_patch(tmp_path):
    """A framework that replaces one of our patches after `patch()` (axolotl's prepare before
    `axolotl-trl-prepare-fsdp`) left a loader-built model on meta, and the error said only to
    prepare it: the cause was outside this package and nothing named it. The error now names what
    was replaced, and by whose function; nothing is named while every patch is in place."""
    import accelerate.accelerator as acc
    import torch
    import torch.distributed as dist
    import transformers.trainer  # noqa: F401 - its two patches of `Trainer.save_model` in force, one over the other

    from fsdp_offload_cfg.loading.guard import guard_until_prepared

    fsdp_offload_cfg.patch(EVERYTHING_ON)
    assert registry.displaced() == []
    original = acc.fsdp2_prepare_model
    acc.fsdp2_prepare_model = _prepare_of_a_framework
    with torch.device("meta"):
        layer = torch.nn.Linear(4, 4)
    guard_until_prepared(layer, "load test")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        named = (f"accelerate.accelerator.fsdp2_prepare_model (patch `fsdp2-prepare-model`) by "
                 f"{__name__}._prepare_of_a_framework")
        assert registry.displaced() == [named]
        with pytest.raises(RuntimeError, match="still on the meta device on rank 0") as error:
            layer(torch.ones(1, 4, device="meta"))
        assert f"Replaced since fsdp_offload_cfg.patch(), so the loader's fill may never run: {named}." in str(
            error.value), error.value
    finally:
        dist.destroy_process_group()
        acc.fsdp2_prepare_model = original


def test_classmethods_stay_classmethods_and_restore_exactly():
    from transformers.modeling_utils import PreTrainedModel

    raw = PreTrainedModel.__dict__["from_pretrained"]
    fsdp_offload_cfg.patch(EVERYTHING_ON)
    assert isinstance(PreTrainedModel.__dict__["from_pretrained"], classmethod)
    assert PreTrainedModel.__dict__["from_pretrained"] is not raw
    fsdp_offload_cfg.unpatch()
    assert PreTrainedModel.__dict__["from_pretrained"] is raw


def test_double_patch_is_a_noop():
    first = fsdp_offload_cfg.patch(EVERYTHING_ON)
    import accelerate.accelerator as acc

    installed = acc.fsdp2_prepare_model
    second = fsdp_offload_cfg.patch(EVERYTHING_ON)
    assert second is first
    assert acc.fsdp2_prepare_model is installed  # not wrapped twice


def test_patch_with_another_config_reapplies_cleanly():
    before = _snapshot()
    fsdp_offload_cfg.patch(EVERYTHING_ON)
    session = fsdp_offload_cfg.patch(FSDP1_OFFLOAD)
    assert "fsdp1-prepare-model" in session.patch_names
    assert "loader-from-pretrained" not in session.patch_names
    from transformers.modeling_utils import PreTrainedModel

    assert PreTrainedModel.__dict__["from_pretrained"] is before["loader-from-pretrained"]
    fsdp_offload_cfg.unpatch()
    assert _snapshot() == before


def test_context_manager_unpatches():
    before = _snapshot()
    with fsdp_offload_cfg.patch(EVERYTHING_ON) as session:
        assert fsdp_offload_cfg.active_config() is session.config
    assert fsdp_offload_cfg.active_config() is None
    assert _snapshot() == before


def test_unsupported_version_raises_before_anything_changes(monkeypatch: pytest.MonkeyPatch):
    before = _snapshot()
    env_before = dict(os.environ)
    monkeypatch.setitem(patching.SUPPORTED_VERSIONS, "accelerate", ("99.0", "100"))
    with pytest.raises(patching.UnsupportedVersionError, match=r"accelerate==.* outside the supported range >=99.0"):
        fsdp_offload_cfg.patch(EVERYTHING_ON)
    assert _snapshot() == before
    assert dict(os.environ) == env_before
    assert fsdp_offload_cfg.active_config() is None


def test_a_torch_below_the_tested_floor_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch):
    """torch 2.10 and older fail the suite (2.10: a launch with offload, the exit race; 2.8: the
    loader's and the offload's torch internals, and FSDP2 on the CPU before 2.7): refused, not run."""
    from importlib import metadata

    from fsdp_offload_cfg import registry

    real = metadata.version
    monkeypatch.setattr(registry.metadata, "version", lambda dist: "2.10.0" if dist == "torch" else real(dist))
    before = _snapshot()
    with pytest.raises(patching.UnsupportedVersionError, match=r"torch==2\.10\.0 is outside the supported range >=2\.11"):
        fsdp_offload_cfg.patch(EVERYTHING_ON)
    assert _snapshot() == before


def test_missing_target_raises_without_half_patch(monkeypatch: pytest.MonkeyPatch):
    real = list(integrations.PATCHES)
    before = _snapshot(real)
    bogus = patching.Patch(
        "bogus", "accelerate.accelerator", "Accelerator.no_such_method", lambda o, c: o,
        lambda c, ctx: True, ("accelerate",), "target removed upstream",
    )
    monkeypatch.setattr(integrations, "PATCHES", [*integrations.PATCHES, bogus])
    with pytest.raises(patching.UnsupportedVersionError, match=r"Accelerator\.no_such_method"):
        fsdp_offload_cfg.patch(EVERYTHING_ON)
    assert _snapshot(real) == before
    assert fsdp_offload_cfg.active_config() is None


def test_bad_config_raises_config_error_naming_key_and_patches_nothing():
    before = _snapshot()
    with pytest.raises(ConfigError, match="activaton_cpu_offload"):
        fsdp_offload_cfg.patch({"activaton_cpu_offload": True})
    assert _snapshot() == before


def test_cpu_fsdp_patches_only_for_fsdp_without_gpu():
    from fsdp_offload_cfg.registry import LaunchContext

    assert integrations.cpu_fsdp_needed(EVERYTHING_ON, LaunchContext(world_size=2, launcher=True))
    assert integrations.cpu_fsdp_needed(EVERYTHING_ON, LaunchContext.from_environ())  # the fixture's launcher
    assert not integrations.cpu_fsdp_needed(EVERYTHING_ON, LaunchContext())  # single process: nothing to shard
    assert not integrations.cpu_fsdp_needed(EVERYTHING_ON, LaunchContext(world_size=2, accelerator=True))
    assert not integrations.cpu_fsdp_needed(FSDPOffloadConfig(distributed_type="MULTI_GPU"), LaunchContext(world_size=2))


def test_use_cpu_runs_fsdp_on_the_cpu_on_a_machine_with_a_gpu():
    """`accelerate launch --cpu` (use_cpu: true) on a GPU box: accelerate comes up as MULTI_CPU on
    gloo and would drop FSDP, as on a machine without a GPU; the same patches keep FSDP, and the
    same refusal of FSDP1's sync_module_states applies."""
    from fsdp_offload_cfg.registry import LaunchContext

    gpu_box = LaunchContext(world_size=2, launcher=True, accelerator=True)
    on_cpu = dataclasses.replace(EVERYTHING_ON, use_cpu=True)
    assert integrations.cpu_fsdp_needed(on_cpu, gpu_box)
    assert not integrations.cpu_fsdp_needed(EVERYTHING_ON, gpu_box)
    fsdp1 = FSDPOffloadConfig(distributed_type="FSDP", version=1, reshard_after_forward="FULL_SHARD",
                              sync_module_states=True, use_cpu=True, source="cpu.yaml")
    assert any("cpu.yaml: fsdp_config.sync_module_states" in p for p in integrations.environment_problems(fsdp1, gpu_box))
    assert not integrations.environment_problems(dataclasses.replace(fsdp1, use_cpu=False), gpu_box)


def test_predicates_read_the_launch_context_not_the_environment(monkeypatch: pytest.MonkeyPatch):
    """`explain` asks what 8 processes would get without writing WORLD_SIZE into its environment."""
    from fsdp_offload_cfg.registry import LaunchContext

    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("LOCAL_RANK")
    eight = patching.describe_patches(EVERYTHING_ON, LaunchContext(world_size=8, launcher=True))
    alone = patching.describe_patches(EVERYTHING_ON, LaunchContext())
    assert any(p.startswith("cpu-fsdp-state:") for p in eight)
    assert not any(p.startswith("cpu-fsdp-state:") for p in alone)
    assert "WORLD_SIZE" not in os.environ


def test_describe_patches_lists_what_patch_applies():
    described = patching.describe_patches(EVERYTHING_ON)
    session = fsdp_offload_cfg.patch(EVERYTHING_ON)
    assert [d.split(":")[0] for d in described] == session.patch_names


@pytest.mark.parametrize(
    "cmdline, is_launch, config_file",
    [
        (["/v/bin/python", "/v/bin/accelerate", "launch", "--config_file", "a.yaml", "t.py"], True, "a.yaml"),
        (["accelerate", "launch", "--config-file=b.yaml", "t.py"], True, "b.yaml"),
        (["python", "-m", "accelerate.commands.launch", "--num_processes", "2", "t.py"], True, None),
        (["/usr/bin/accelerate-launch", "t.py"], True, None),
        (["torchrun", "--nproc_per_node", "2", "t.py", "--config_file", "x"], False, "x"),
        (["python", "train.py", "launch"], False, None),
    ],
)
def test_accelerate_launch_command_lines(cmdline: list[str], is_launch: bool, config_file: str | None):
    assert _is_accelerate_launch(cmdline) is is_launch
    assert _config_file_arg(cmdline) == config_file


@pytest.mark.parametrize(
    "cmdline, expected",
    [
        (["/v/bin/python", "/v/bin/trl", "sft", "--accelerate_config", "a.yaml", "--model_name_or_path", "m"], "a.yaml"),
        (["trl", "dpo", "--accelerate_config=/abs/b.yaml"], "/abs/b.yaml"),
        (["python", "-m", "trl", "sft", "--accelerate_config", "c.yaml"], "c.yaml"),
        (["/v/bin/accelerate", "launch", "--config_file", "d.yaml", "t.py", "--accelerate_config", "x"], "d.yaml"),
        (["python", "train.py", "--accelerate_config", "x.yaml"], None),
        (["trl", "--help"], None),
    ],
)
def test_the_launchers_that_name_an_accelerate_config(cmdline: list[str], expected: str | None, tmp_path):
    """TRL's CLI runs accelerate's launcher in its own process: its workers find the file there,
    as under `accelerate launch` (they read accelerate's FSDP_* variables, which drop our keys)."""
    from fsdp_offload_cfg.discovery import launch_config_file

    is_launch, path = launch_config_file(cmdline, str(tmp_path))
    assert is_launch is (expected is not None)
    assert path == (None if expected is None else tmp_path / expected)


def test_trl_takes_the_accelerate_config_its_config_yaml_names(tmp_path):
    """TRL's documented `accelerate_config: F` in the YAML of `trl sft --config sft.yaml`: the
    workers found no file on the `trl` command line and fell back to accelerate's `FSDP_*`
    variables, without the plugin's keys. The command line's `--accelerate_config` wins, as in TRL."""
    from fsdp_offload_cfg.discovery import launch_config_file

    (tmp_path / "sft.yaml").write_text("model_name_or_path: m\naccelerate_config: fsdp.yaml\n")
    (tmp_path / "plain.yaml").write_text("model_name_or_path: m\n")
    assert launch_config_file(["trl", "sft", "--config", "sft.yaml"], str(tmp_path)) == (True, tmp_path / "fsdp.yaml")
    both = ["trl", "sft", "--config", str(tmp_path / "sft.yaml"), "--accelerate_config", "cli.yaml"]
    assert launch_config_file(both, str(tmp_path)) == (True, tmp_path / "cli.yaml")
    assert launch_config_file(["trl", "sft", "--config", "plain.yaml"], str(tmp_path))[1] != tmp_path / "fsdp.yaml"
    assert launch_config_file(["trl", "sft", "--config", "gone.yaml"], str(tmp_path))[0] is True


def test_trl_names_its_shipped_configs_by_name(tmp_path):
    pytest.importorskip("trl.accelerate_configs")
    from importlib import resources

    from fsdp_offload_cfg.discovery import launch_config_file

    shipped = Path(str(resources.files("trl.accelerate_configs").joinpath("fsdp2.yaml")))
    assert launch_config_file(["trl", "sft", "--accelerate_config", "fsdp2"], str(tmp_path)) == (True, shipped)


def test_discovery_order_argument_then_env_path_then_fsdp_env(tmp_path, monkeypatch: pytest.MonkeyPatch):
    env_file = tmp_path / "env.yaml"
    env_file.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  load_strategy: broadcast\n"
                        "  fsdp_cpu_ram_efficient_loading: true\n")
    arg_cfg, arg_source = discover_config({"version": 1}, {})
    assert arg_cfg.version == 1 and arg_source.startswith("argument")

    monkeypatch.setenv("FSDP_OFFLOAD_CFG", str(env_file))
    cfg, source = discover_config(None, {})
    assert cfg.cpu_ram_efficient_loading and str(env_file) in source

    monkeypatch.delenv("FSDP_OFFLOAD_CFG")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    cfg, source = discover_config(None, {})
    assert cfg.offload_params and "FSDP_*" in source

    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    cfg, source = discover_config(None, {})
    assert "no config found" in source and not integrations.fsdp_requested(cfg)


@pytest.mark.parametrize("world_size", ["", "1", "2"])
def test_no_config_under_a_launch_of_several_processes_says_how_to_name_the_file(world_size: str):
    """`torchrun --nproc_per_node 2 train.py` with the file forgotten: stock `Accelerator()` on a
    machine without a GPU ran each rank as a job of its own, and the example crashed on a
    checkpoint another rank was still writing; the one line said only "no config found yet"."""
    environ = {"WORLD_SIZE": world_size, "LOCAL_RANK": "0"} if world_size else {}
    cfg, source = discover_config(None, {}, environ=environ, launch=None)
    assert source.startswith("no config found yet") and not integrations.fsdp_requested(cfg)
    hint = "this is one of 2 launched processes: a config file reaches every rank as $FSDP_OFFLOAD_CFG=PATH"
    assert (hint in source) is (world_size == "2"), source


def test_no_config_in_a_process_no_launcher_started_says_how_to_launch_it(monkeypatch: Any, tmp_path: Path):
    """Plain `python train.py` with the file forgotten runs one process without FSDP, and the
    one line said only "no config found yet": now it gives the launch command, with the script
    as typed. A launcher's single worker (torchrun --nproc_per_node 1) gets no such line."""
    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.setattr("sys.argv", [str(script), "--lr", "1e-4"])
    cfg, source = discover_config(None, {}, environ={}, launch=None)
    assert source.startswith("no config found yet") and not integrations.fsdp_requested(cfg)
    assert source.endswith("; this process was started without a launcher (one process, no FSDP): to train with a "
                           "config file's fsdp_config, start it as `accelerate launch --config_file fsdp2.yaml "
                           f"{script} --lr 1e-4`"), source
    _, worker = discover_config(None, {}, environ={"WORLD_SIZE": "1", "LOCAL_RANK": "0"}, launch=None)
    assert "launcher" not in worker and "accelerate launch" not in worker, worker


def test_no_config_under_an_accelerate_launch_without_a_file_says_to_name_one():
    """`accelerate launch train.py` with no --config_file and no default file written by
    `accelerate config` runs accelerate's defaults (no FSDP); the line said only "no config
    found yet"."""
    launch = AccelerateLaunch(None, frozenset())
    cfg, source = discover_config(None, {}, environ={"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, launch=launch)
    assert source.startswith("no config found yet") and not integrations.fsdp_requested(cfg)
    assert "named no accelerate config file and found no default one: name it, `accelerate launch " \
           "--config_file fsdp2.yaml ...`" in source, source
    assert "one of 2 launched processes" not in source, source


# ---- precedence: patch() keywords > launch command line > file, wherever the file was named ----

LAUNCH_FILE = """distributed_type: FSDP
mixed_precision: 'no'
fsdp_config:
  fsdp_version: 2
  fsdp_activation_checkpointing: false
  fsdp_cpu_ram_efficient_loading: true
  activation_cpu_offload: true
"""
# What `accelerate launch --config_file f.yaml --mixed_precision fp16 --fsdp_activation_checkpointing true`
# exports: the flags' values, the file's others, and accelerate's own default for min_num_params.
LAUNCH_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_MIXED_PRECISION": "fp16",
              "FSDP_ACTIVATION_CHECKPOINTING": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
              "FSDP_MIN_NUM_PARAMS": "100000000"}
TYPED = AccelerateLaunch(None, frozenset({"mixed_precision", "activation_checkpointing"}))


@pytest.mark.parametrize("named", ["argument", "env", "launch"])
def test_command_line_flags_win_over_the_file_wherever_it_is_named(tmp_path, named: str):
    """The file named by `patch("f.yaml")` or `$FSDP_OFFLOAD_CFG` used to be taken as written,
    undoing the command line (the run had no checkpointing and no fp16)."""
    path = tmp_path / "f.yaml"
    path.write_text(LAUNCH_FILE)
    environ = dict(LAUNCH_ENV, **({"FSDP_OFFLOAD_CFG": str(path)} if named == "env" else {}))
    launch = AccelerateLaunch(path if named == "launch" else None, TYPED.typed)
    cfg, source = discover_config(path if named == "argument" else None, {}, environ=environ, launch=launch)
    assert (cfg.mixed_precision, cfg.activation_checkpointing) == ("fp16", True)
    assert cfg.activation_cpu_offload.enabled and cfg.cpu_ram_efficient_loading  # the file's other keys stay
    assert "overridden by the launch command line: activation_checkpointing: True (the file says False), " \
           "mixed_precision: 'fp16' (the file says 'no')" in source
    assert "min_num_params" not in source  # accelerate's own export of a key nobody typed: taken silently
    assert cfg.min_num_params == 100000000  # ... as accelerate itself runs with it


def test_nothing_typed_reports_no_override(tmp_path):
    path = tmp_path / "f.yaml"
    path.write_text(LAUNCH_FILE)
    environ = {**LAUNCH_ENV, "ACCELERATE_MIXED_PRECISION": "no", "FSDP_ACTIVATION_CHECKPOINTING": "false"}
    cfg, source = discover_config(None, {}, environ=environ, launch=AccelerateLaunch(path, frozenset()))
    assert "overridden" not in source, source
    assert (cfg.mixed_precision, cfg.activation_checkpointing) == ("no", False)


def test_patch_keywords_win_over_the_command_line(tmp_path):
    path = tmp_path / "f.yaml"
    path.write_text(LAUNCH_FILE)
    cfg, source = discover_config(path, {"mixed_precision": "bf16"}, environ=LAUNCH_ENV, launch=TYPED)
    assert (cfg.mixed_precision, cfg.activation_checkpointing) == ("bf16", True)
    assert "mixed_precision" not in source  # the keyword, not the launch, decided it


def test_the_merged_config_is_validated_again(tmp_path):
    """`--fsdp_version 1` over a file that asks for the FSDP2-only sharded loader: refused, as the
    file alone with version 1 would be, instead of a silently inconsistent config."""
    path = tmp_path / "f.yaml"
    path.write_text(LAUNCH_FILE.replace("  fsdp_version: 2\n", "  fsdp_version: 2\n  load_strategy: sharded\n"))
    environ = {**LAUNCH_ENV, "FSDP_VERSION": "1"}
    with pytest.raises(ConfigError, match="load_strategy") as info:
        discover_config(path, {}, environ=environ, launch=AccelerateLaunch(None, frozenset({"version"})))
    assert f"the accelerate launch: --fsdp_version ($FSDP_VERSION): 1 over {path}'s 2" in str(info.value)


def test_a_second_patch_does_not_read_the_first_ones_exports_as_the_launch(tmp_path):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text(LAUNCH_FILE.replace("fsdp_activation_checkpointing: false", "fsdp_activation_checkpointing: true"))
    second.write_text(LAUNCH_FILE)
    assert fsdp_offload_cfg.patch(first).config.activation_checkpointing is True
    assert os.environ["FSDP_ACTIVATION_CHECKPOINTING"] == "true"  # exported for processes it starts
    session = fsdp_offload_cfg.patch(second)
    assert session.config.activation_checkpointing is False and "overridden" not in session.source


@pytest.mark.parametrize(
    "cmdline, typed",
    [
        (["accelerate", "launch", "--config_file", "f.yaml", "--mixed_precision", "fp16",
          "--fsdp_activation_checkpointing", "true", "train.py", "--mixed_precision", "no"],
         {"mixed_precision", "activation_checkpointing"}),
        (["python", "-m", "accelerate.commands.launch", "--fsdp-version=2", "--cpu", "-m", "pkg.train"],
         {"version", "use_cpu"}),
        (["accelerate", "launch", "train.py"], set()),
    ],
)
def test_typed_launch_flags_stop_at_the_script(cmdline: list[str], typed: set[str]):
    assert typed_launch_keys(cmdline) == typed


def test_keyword_overrides_reach_the_config():
    session = fsdp_offload_cfg.patch(EVERYTHING_ON, activation_cpu_offload=False)
    assert session.config.activation_cpu_offload.enabled is False
    assert session.config.cpu_ram_efficient_loading is True


def test_fsdp1_sync_module_states_on_cpu_is_refused_before_patching():
    before = _snapshot()
    cfg = FSDPOffloadConfig(distributed_type="FSDP", version=1, reshard_after_forward="FULL_SHARD",
                            sync_module_states=True, source="x.yaml")
    with pytest.raises(ConfigError, match=r"x.yaml: fsdp_config.sync_module_states: FSDP1 on a CPU-only"):
        fsdp_offload_cfg.patch(cfg)
    assert _snapshot() == before
    fsdp_offload_cfg.patch(dataclasses.replace(cfg, sync_module_states=False))


def test_failing_repatch_keeps_the_working_patch():
    """All or nothing: a second config this machine cannot run is refused, and the first stays."""
    session = fsdp_offload_cfg.patch(EVERYTHING_ON)
    patched = _snapshot()
    env = dict(os.environ)
    unrunnable = FSDPOffloadConfig(distributed_type="FSDP", version=1, reshard_after_forward="FULL_SHARD",
                                   sync_module_states=True, source="b.yaml")
    with pytest.raises(ConfigError, match=r"b\.yaml: fsdp_config\.sync_module_states"):
        fsdp_offload_cfg.patch(unrunnable)
    assert fsdp_offload_cfg.active_config() is session.config
    assert _snapshot() == patched
    assert dict(os.environ) == env


def test_failing_install_during_repatch_restores_the_previous_patch(monkeypatch: pytest.MonkeyPatch):
    originals = _snapshot()
    names = fsdp_offload_cfg.patch(EVERYTHING_ON).patch_names

    def broken_builder(original: Any, cfg: Any) -> Any:
        raise RuntimeError("builder failed")

    failing = patching.Patch("failing", "accelerate.accelerator", "Accelerator.prepare", broken_builder,
                             lambda c, ctx: c.version == 1, ("accelerate",), "fails while installing")
    monkeypatch.setattr(integrations, "PATCHES", [*integrations.PATCHES, failing])
    with pytest.raises(RuntimeError, match="builder failed"):
        fsdp_offload_cfg.patch(FSDP1_OFFLOAD)
    assert fsdp_offload_cfg.active_config() == EVERYTHING_ON
    assert registry.active().patch_names == names
    now = _snapshot(integrations.PATCHES[:-1])
    def targets(patch_names: Any) -> set[tuple[str, str]]:  # two patches may share one (prepare_model)
        return {(p.module, p.attribute) for p in integrations.PATCHES[:-1] if p.name in patch_names}

    assert targets({n for n in now if now[n] is not originals[n]}) == targets(names)  # re-installed, not left bare
    fsdp_offload_cfg.unpatch()
    assert _snapshot(integrations.PATCHES[:-1]) == originals


def test_patch_after_accelerator_is_refused(monkeypatch: pytest.MonkeyPatch):
    from accelerate.state import AcceleratorState

    before = _snapshot()
    monkeypatch.setattr(AcceleratorState, "_shared_state", {"initialized": True})
    with pytest.raises(RuntimeError, match=r"after Accelerator\(\) was created.*Call fsdp_offload_cfg.patch\(\) first"):
        fsdp_offload_cfg.patch(EVERYTHING_ON)
    assert _snapshot() == before
    assert fsdp_offload_cfg.active_config() is None


# -------------------------------------------------------------------------------------------
# The Trainer's fsdp_config, the exported environment, the module graph
# -------------------------------------------------------------------------------------------


@pytest.fixture
def single_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Any):
    """TrainingArguments sets up its device for real: one process, no launcher, no rendezvous."""
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("LOCAL_RANK")
    return {"output_dir": str(tmp_path / "out"), "use_cpu": True, "report_to": []}


def test_the_trainer_switches_the_config_without_unpatching_itself(single_process: dict):
    from transformers import TrainingArguments

    session = fsdp_offload_cfg.patch(EVERYTHING_ON)
    trainer_patch = TrainingArguments.__dict__["__post_init__"]
    TrainingArguments(fsdp=True, fsdp_config={"version": 2, "activation_cpu_offload": {"mode": "sync"}},
                      **single_process)
    assert TrainingArguments.__dict__["__post_init__"] is trainer_patch  # still the one that ran
    assert fsdp_offload_cfg.active_config().source == "TrainingArguments.fsdp_config"
    assert fsdp_offload_cfg.active_config().activation_cpu_offload.mode == "sync"
    assert "loader-from-pretrained" not in session.patch_names  # the Trainer's config has no RAM-efficient loading
    assert os.environ["FSDP_ACTIVATION_CPU_OFFLOAD"] == '{"enabled": true, "max_pinned_bytes": null, ' \
        '"min_tensor_bytes": 1024, "mode": "sync", "offload_last_group": false, "prefetch_groups": 1}'
    fsdp_offload_cfg.unpatch()
    assert "FSDP_ACTIVATION_CPU_OFFLOAD" not in os.environ
    assert TrainingArguments.__dict__["__post_init__"] is not trainer_patch


def test_the_trainers_config_says_that_it_is_on(single_process: dict):
    """under `swift sft` / `llamafactory-cli` the only line was "no config found", printed
    before the trainer arguments existed; the switch to their fsdp_config logged nothing."""
    from transformers import TrainingArguments

    with MessageLog() as lines:
        fsdp_offload_cfg.patch()
        TrainingArguments(fsdp=True, fsdp_config={"version": 2, "activation_cpu_offload": True}, **single_process)
    assert any(line.startswith("no config found yet") and "TrainingArguments" in line for line in lines), lines
    assert any(line.startswith("config from TrainingArguments.fsdp_config (FSDP2, meta loading: off, activation "
                               "offload: on); patches: ") for line in lines), lines


def test_a_training_arguments_made_after_the_accelerator_does_not_switch_the_config(single_process: dict):
    """a second TrainingArguments (a framework's copy, an eval run) switched the patches
    under an Accelerator that had already read the first config."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import TrainingArguments

    session = fsdp_offload_cfg.patch(EVERYTHING_ON)
    names = list(session.patch_names)
    try:
        Accelerator(cpu=True)
        TrainingArguments(fsdp=True, fsdp_config={"version": 2, "activation_cpu_offload": False}, **single_process)
        assert fsdp_offload_cfg.active_config() is EVERYTHING_ON and session.patch_names == names
    finally:
        AcceleratorState._reset_state(True)


def test_a_config_for_fsdp2_in_a_process_no_launcher_started_says_that_none_of_it_applies(tmp_path: Path,
                                                                                          monkeypatch: Any):
    """`FSDP_OFFLOAD_CFG=fsdp2.yaml python train.py`: accelerate reads a config file only in
    `accelerate launch`, so the process ran alone (distributed_type NO) with no sharding and no
    offload (the offload's summary: 0 bytes), while rank 0's line said "activation offload: on".
    (FSDP1 is not here: without a GPU its plugin stops `Accelerator()` itself, "no available devices".)"""
    import logging

    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    for name in ("WORLD_SIZE", "LOCAL_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "fsdp.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  activation_cpu_offload: true\n")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "my_train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["scripts/my_train.py", "--lr", "1e-4", "--run-name", "a b"])
    fsdp_offload_cfg.patch(str(path))
    try:
        with MessageLog(level=logging.WARNING) as lines:
            accelerator = Accelerator(cpu=True)
            model = torch.nn.Linear(4, 4)
            model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
            accelerator.prepare(torch.nn.Linear(4, 4))  # a second model: said once
    finally:
        AcceleratorState._reset_state(True)
    said = [line for line in lines if "but the Accelerator preparing the model runs without it" in line]
    assert len(said) == 1, lines
    assert said[0].startswith(f"{path} asks for FSDP2, ") and "(distributed_type NO, 1 process)" in said[0]
    # the command to copy: the script where the user typed it, with its arguments
    assert f"start it as `accelerate launch --config_file {path} scripts/my_train.py --lr 1e-4 --run-name 'a b'`" \
        in said[0]


@pytest.mark.parametrize("kernel", [False, True])
def test_the_command_to_copy_names_a_script_where_the_process_has_none(kernel: bool, tmp_path: Path,
                                                                       monkeypatch: Any):
    """`python -c` has no script, and a notebook kernel's launcher (a file that exists) takes the
    kernel's arguments: neither is what `accelerate launch` should run, so the command names
    `train.py` for the user's script."""
    from fsdp_offload_cfg._script import this_script_command

    argv = ["-c"]
    if kernel:
        argv = [str(tmp_path / "ipykernel_launcher.py"), "-f", "kernel.json"]
        Path(argv[0]).write_text("")
    monkeypatch.setattr("sys.argv", argv)
    assert this_script_command() == "train.py"


def test_trainer_config_errors_name_the_training_arguments(single_process: dict, tmp_path: Any):
    from transformers import TrainingArguments

    fsdp_offload_cfg.patch(EVERYTHING_ON)
    with pytest.raises(ConfigError, match=r"^TrainingArguments: fsdp_config\.activaton_cpu_offload: unknown key"):
        TrainingArguments(fsdp=True, fsdp_config={"activaton_cpu_offload": True}, **single_process)
    path = tmp_path / "fsdp.json"
    path.write_text('{"fsdp_version": 3}')
    with pytest.raises(ConfigError, match=rf"^TrainingArguments\(fsdp_config='{path}'\): fsdp_config\.fsdp_version: expected 1 or 2"):
        TrainingArguments(fsdp=True, fsdp_config=str(path), **single_process)


def test_patch_exports_the_plugins_own_keys_and_restores_them():
    config = dataclasses.replace(EVERYTHING_ON, load_strategy="sharded")
    fsdp_offload_cfg.patch(config)
    assert os.environ["FSDP_ACTIVATION_CPU_OFFLOAD"] == "true"
    assert os.environ["FSDP_LOAD_STRATEGY"] == "sharded"
    from fsdp_offload_cfg.config import config_from_env

    assert dataclasses.replace(config_from_env(), num_processes=None, use_cpu=None) == config  # + the launcher's
    fsdp_offload_cfg.unpatch()
    assert "FSDP_LOAD_STRATEGY" not in os.environ


HSDP_FILE = ("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\nparallelism_config:\n"
             "  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 4\n")


def test_the_files_parallelism_config_reaches_accelerate_as_a_launch_hands_it_over(tmp_path: Any):
    """Under torchrun or `patch("F")` in a plain script nobody exported the section: a file asking
    for HSDP (2 replicas x 4 shards) ran as plain FSDP without a word. accelerate's own
    `ParallelismConfig()` (what an `Accelerator` without the argument builds) now reads the file's
    sizes; `unpatch()` takes them back."""
    from accelerate.parallelism_config import ParallelismConfig

    path = tmp_path / "hsdp.yaml"
    path.write_text(HSDP_FILE)
    fsdp_offload_cfg.patch(path)
    assert os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    read = ParallelismConfig()
    assert (read.dp_replicate_size, read.dp_shard_size, read.tp_size) == (2, 4, 1)
    fsdp_offload_cfg.unpatch()
    assert not any(k.startswith(("PARALLELISM_CONFIG_", "ACCELERATE_USE_PARALLELISM")) for k in os.environ)


def test_a_launchs_parallelism_and_dynamo_config_are_left_as_the_launch_set_them(tmp_path: Any, monkeypatch: pytest.MonkeyPatch):
    """`accelerate launch --parallelism_config_dp_shard_size 8` over the same file: the launch
    exported the file's section with its command line over it; the file must not undo that."""
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "8")
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")  # --dynamo_backend no over the file's inductor
    path = tmp_path / "hsdp.yaml"
    path.write_text(HSDP_FILE + "dynamo_config:\n  dynamo_backend: INDUCTOR\n")
    fsdp_offload_cfg.patch(path)
    assert (os.environ["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], os.environ["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) \
        == ("1", "8")
    assert os.environ["ACCELERATE_DYNAMO_BACKEND"] == "NO"


def test_the_files_debug_and_cpu_affinity_reach_accelerate_as_a_launch_hands_them_over(tmp_path: Any):
    """`debug: true` (accelerate's checks that every rank's collectives match) and
    `enable_cpu_affinity: true` did nothing under torchrun or `patch("F")`: only `accelerate
    launch` exported them. accelerate's `PartialState` reads them with `parse_flag_from_env`."""
    from accelerate.utils import parse_flag_from_env

    path = tmp_path / "f.yaml"
    path.write_text("distributed_type: FSDP\ndebug: true\nenable_cpu_affinity: true\nfsdp_config:\n  fsdp_version: 2\n")
    fsdp_offload_cfg.patch(path)
    assert parse_flag_from_env("ACCELERATE_DEBUG_MODE") and parse_flag_from_env("ACCELERATE_CPU_AFFINITY")
    fsdp_offload_cfg.unpatch()
    assert "ACCELERATE_DEBUG_MODE" not in os.environ and "ACCELERATE_CPU_AFFINITY" not in os.environ
    path.write_text("distributed_type: FSDP\ndebug: false\nfsdp_config:\n  fsdp_version: 2\n")
    fsdp_offload_cfg.patch(path)
    assert "ACCELERATE_DEBUG_MODE" not in os.environ and "ACCELERATE_CPU_AFFINITY" not in os.environ


def test_accelerate_launchs_own_spelling_of_its_flags_reads_back(tmp_path: Any):
    """`accelerate launch --enable_cpu_affinity --debug` exports ACCELERATE_CPU_AFFINITY=1 and
    ACCELERATE_DEBUG_MODE=true: read as the flags they are, and named as the flags typed over a
    file that says false."""
    path = tmp_path / "f.yaml"
    path.write_text(LAUNCH_FILE + "debug: false\nenable_cpu_affinity: false\n")
    environ = {**LAUNCH_ENV, "ACCELERATE_MIXED_PRECISION": "no", "FSDP_ACTIVATION_CHECKPOINTING": "false",
               "ACCELERATE_CPU_AFFINITY": "1", "ACCELERATE_DEBUG_MODE": "true"}
    cmdline = ["accelerate", "launch", "--debug", "--enable_cpu_affinity", "train.py"]
    cfg, source = discover_config(None, {}, environ=environ, launch=AccelerateLaunch(path, typed_launch_keys(cmdline)))
    assert (cfg.debug, cfg.enable_cpu_affinity) == (True, True)
    assert "overridden by the launch command line: debug: True (the file says False), enable_cpu_affinity: " \
           "True (the file says False)" in source, source


def test_the_files_dynamo_config_reaches_accelerate_as_a_launch_hands_it_over(tmp_path: Any):
    """The same for compilation: a file asking for regional compilation ran eagerly under torchrun."""
    from accelerate.utils import TorchDynamoPlugin

    path = tmp_path / "compiled.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\ndynamo_config:\n  dynamo_backend: inductor\n"
                    "  use_regional_compilation: true\n")
    fsdp_offload_cfg.patch(path)
    read = TorchDynamoPlugin()
    assert (read.backend.value, read.use_regional_compilation, read.mode) == ("INDUCTOR", True, "default")
    fsdp_offload_cfg.unpatch()
    assert TorchDynamoPlugin().backend.value == "NO"


def test_the_same_settings_from_another_path_do_not_repatch(tmp_path: Any, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "a.yaml").write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
                                     "  fsdp_activation_cpu_offload: true\n")
    monkeypatch.chdir(tmp_path)
    first = fsdp_offload_cfg.patch("a.yaml")
    installed = importlib.import_module("accelerate.accelerator").fsdp2_prepare_model
    assert fsdp_offload_cfg.patch("./a.yaml") is first
    assert importlib.import_module("accelerate.accelerator").fsdp2_prepare_model is installed


def _imports(module: str) -> set[str]:
    """Every fsdp_offload_cfg module `module` imports, function-local imports included."""
    import ast

    spec = importlib.util.find_spec(module)
    tree = ast.parse(open(spec.origin).read())  # noqa: SIM115
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return {n for n in names if n.startswith("fsdp_offload_cfg")}


def test_the_patch_modules_import_in_one_direction():
    """patching -> integrations -> registry; no cycle hidden in a function-local import."""
    assert not any(n.startswith("fsdp_offload_cfg.patching") for n in _imports("fsdp_offload_cfg.integrations"))
    registry_imports = _imports("fsdp_offload_cfg.registry")
    assert not any(n.startswith(("fsdp_offload_cfg.patching", "fsdp_offload_cfg.integrations")) for n in registry_imports)
    config_imports = set().union(*(_imports(f"fsdp_offload_cfg.config.{m}")
                                   for m in ("keys", "model", "schema", "reading", "sources", "rules")))
    assert not any(n.startswith(("fsdp_offload_cfg.patching", "fsdp_offload_cfg.integrations",
                                 "fsdp_offload_cfg.registry")) for n in config_imports)


def test_unpatch_removes_the_offload_it_enabled_and_dynamos_registration():
    """the dynamo config `enable_activation_offload` extends stayed extended after
    `unpatch()`, and the models prepared under the patch kept their hooks."""
    import torch._dynamo

    from fsdp_offload_cfg.offload import get_offload_handle
    from fsdp_offload_cfg.offload.api import _whole_model_compile_notice
    from fsdp_offload_cfg.testing.offload_models import tiny_llama

    registered = torch._dynamo.config.reorderable_logging_functions
    before = set(registered)
    fsdp_offload_cfg.patch(EVERYTHING_ON)
    model = tiny_llama(2)
    integrations.enable_offload(model, fsdp_offload_cfg.active_config())  # what the prepare patch calls
    assert get_offload_handle(model) is not None and _whole_model_compile_notice in registered
    fsdp_offload_cfg.unpatch()
    assert get_offload_handle(model) is None and "forward" not in model.__dict__
    assert set(registered) == before


@pytest.mark.fresh_python
def test_patch_imports_no_framework_and_patches_it_when_it_is_imported():
    """`patch()` imported TRL (and PEFT) itself, before a framework imported later could
    set up what TRL caches at its import (LlamaFactory's shim of transformers' package checks).
    It also imported the Trainer's `training_args`, which imports PEFT: about 1.7 CPU-s on every
    rank of a script that never builds a Trainer (a third of what `patch()` imported)."""
    import subprocess
    import sys

    pytest.importorskip("trl")  # not on Python 3.10 (TRL 1.15+ needs 3.11)

    code = """
import os, sys
os.environ.update(WORLD_SIZE="2", LOCAL_RANK="0")
import fsdp_offload_cfg
session = fsdp_offload_cfg.patch({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2,
                                  "fsdp_cpu_ram_efficient_loading": True}})
assert not {"trl", "peft", "transformers.training_args", "transformers.trainer"} & set(sys.modules), sorted(
    m for m in sys.modules if m.startswith(("trl", "peft", "transformers.train")))
assert {"trl-prepare-fsdp", "peft-adapters-on-host", "trainer-fsdp-config"} <= set(session.patch_names), session.patch_names
from transformers import TrainingArguments
assert hasattr(TrainingArguments.__post_init__, "__wrapped__")
import trl.models.utils as utils
from trl.models import prepare_fsdp
from peft.tuners.tuners_utils import BaseTuner
assert prepare_fsdp is utils.prepare_fsdp and hasattr(prepare_fsdp, "__wrapped__"), prepare_fsdp
assert hasattr(BaseTuner.inject_adapter, "__wrapped__")
fsdp_offload_cfg.unpatch()
assert not hasattr(utils.prepare_fsdp, "__wrapped__") and not hasattr(BaseTuner.inject_adapter, "__wrapped__")
assert not hasattr(TrainingArguments.__post_init__, "__wrapped__")
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_", "WORLD_SIZE", "LOCAL_RANK"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.fresh_python
def test_patch_in_a_launcher_imports_neither_the_models_nor_dynamo_until_a_model_is_loaded():
    """Under `fsdp-offload-cfg run` `patch()` runs in every Python process but the launchers
    themselves, the framework front ends that start them too (`swift sft`, `trl sft`), which never
    load a model; torchrun's module stands for what such a front end imports. It imported transformers'
    `modeling_utils` (and with it dynamo and the kernels' integrations), through a decorator
    of the budget dynamo again, and to check that FSDP2's `fully_shard` is there FSDP2 and DTensor
    (sympy with it). The models' patches now go in when `modeling_utils` is imported, as a training
    script does next; `fully_shard` is checked when FSDP2 is imported. CPU-s per launcher process:
    `benchmarks/launcher_patch.py` (docs/benchmarks.md)."""
    import subprocess
    import sys

    code = """
import os, sys
os.environ.update(WORLD_SIZE="2", LOCAL_RANK="0")
import torch.distributed.run  # what torchrun's agent imports
import accelerate.accelerator, accelerate.utils.fsdp_utils  # what the accelerate patches' targets import
before = set(sys.modules)
import fsdp_offload_cfg
session = fsdp_offload_cfg.patch({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2,
    "fsdp_cpu_ram_efficient_loading": True, "fsdp_activation_cpu_offload": True,
    "fsdp_activation_memory_budget": "4GiB"}})
heavy = {"transformers.modeling_utils", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor", "sympy"}
assert not heavy & (set(sys.modules) - before), sorted(heavy & set(sys.modules))
names = {"loader-from-pretrained", "rank0-from-config", "resize-token-embeddings", "save-pretrained-sharded"}
assert names <= set(session.patch_names), session.patch_names
from transformers import PreTrainedModel
ours = {name: PreTrainedModel.__dict__[name] for name in ("from_pretrained", "save_pretrained")}
originals = {"from_pretrained": ours["from_pretrained"].__func__.__wrapped__,  # each wraps the original
             "save_pretrained": ours["save_pretrained"].__wrapped__}
assert [getattr(f, "__module__", "") for f in originals.values()] == ["transformers.modeling_utils"] * 2, originals
fsdp_offload_cfg.unpatch()
assert PreTrainedModel.__dict__["from_pretrained"].__func__ is originals["from_pretrained"]
assert PreTrainedModel.__dict__["save_pretrained"] is originals["save_pretrained"]
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_", "WORLD_SIZE", "LOCAL_RANK"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.fresh_python
def test_a_missing_swap_target_stops_the_import_that_installs_the_loader():
    """The loader's patch goes in when `modeling_utils` is imported (the test above): the
    functions it swaps during a load are checked then, as `patch()` checks them where
    `modeling_utils` is already imported, and the import stops naming the missing one."""
    import subprocess
    import sys

    from fsdp_offload_cfg.compat.checkpoint_reading import swap_targets

    elsewhere = [(m, a) for m, a in swap_targets() if m != "transformers.modeling_utils"]
    if not elsewhere:
        pytest.skip("every function the loader swaps lives in modeling_utils in this transformers")
    module, attribute = elsewhere[0]
    code = f"""
import importlib, sys
owner = importlib.import_module({module!r})
assert "transformers.modeling_utils" not in sys.modules
delattr(owner, {attribute!r})
import fsdp_offload_cfg
fsdp_offload_cfg.patch({{"distributed_type": "FSDP", "fsdp_config": {{"fsdp_version": 2,
    "fsdp_cpu_ram_efficient_loading": True, "load_strategy": "sharded"}}}})
try:
    import transformers.modeling_utils
except fsdp_offload_cfg.UnsupportedVersionError as error:
    print(error)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == (f"patch 'loader-from-pretrained' replaces or calls {module}.{attribute} while it "
                                   "runs, and the installed version does not have it; this release of "
                                   "fsdp_offload_cfg does not support it"), proc.stdout + proc.stderr[-3000:]


@pytest.mark.fresh_python
@pytest.mark.parametrize("unpatched_first", [False, True], ids=["patched", "after-unpatch"])
def test_a_swapped_function_of_a_module_not_yet_imported_is_checked_at_its_import(unpatched_first: bool):
    """FSDP2's `fully_shard`, which the prepare patches swap, is checked when FSDP2 is imported
    (in a training process: with transformers' models, or at `prepare`), not imported by
    `patch()` to be checked (the launcher test above). A torch without it stops that import naming
    the patch; after `unpatch()` nothing is checked any more."""
    import subprocess
    import sys

    code = f"""
import sys
import torch.distributed.run, accelerate.accelerator, accelerate.utils.fsdp_utils
if "torch.distributed.fsdp" in sys.modules:
    print("already imported")
    sys.exit(0)
import fsdp_offload_cfg
from fsdp_offload_cfg import post_import
post_import.when_imported("torch.distributed.fsdp", lambda m: delattr(m, "fully_shard"))  # a torch without it
fsdp_offload_cfg.patch({{"distributed_type": "FSDP", "fsdp_config": {{"fsdp_version": 2}}}})
if {unpatched_first}:
    fsdp_offload_cfg.unpatch()
try:
    import torch.distributed.fsdp
except fsdp_offload_cfg.UnsupportedVersionError as error:
    print(error)
else:
    print("imported")
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_", "WORLD_SIZE", "LOCAL_RANK"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if proc.stdout.strip() == "already imported":
        pytest.skip("accelerate's own modules import FSDP2 in this version: checked at patch() (the test above)")
    expected = "imported" if unpatched_first else (
        "patch 'fsdp2-prepare-model' replaces or calls torch.distributed.fsdp.fully_shard while it runs, and the "
        "installed version does not have it; this release of fsdp_offload_cfg does not support it")
    assert proc.stdout.strip() == expected, proc.stdout + proc.stderr[-3000:]


def test_our_loggers_keep_their_info_lines_under_a_framework_logger_class():
    """axolotl installs a logger class that filters every logger created afterwards to warnings
    (its `AxolotlLogger`): our loggers, created after it when axolotl imports our plugin, dropped
    the line saying the plugin is on. A filter a user adds afterwards stays."""
    import logging

    from fsdp_offload_cfg._logging import get_logger

    class Quiet(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return record.levelno >= logging.WARNING

    class FrameworkLogger(logging.Logger):
        def __init__(self, name: str, level: int = logging.NOTSET) -> None:
            super().__init__(name, level)
            self.addFilter(Quiet())

    previous = logging.getLoggerClass()
    logging.setLoggerClass(FrameworkLogger)
    try:
        logger = get_logger("fsdp_offload_cfg.test_framework_logger_class")
    finally:
        logging.setLoggerClass(previous)
    assert isinstance(logger, FrameworkLogger) and logger.filters == []
    user_filter = Quiet()
    logger.addFilter(user_filter)
    assert get_logger("fsdp_offload_cfg.test_framework_logger_class").filters == [user_filter]


def test_our_lines_go_to_stderr_as_it_is_when_they_are_logged(monkeypatch):
    """The handler bound the stream of its first import: under pytest that was a capture file,
    closed by the time the offload's exit summary logged ("I/O operation on closed file");
    axolotl's tee of stderr into its debug.log never saw our lines."""
    import io
    import sys

    from fsdp_offload_cfg._logging import get_logger

    first, now = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    logger = get_logger("fsdp_offload_cfg.test_stderr")
    first.close()
    monkeypatch.setattr(sys, "stderr", now)
    logger.warning("said after stderr was swapped")
    assert "said after stderr was swapped" in now.getvalue()
