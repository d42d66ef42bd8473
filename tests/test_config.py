"""load_config / config_from_env / the schema: every key, every source, every rule, every error."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_offload_cfg.config import (
    ActivationOffloadConfig,
    ConfigError,
    FSDPOffloadConfig,
    Problem,
    config_from_env,
    load_config,
    normalized_dict,
    schema,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def problems_of(source: Any, overrides: Any = None) -> list[Problem]:
    with pytest.raises(ConfigError) as info:
        load_config(source, overrides)
    return info.value.problems


def only_problem(source: Any, overrides: Any = None) -> Problem:
    problems = problems_of(source, overrides)
    assert len(problems) == 1, problems
    return problems[0]


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
gpu_ids: all
machine_rank: 0
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
use_cpu: false
fsdp_config:
{fsdp}"""


# -------------------------------------------------------------------------------------------
# every key: good values
# -------------------------------------------------------------------------------------------

GOOD = [
    ({"version": 1}, "version", 1),
    ({"version": "2"}, "version", 2),
    ({"reshard_after_forward": "false"}, "reshard_after_forward", False),
    ({"reshard_after_forward": True}, "reshard_after_forward", True),
    ({"version": 1, "reshard_after_forward": "shard_grad_op"}, "reshard_after_forward", "SHARD_GRAD_OP"),
    ({"version": 1, "reshard_after_forward": 4}, "reshard_after_forward", "HYBRID_SHARD"),
    ({"version": 1}, "reshard_after_forward", "FULL_SHARD"),  # FSDP1 default
    ({"version": 1, "sharding_strategy": "HYBRID_SHARD"}, "sharding_strategy", "HYBRID_SHARD"),
    ({"version": 1, "sharding_strategy": 5}, "sharding_strategy", "HYBRID_SHARD_ZERO2"),
    ({"version": 1, "sharding_strategy": "3"}, "sharding_strategy", "NO_SHARD"),
    ({"offload_params": True}, "offload_params", True),
    ({"offload_params": "TRUE"}, "offload_params", True),
    ({"auto_wrap_policy": "size_based_wrap"}, "auto_wrap_policy", "SIZE_BASED_WRAP"),
    ({"auto_wrap_policy": "NO_WRAP"}, "auto_wrap_policy", "NO_WRAP"),
    ({"transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}, "transformer_layer_cls_to_wrap", ("LlamaDecoderLayer",)),
    ({"transformer_layer_cls_to_wrap": "BertLayer,BertEmbeddings"}, "transformer_layer_cls_to_wrap", ("BertLayer", "BertEmbeddings")),
    ({"transformer_layer_cls_to_wrap": ["T5Block", "T5Stack"]}, "transformer_layer_cls_to_wrap", ("T5Block", "T5Stack")),
    ({"min_num_params": 0}, "min_num_params", 0),
    ({"min_num_params": "100000000"}, "min_num_params", 100_000_000),
    ({"min_num_params": 1e8}, "min_num_params", 100_000_000),  # omegaconf reads `1e8` as a float
    ({"version": 1, "backward_prefetch": "backward_pre"}, "backward_prefetch", "BACKWARD_PRE"),
    ({"version": 1, "backward_prefetch": 2}, "backward_prefetch", "BACKWARD_POST"),
    ({"version": 1, "backward_prefetch": "NO_PREFETCH"}, "backward_prefetch", "NO_PREFETCH"),
    ({"version": 1, "forward_prefetch": "true"}, "forward_prefetch", True),
    ({"state_dict_type": "sharded_state_dict"}, "state_dict_type", "SHARDED_STATE_DICT"),
    ({"state_dict_type": 1}, "state_dict_type", "FULL_STATE_DICT"),
    ({"version": 1, "state_dict_type": "LOCAL_STATE_DICT"}, "state_dict_type", "LOCAL_STATE_DICT"),
    ({"use_orig_params": "False"}, "use_orig_params", False),
    ({"cpu_ram_efficient_loading": True}, "cpu_ram_efficient_loading", True),
    ({"sync_module_states": False}, "sync_module_states", False),
    ({"activation_checkpointing": "true"}, "activation_checkpointing", True),
    ({"activation_checkpointing": True, "activation_checkpointing_offload": True}, "activation_checkpointing_offload", True),
    ({"ignored_modules": r"model\.vision_tower\..*"}, "ignored_modules", r"model\.vision_tower\..*"),
    ({"activation_cpu_offload": True}, "activation_cpu_offload", ActivationOffloadConfig(enabled=True)),
    ({"activation_cpu_offload": "false"}, "activation_cpu_offload", ActivationOffloadConfig(enabled=False)),
    ({"activation_cpu_offload": {"mode": "SYNC"}}, "activation_cpu_offload", ActivationOffloadConfig(enabled=True, mode="sync")),
    ({"activation_cpu_offload": {"enabled": "false", "prefetch_groups": 2}}, "activation_cpu_offload",
     ActivationOffloadConfig(enabled=False, prefetch_groups=2)),
    ({"activation_cpu_offload": {"min_tensor_bytes": 0, "max_pinned_bytes": 1 << 30, "offload_last_group": True}},
     "activation_cpu_offload",
     ActivationOffloadConfig(enabled=True, min_tensor_bytes=0, max_pinned_bytes=1 << 30, offload_last_group=True)),
    ({"activation_cpu_offload": {"max_pinned_bytes": None}}, "activation_cpu_offload", ActivationOffloadConfig(enabled=True)),
    ({"cpu_ram_efficient_loading": True, "load_strategy": "sharded"}, "load_strategy", "sharded"),
    ({"activation_memory_budget": "12GiB"}, "activation_memory_budget", "12GiB"),
    ({"activation_memory_budget": "4096"}, "activation_memory_budget", 4096),
    ({"activation_memory_budget": "1.5 gb"}, "activation_memory_budget", "1.5 gb"),
    ({"activation_memory_budget": "auto"}, "activation_memory_budget", "auto"),
    ({"activation_memory_budget": "auto-2GiB", "activation_budget_device_memory": "80GiB"},
     "activation_budget_device_memory", "80GiB"),
    ({"activation_memory_budget": "8GiB", "activation_budget_compute_tflops": "0.05"}, "activation_budget_compute_tflops",
     0.05),
    ({"activation_memory_budget": "8GiB", "activation_budget_copy_gb_per_s": 55}, "activation_budget_copy_gb_per_s", 55),
    ({"activation_memory_budget": "8GiB", "activation_budget_copy_gb_per_s": "5e1"}, "activation_budget_copy_gb_per_s",
     50.0),
    ({"cpu_ram_efficient_loading": True, "load_strategy": "BROADCAST"}, "load_strategy", "broadcast"),
    ({"expandable_segments": "false"}, "expandable_segments", False),
    ({"activation_cpu_offload": True, "expandable_segments": None}, "expandable_segments", None),  # unset: auto
    ({"cpu_offload": True}, "offload_params", True),  # transformers' spelling
    ({"xla": False, "xla_fsdp_v2": False, "xla_fsdp_grad_ckpt": "false", "limit_all_gathers": True,
      "xla_fsdp_settings": {"compute_dtype": "bfloat16"}}, "version", 2),  # Trainer keys: accepted, not used
]


@pytest.mark.parametrize(("mapping", "field", "expected"), GOOD, ids=[f"{f}={m}" for m, f, _ in GOOD])
def test_good_value(mapping: dict, field: str, expected: Any):
    config = load_config(mapping)
    assert getattr(config, field) == expected
    assert type(getattr(config, field)) is type(expected)


# -------------------------------------------------------------------------------------------
# every key: bad values (path and what was expected)
# -------------------------------------------------------------------------------------------

BAD = [
    ({"version": 3}, "version", "expected 1 or 2; got 3"),
    ({"version": "two"}, "version", 'expected 1 or 2; got "two"'),
    ({"reshard_after_forward": "sometimes"}, "reshard_after_forward", "expected true or false (FSDP2)"),
    ({"version": 1, "sharding_strategy": "FULL"}, "sharding_strategy", "one of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD"),
    ({"version": 1, "sharding_strategy": 6}, "sharding_strategy", "or its number 1-5"),
    ({"offload_params": "maybe"}, "offload_params", 'expected true or false (a boolean, or the string "true"/"false"); got "maybe"'),
    ({"offload_params": 1}, "offload_params", "expected true or false"),
    ({"auto_wrap_policy": "LAYER_WRAP"}, "auto_wrap_policy", "one of TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP"),
    ({"transformer_layer_cls_to_wrap": "BertLayer, BertEmbeddings"}, "transformer_layer_cls_to_wrap", "without spaces"),
    ({"transformer_layer_cls_to_wrap": []}, "transformer_layer_cls_to_wrap", "a list of class names"),
    ({"transformer_layer_cls_to_wrap": 3}, "transformer_layer_cls_to_wrap", "got 3"),
    ({"min_num_params": -1}, "min_num_params", "expected an integer >= 0; got -1"),
    ({"min_num_params": "many"}, "min_num_params", "an integer >= 0"),
    ({"min_num_params": True}, "min_num_params", "an integer >= 0; got true"),
    ({"version": 1, "backward_prefetch": "BACKWARD_BOTH"}, "backward_prefetch", "BACKWARD_PRE, BACKWARD_POST, NO_PREFETCH"),
    ({"state_dict_type": "FULL"}, "state_dict_type", "FULL_STATE_DICT, LOCAL_STATE_DICT, SHARDED_STATE_DICT"),
    ({"use_orig_params": "yes please"}, "use_orig_params", "expected true or false"),
    ({"ignored_modules": "vision_tower("}, "ignored_modules", "expected a valid regular expression"),
    ({"ignored_modules": ""}, "ignored_modules", "a non-empty regular expression"),
    ({"activation_cpu_offload": "sometimes"}, "activation_cpu_offload", "true, false, or a mapping with enabled, mode"),
    ({"activation_cpu_offload": {"mode": "fast"}}, "activation_cpu_offload.mode", 'one of auto, async, sync; got "fast"'),
    ({"activation_cpu_offload": {"min_tensor_bytes": -1}}, "activation_cpu_offload.min_tensor_bytes", "an integer >= 0"),
    ({"activation_cpu_offload": {"max_pinned_bytes": -5}}, "activation_cpu_offload.max_pinned_bytes", "or null for no cap"),
    ({"activation_cpu_offload": {"prefetch_groups": 0}}, "activation_cpu_offload.prefetch_groups", "an integer >= 1; got 0"),
    ({"activation_cpu_offload": {"offload_last_group": "no way"}}, "activation_cpu_offload.offload_last_group", "true or false"),
    ({"activation_cpu_offload": {"enabeld": True}}, "activation_cpu_offload.enabeld", "did you mean 'enabled'?"),
    ({"cpu_ram_efficient_loading": True, "load_strategy": "scatter"}, "load_strategy", "one of auto, broadcast, sharded"),
    ({"xla_fsdp_settings": "fast"}, "xla_fsdp_settings", "expected a mapping"),
    ({"expandable_segments": "auto"}, "expandable_segments", 'expected true or false (a boolean, or the string "true"/"false"); got "auto"'),
    ({"activation_memory_budget": "lots"}, "activation_memory_budget", "a size such as 12GiB, or auto, auto-2GiB"),
    ({"activation_memory_budget": "auto-100%"}, "activation_memory_budget", "auto with an optional margin below"),
    ({"activation_memory_budget": "auto-2 gigs"}, "activation_memory_budget", 'got "auto-2 gigs"'),
    ({"activation_budget_device_memory": "80GiB"}, "activation_budget_device_memory",
     "activation_memory_budget: auto plans against, and that key is unset"),
    ({"activation_memory_budget": "8GiB", "activation_budget_device_memory": "80GiB"}, "activation_budget_device_memory",
     "that key is a fixed size; set it to auto"),
    ({"activation_memory_budget": "auto", "activation_budget_device_memory": "1e30"}, "activation_budget_device_memory",
     "a size from 1 byte to 1 PiB"),
    ({"activation_memory_budget": 0}, "activation_memory_budget", "bytes as an integer >= 1"),
    ({"activation_memory_budget": "12 gigs"}, "activation_memory_budget", 'got "12 gigs"'),
    ({"activation_memory_budget": 1.0e30}, "activation_memory_budget", "a size from 1 byte to 1 PiB"),
    ({"activation_memory_budget": "1e30"}, "activation_memory_budget", "a size from 1 byte to 1 PiB"),
    ({"activation_memory_budget": 2**50 + 1}, "activation_memory_budget", "a size from 1 byte to 1 PiB"),
    ({"activation_memory_budget": "8GiB", "activation_budget_compute_tflops": 0}, "activation_budget_compute_tflops",
     "a number > 0"),
    ({"activation_memory_budget": "8GiB", "activation_budget_copy_gb_per_s": "fast"}, "activation_budget_copy_gb_per_s",
     'a number > 0; got "fast"'),
]


@pytest.mark.parametrize("text, margin_bytes, fraction", [
    ("auto", None, 0.10), ("auto-2GiB", 2 * 2**30, 0.0), (" auto - 512MiB ", 2**29, 0.0), ("auto-5%", None, 0.05),
    ("auto-0%", None, 0.0), ("auto-12.5%", None, 0.125)])
def test_the_auto_forms_of_a_budget_read_their_margin(text: str, margin_bytes: int | None, fraction: float):
    from fsdp_offload_cfg._sizes import parse_auto
    from fsdp_offload_cfg.config.derived import auto_budget, budget_bytes

    config = load_config({"activation_memory_budget": text, "activation_budget_device_memory": "8GiB"})
    auto = auto_budget(config)
    assert auto == parse_auto(text).__class__(margin_bytes, fraction, 8 * 2**30)
    assert budget_bytes(config) is None  # no fixed size: the run works it out
    assert auto.margin(10**9) == (margin_bytes if margin_bytes is not None else int(10**9 * fraction))


@pytest.mark.parametrize("number, text", [(1.5e9, "1.5e9"), (4096, "4096"), (2**40, "1TiB"), (1.0e15, "1e15")])
def test_a_size_reads_alike_as_a_number_and_as_text(number: float, text: str):
    """One rule for sizes: YAML gives `1.5e9` as a float and `"1.5e9"` as a string; both are the
    same budget, and both are refused past 1 PiB (a typo such as `1.0e+30` was logged as
    931322574615478534144.00 GiB)."""
    from fsdp_offload_cfg._sizes import size_in_bytes

    assert size_in_bytes(number) == size_in_bytes(text) == int(float(number))
    for value in (number, text):
        assert size_in_bytes(load_config({"activation_memory_budget": value}).activation_memory_budget) == int(number)


@pytest.mark.parametrize("nbytes, shown", [(1, "1 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (int(3.2 * 2**20), "3.2 MiB"),
                                           (2**30, "1.00 GiB"), (3 * 2**40, "3.00 TiB")])
def test_sizes_are_shown_in_a_unit_that_shows_them(nbytes: int, shown: str):
    """1 KiB read "0.0 MiB" and a 3.2 MiB pool "0.00 GiB"."""
    from fsdp_offload_cfg._sizes import show_size

    assert show_size(nbytes) == shown


@pytest.mark.parametrize(("mapping", "path", "fragment"), BAD, ids=[f"{p}={m}" for m, p, _ in BAD])
def test_bad_value(mapping: dict, path: str, fragment: str):
    problem = only_problem(mapping)
    assert (problem.file, problem.path) == ("<dict>", path)
    assert fragment in problem.message
    assert str(problem).startswith(f"<dict>: {path}: ")


def test_null_means_unset_for_exactly_the_optional_fields():
    from fsdp_offload_cfg.config import LAUNCH_KEYS, NULL_MEANS_UNSET

    optional = {f.name for f in dataclasses.fields(FSDPOffloadConfig) if f.default is None}
    assert optional - set(LAUNCH_KEYS) == NULL_MEANS_UNSET


def test_schema_keys_are_dataclass_fields_or_documented_trainer_keys():
    fields = {f.name for f in dataclasses.fields(FSDPOffloadConfig)}
    trainer_only = {"cpu_offload", "limit_all_gathers", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings"}
    assert set(schema.canonical_keys()) - fields == trainer_only
    assert {k for k in GOOD_KEYS} <= set(schema.canonical_keys())


GOOD_KEYS = {key for mapping, _, _ in GOOD for key in mapping}


def test_every_schema_key_has_a_good_and_a_bad_case():
    bad_keys = {path.split(".")[0] for _, path, _ in BAD}
    keys = set(schema.canonical_keys()) - {"cpu_offload", "limit_all_gathers", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt"}
    assert keys <= GOOD_KEYS
    assert keys - {"load_strategy", "activation_checkpointing_offload", "cpu_ram_efficient_loading",
                   "sync_module_states", "activation_checkpointing", "forward_prefetch"} <= bad_keys


# -------------------------------------------------------------------------------------------
# spellings
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("mapping", "field", "expected"), GOOD[::3])
def test_fsdp_prefix_is_optional(mapping: dict, field: str, expected: Any):
    prefixed = {f"fsdp_{k}": v for k, v in mapping.items()}
    assert getattr(load_config(prefixed), field) == expected
    assert load_config(prefixed) == load_config(mapping)


def test_null_means_unset_only_where_the_default_is_none():
    config = load_config({"state_dict_type": None, "fsdp_transformer_layer_cls_to_wrap": None, "ignored_modules": None})
    assert (config.state_dict_type, config.transformer_layer_cls_to_wrap, config.ignored_modules) == (None, None, None)
    assert only_problem({"offload_params": None}).message.endswith("got null")


def test_both_spellings_with_equal_values_are_fine():
    config = load_config({"fsdp_version": 1, "version": "1", "offload_params": "true", "fsdp_offload_params": True,
                          "transformer_layer_cls_to_wrap": "A,B", "fsdp_transformer_layer_cls_to_wrap": ["A", "B"]})
    assert (config.version, config.offload_params, config.transformer_layer_cls_to_wrap) == (1, True, ("A", "B"))


@pytest.mark.parametrize(("mapping", "path", "other"), [
    ({"version": 1, "fsdp_version": 2}, "fsdp_version", "version"),
    ({"fsdp_offload_params": False, "offload_params": True}, "offload_params", "fsdp_offload_params"),
    ({"offload_params": False, "cpu_offload": True}, "cpu_offload", "offload_params"),
    ({"fsdp_load_strategy": "sharded", "load_strategy": "broadcast", "cpu_ram_efficient_loading": True},
     "load_strategy", "fsdp_load_strategy"),
])
def test_conflicting_spellings_are_an_error(mapping: dict, path: str, other: str):
    problem = only_problem(mapping)
    assert problem.path == path
    assert f"conflicts with {other}" in problem.message and "keep one spelling" in problem.message


def test_conflict_inside_an_accelerate_file_names_the_nested_paths(tmp_path: Path):
    path = write(tmp_path, "c.yaml", ACCELERATE_YAML.format(fsdp="  fsdp_version: 2\n  version: 1\n"))
    problem = only_problem(path)
    assert str(problem) == (f"{path}: fsdp_config.version: conflicts with fsdp_config.fsdp_version (1 vs 2); "
                            "keep one spelling")


# -------------------------------------------------------------------------------------------
# sources
# -------------------------------------------------------------------------------------------


def test_accelerate_yaml_file_reads_fsdp_config_and_launch_keys():
    config = load_config(EXAMPLES / "fsdp2.yaml")
    assert config.source == str(EXAMPLES / "fsdp2.yaml")
    launch = (config.distributed_type, config.mixed_precision, config.num_processes, config.use_cpu)
    assert launch == ("FSDP", "bf16", 8, False)
    assert (config.version, config.reshard_after_forward, config.auto_wrap_policy) == (2, True, "TRANSFORMER_BASED_WRAP")
    assert config.transformer_layer_cls_to_wrap == ("LlamaDecoderLayer",)
    assert config.state_dict_type == "SHARDED_STATE_DICT"
    assert config.cpu_ram_efficient_loading and config.load_strategy == "auto"
    assert config.activation_cpu_offload == ActivationOffloadConfig(enabled=True, max_pinned_bytes=16 << 30)


def test_cpu_example_is_two_cpu_processes_with_offload():
    config = load_config(str(EXAMPLES / "fsdp2_cpu.yaml"))
    assert (config.num_processes, config.use_cpu, config.mixed_precision, config.version) == (2, True, "no", 2)
    assert config.activation_cpu_offload.enabled and config.cpu_ram_efficient_loading


def test_trainer_json_file():
    config = load_config(str(EXAMPLES / "fsdp2.json"))
    assert config.distributed_type == "FSDP"  # a Trainer `fsdp` setting turns FSDP on
    assert (config.version, config.reshard_after_forward, config.load_strategy) == (2, True, "sharded")
    assert config.transformer_layer_cls_to_wrap == ("LlamaDecoderLayer",)
    assert config.activation_cpu_offload == ActivationOffloadConfig(enabled=True, mode="async")
    assert config.num_processes is None and config.mixed_precision is None


def test_ms_swift_json_with_doc_keys(tmp_path: Path):
    text = json.dumps({"_description": "FSDP2", "_param_docs": {"fsdp": "..."}, "fsdp": "full_shard auto_wrap",
                       "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True, "activation_cpu_offload": True}})
    config = load_config(write(tmp_path, "swift.json", text))
    assert config.activation_cpu_offload.enabled and config.auto_wrap_policy == "TRANSFORMER_BASED_WRAP"
    assert config.state_dict_type == "FULL_STATE_DICT"  # transformers' default


@pytest.mark.parametrize("name", ["bare.yaml", "bare.json"])
def test_bare_fsdp_config_file(tmp_path: Path, name: str):
    text = json.dumps({"fsdp_version": 2, "fsdp_offload_params": True, "activation_cpu_offload": {"mode": "sync"}})
    config = load_config(write(tmp_path, name, text))
    assert config.offload_params and config.activation_cpu_offload.mode == "sync"
    assert config.distributed_type is None and config.source.endswith(name)


def test_dict_source_and_defaults():
    config = load_config({})
    assert config == FSDPOffloadConfig(source="<dict>")
    assert load_config({"fsdp_config": {"version": 2}, "fsdp": True}).distributed_type == "FSDP"


def test_config_source_is_returned_as_is():
    config = load_config({"activation_cpu_offload": True})
    assert load_config(config) is config
    assert load_config(config, []) is config


def test_accelerate_file_without_fsdp_version_is_fsdp1_like_accelerate(tmp_path: Path):
    text = ACCELERATE_YAML.format(fsdp="  fsdp_sharding_strategy: SHARD_GRAD_OP\n")
    config = load_config(write(tmp_path, "v1.yaml", text))
    assert (config.version, config.sharding_strategy, config.reshard_after_forward) == (1, "SHARD_GRAD_OP", "FULL_SHARD")


def test_accelerate_top_level_keys_allowed_but_typos_are_not(tmp_path: Path):
    path = write(tmp_path, "t.yaml", ACCELERATE_YAML.format(fsdp="  fsdp_version: 2\n") + "fsdp_confg:\n  x: 1\n")
    problem = only_problem(path)
    assert problem.path == "fsdp_confg"
    assert problem.message == "unknown top-level key (accelerate refuses it); did you mean 'fsdp_config'?"


@pytest.mark.parametrize(("section", "path", "message"), [
    ("  dp_replicate_size: 2\n", "parallelism_config.dp_replicate_size",
     "accelerate reads only the prefixed name; did you mean 'parallelism_config_dp_replicate_size'?"),
    ("  parallelism_config_dp_shard_sise: 2\n", "parallelism_config.parallelism_config_dp_shard_sise",
     "unknown key (accelerate ignores it); did you mean 'parallelism_config_dp_shard_size'?"),
    ("  parallelism_config_dp_shard_size: two\n", "parallelism_config.parallelism_config_dp_shard_size",
     'expected an integer >= 1; got "two"'),
    ("  parallelism_config_dp_replicate_size: 0\n", "parallelism_config.parallelism_config_dp_replicate_size",
     "expected an integer >= 1; got 0"),
])
def test_parallelism_config_keys_accelerate_would_drop_are_named(tmp_path: Path, section: str, path: str,
                                                                 message: str) -> None:
    """`accelerate launch` copies each key of `parallelism_config` onto its arguments and reads only
    its own `parallelism_config_*` names: an unprefixed or misspelt key ran the job without that
    parallelism (HSDP replicas, tensor parallelism), silently."""
    text = ACCELERATE_YAML.format(fsdp="  fsdp_version: 2\n") + "parallelism_config:\n" + section
    problem = only_problem(write(tmp_path, "p.yaml", text))
    assert (problem.path, problem.message) == (path, message)


def test_a_parallelism_config_key_of_a_later_accelerate_names_the_version(tmp_path: Path, monkeypatch) -> None:
    """accelerate 1.10 reads the dp, tp and cp sizes; the sp_* keys came later. A key the installed
    version does not read says so (here accelerate 1.10's names stand in for the installed ones)."""
    from fsdp_offload_cfg.config import sources

    installed = frozenset(f"parallelism_config_{k}" for k in ("dp_replicate_size", "dp_shard_size", "tp_size",
                                                               "cp_size", "cp_comm_strategy"))
    monkeypatch.setattr(sources, "parallelism_config_keys", lambda: installed)
    text = ACCELERATE_YAML.format(fsdp="  fsdp_version: 2\n") + "parallelism_config:\n  parallelism_config_sp_size: 2\n"
    problem = only_problem(write(tmp_path, "p.yaml", text))
    assert problem.message.startswith("the installed accelerate ") and "does not read it (accelerate 1.15 does)" \
        in problem.message


def test_parallelism_config_keys_are_the_installed_accelerates() -> None:
    """Read from the installed accelerate's launch parser: its HSDP sizes on every supported version."""
    from importlib.metadata import version

    from fsdp_offload_cfg.config.keys import PARALLELISM_CONFIG_KEYS_1_15, parallelism_config_keys

    keys = parallelism_config_keys()
    assert {"parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size"} <= keys
    assert all(k.startswith("parallelism_config_") for k in keys), keys
    if version("accelerate").startswith("1.15."):  # the fallback names are accelerate 1.15's
        assert keys == PARALLELISM_CONFIG_KEYS_1_15


@pytest.mark.parametrize(("section", "path", "message"), [
    ("dynamo_config:\n  dynamo_use_regional_compile: true\n", "dynamo_config.dynamo_use_regional_compile",
     "unknown key (accelerate ignores it); did you mean 'dynamo_use_regional_compilation'?"),
    ("dynamo_config:\n  backend: inductr\n", "dynamo_config.backend", 'got "inductr"; accelerate launch refuses it'),
    ("dynamo_backend: NO\n", "dynamo_backend", "got false (YAML reads an unquoted NO as false: write 'NO')"),
])
def test_dynamo_config_keys_and_backends_accelerate_would_drop_or_refuse_are_named(
        tmp_path: Path, section: str, path: str, message: str) -> None:
    """`accelerate launch` reads a `dynamo_config` key with or without its `dynamo_` prefix and drops
    any other without a word (the model compiled whole instead of per layer); it stops at launch on
    an unknown backend, and on a legacy `dynamo_backend: NO` that YAML read as false (a traceback:
    'bool' object has no attribute 'upper')."""
    problem = only_problem(write(tmp_path, "d.yaml", ACCELERATE_YAML.format(fsdp="  fsdp_version: 2\n") + section))
    assert problem.path == path and message in problem.message, problem.message


def test_the_dynamo_config_is_held_as_written_and_the_legacy_key_as_accelerate_reads_it(tmp_path: Path) -> None:
    base = ACCELERATE_YAML.format(fsdp="  fsdp_version: 2\n")
    config = load_config(write(tmp_path, "a.yaml", base + "dynamo_config:\n  dynamo_backend: INDUCTOR\n"))
    assert config.dynamo_config == {"dynamo_backend": "INDUCTOR"}
    assert load_config(write(tmp_path, "b.yaml", base + "dynamo_backend: INDUCTOR\n")) == config
    assert load_config(write(tmp_path, "c.yaml", base + "dynamo_backend: 'NO'\n")).dynamo_config is None


def test_a_valid_parallelism_config_section_passes(tmp_path: Path) -> None:
    text = ACCELERATE_YAML.format(fsdp="  fsdp_version: 2\n") + (
        "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 4\n")
    assert load_config(write(tmp_path, "p.yaml", text)).version == 2


def test_the_parallelism_config_section_is_held_as_written_and_an_empty_one_is_none(tmp_path: Path) -> None:
    """`accelerate launch` uses the section when it is not empty; `explain` writes it back."""
    from fsdp_offload_cfg.config.sources import as_config_file

    base = ACCELERATE_YAML.format(fsdp="  fsdp_version: 2\n")
    config = load_config(write(tmp_path, "p.yaml", base + "parallelism_config:\n  parallelism_config_dp_shard_size: 2\n"))
    assert config.parallelism_config == {"parallelism_config_dp_shard_size": 2}
    assert load_config(as_config_file(config)) == config
    assert load_config(write(tmp_path, "e.yaml", base + "parallelism_config: {}\n")).parallelism_config is None


def test_an_accelerate_file_loads_on_rank_0_unless_it_says_not_to_as_accelerate_launch_does(tmp_path: Path) -> None:
    """`accelerate launch` defaults --fsdp_cpu_ram_efficient_loading to true and exports it: a file
    without the key ran with rank-0 loading there, and without it under torchrun (`patch("F")`,
    `run --config F -- torchrun`: every rank read the whole checkpoint); `validate` refused its
    `load_strategy` as doing nothing and passed a `sync_module_states: false` the launch refuses."""
    from accelerate.commands.launch import launch_command_parser

    (flag,) = [a for a in launch_command_parser()._actions if a.dest == "fsdp_cpu_ram_efficient_loading"]
    launch_default = str(flag.default).lower() == "true"
    config = load_config(write(tmp_path, "a.yaml", ACCELERATE_YAML.format(fsdp="  fsdp_version: 2\n  load_strategy: sharded\n")))
    assert config.cpu_ram_efficient_loading is launch_default is True and config.load_strategy == "sharded"
    problem = only_problem(write(tmp_path, "b.yaml", ACCELERATE_YAML.format(fsdp="  fsdp_sync_module_states: false\n")))
    assert problem.path == "fsdp_config.fsdp_sync_module_states"
    assert "(fsdp_cpu_ram_efficient_loading is unset; accelerate launch defaults it to true)" in problem.message
    # the Trainer's fsdp_config and a bare mapping keep their own default: off
    assert not load_config({"fsdp_config": {"version": 2}, "fsdp": True}).cpu_ram_efficient_loading


def test_trainer_only_key_in_accelerate_file_points_to_accelerate_spelling(tmp_path: Path):
    path = write(tmp_path, "t.yaml", ACCELERATE_YAML.format(fsdp="  fsdp_version: 2\n  fsdp_cpu_offload: true\n"))
    problem = only_problem(path)
    assert problem.path == "fsdp_config.fsdp_cpu_offload"
    assert "transformers Trainer key" in problem.message and "did you mean 'fsdp_offload_params'?" in problem.message


@pytest.mark.parametrize(("fsdp", "version", "field", "expected"), [
    ("shard_grad_op auto_wrap", 2, "reshard_after_forward", False),
    ("full_shard offload", 2, "offload_params", True),
    (["hybrid_shard", "auto_wrap"], 1, "reshard_after_forward", "HYBRID_SHARD"),
    ("", 2, "distributed_type", None),
    (False, 2, "distributed_type", None),
    (True, 2, "distributed_type", "FSDP"),
])
def test_trainer_fsdp_option_string(fsdp: Any, version: int, field: str, expected: Any):
    assert getattr(load_config({"fsdp": fsdp, "fsdp_config": {"version": version}}), field) == expected


def test_trainer_explicit_fsdp_config_wins_over_option_string():
    config = load_config({"fsdp": "shard_grad_op", "fsdp_config": {"reshard_after_forward": True}})
    assert config.reshard_after_forward is True


@pytest.mark.parametrize(("top", "path", "fragment"), [
    ({"fsdp": "hybrid_shard", "fsdp_config": {}}, "fsdp", "only available with FSDP1"),
    ({"fsdp": "full_shard turbo"}, "fsdp", 'got "turbo"'),
    ({"fsdp": 3}, "fsdp", "expected true, an option string or a list"),
    ({"fsdp": True, "fsdp_config": "fsdp_config.json"}, "fsdp_config", "expected a mapping of fsdp_config keys"),
])
def test_trainer_bad_fsdp_values(top: dict, path: str, fragment: str):
    problem = only_problem(top)
    assert problem.path == path and fragment in problem.message


def test_enum_members_in_a_dict_become_their_names():
    from torch.distributed.fsdp import ShardingStrategy, StateDictType

    config = load_config({"version": 1, "sharding_strategy": ShardingStrategy.SHARD_GRAD_OP,
                          "state_dict_type": StateDictType.SHARDED_STATE_DICT})
    assert (config.sharding_strategy, config.state_dict_type) == ("SHARD_GRAD_OP", "SHARDED_STATE_DICT")


def test_wrong_source_type_is_a_type_error():
    with pytest.raises(TypeError):
        load_config(42)  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------
# overrides
# -------------------------------------------------------------------------------------------


def test_dotlist_overrides_on_an_accelerate_file():
    config = load_config(EXAMPLES / "fsdp2_cpu.yaml", ["fsdp_config.activation_cpu_offload=false",
                                                       "load_strategy=sharded", "num_processes=4"])
    assert not config.activation_cpu_offload.enabled
    assert config.load_strategy == "sharded" and config.num_processes == 4


def test_override_merges_into_a_nested_object_and_keeps_the_file_spelling():
    config = load_config(EXAMPLES / "fsdp2.yaml", ["fsdp_config.activation_cpu_offload.mode=sync", "offload_params=true"])
    assert config.activation_cpu_offload.mode == "sync"
    assert config.activation_cpu_offload.max_pinned_bytes == 16 << 30  # merged, not replaced
    assert config.offload_params  # written to fsdp_offload_params: no spelling conflict


def test_mapping_overrides_and_bare_mapping_key_paths():
    source = {"fsdp_version": 2, "cpu_ram_efficient_loading": True}
    assert load_config(source, {"load_strategy": "sharded"}).load_strategy == "sharded"
    assert load_config(source, ["fsdp_config.load_strategy=sharded"]).load_strategy == "sharded"
    assert load_config(source, {"activation_cpu_offload": {"mode": "async"}}).activation_cpu_offload.mode == "async"


def test_overrides_on_a_config_object_keep_its_source():
    base = load_config(EXAMPLES / "fsdp2.yaml")
    config = load_config(base, {"activation_cpu_offload": False})
    assert not config.activation_cpu_offload.enabled
    assert config.source == base.source and config.num_processes == 8
    assert dataclasses.replace(config, activation_cpu_offload=base.activation_cpu_offload) == base


def test_override_problems_name_the_key(tmp_path: Path):
    problems = problems_of(EXAMPLES / "fsdp2.yaml", ["fsdp_config.activation_cpu_offload.mode=fast", "novalue"])
    assert [(p.path, p.message) for p in problems] == [
        ("novalue", "override must look like KEY=VALUE")]
    problem = only_problem(EXAMPLES / "fsdp2.yaml", ["fsdp_config.activation_cpu_offload.mode=fast"])
    assert problem.path == "fsdp_config.fsdp_activation_cpu_offload.mode" and 'got "fast"' in problem.message


# -------------------------------------------------------------------------------------------
# rules between keys
# -------------------------------------------------------------------------------------------

RULES = [
    ({"version": 2, "reshard_after_forward": "SHARD_GRAD_OP"}, "reshard_after_forward", "FSDP2 needs true or false"),
    ({"version": 1, "reshard_after_forward": True}, "reshard_after_forward", "FSDP1 needs a sharding strategy"),
    ({"version": 2, "sharding_strategy": "FULL_SHARD"}, "sharding_strategy", "use reshard_after_forward: true instead"),
    ({"cpu_ram_efficient_loading": True, "sync_module_states": False}, "sync_module_states", "must be true when cpu_ram_efficient_loading"),
    ({"version": 1, "cpu_ram_efficient_loading": True, "sync_module_states": "false"}, "sync_module_states", "must be true"),
    ({"load_strategy": "broadcast"}, "load_strategy", "only applies with cpu_ram_efficient_loading: true"),
    ({"cpu_ram_efficient_loading": False, "load_strategy": "sharded"}, "load_strategy", "would do nothing"),
    ({"activation_checkpointing_offload": True}, "activation_checkpointing_offload", "needs activation_checkpointing: true"),
    ({"version": 1, "activation_checkpointing": True, "activation_checkpointing_offload": True},
     "activation_checkpointing_offload", "needs FSDP2"),
    ({"activation_checkpointing": True, "activation_checkpointing_offload": True, "activation_cpu_offload": True},
     "activation_cpu_offload", "cannot be combined with activation_checkpointing_offload"),
    ({"forward_prefetch": True}, "forward_prefetch", "not implemented in FSDP2"),
    ({"state_dict_type": "LOCAL_STATE_DICT"}, "state_dict_type", "does not support LOCAL_STATE_DICT"),
    ({"xla": True}, "xla", "XLA FSDP bypasses accelerate"),
]


@pytest.mark.parametrize(("mapping", "path", "fragment"), RULES, ids=[p for _, p, _ in RULES])
def test_rule_between_keys(mapping: dict, path: str, fragment: str):
    problem = only_problem(mapping)
    assert problem.path == path and fragment in problem.message


@pytest.mark.parametrize(("mapping", "expected"), [
    ({"version": 1, "reshard_after_forward": "SHARD_GRAD_OP", "sharding_strategy": "HYBRID_SHARD"},
     {"version": 1, "reshard_after_forward": "SHARD_GRAD_OP", "sharding_strategy": "HYBRID_SHARD"}),
    ({"cpu_ram_efficient_loading": True, "sync_module_states": True, "load_strategy": "sharded"},
     {"cpu_ram_efficient_loading": True, "sync_module_states": True, "load_strategy": "sharded"}),
    ({"version": 2, "activation_checkpointing": True, "activation_checkpointing_offload": True},
     {"version": 2, "activation_checkpointing": True, "activation_checkpointing_offload": True}),
    ({"sync_module_states": False}, {"sync_module_states": False}),
])
def test_rules_hold_for_the_fixed_configs(mapping: dict, expected: dict):
    """Each config is a broken one of RULES, fixed: it loads, with the values as given (a rule
    that misfired would raise; one that rewrote a value would show here)."""
    config = load_config(mapping)
    assert {key: getattr(config, key) for key in expected} == expected


def test_rule_mentions_accelerates_fsdp1_default(tmp_path: Path):
    problem = only_problem(write(tmp_path, "v.yaml", ACCELERATE_YAML.format(fsdp="  fsdp_reshard_after_forward: true\n")))
    assert problem.path == "fsdp_config.fsdp_reshard_after_forward"
    assert "fsdp_version is unset; accelerate defaults to 1" in problem.message


HYBRID_MESH = "parallelism_config section with parallelism_config_dp_replicate_size"


@pytest.mark.parametrize("fsdp", ["  fsdp_version: 2\n  fsdp_sharding_strategy: HYBRID_SHARD\n",
                                  "  fsdp_version: 2\n  fsdp_reshard_after_forward: HYBRID_SHARD\n",
                                  "  fsdp_version: 2\n  fsdp_sharding_strategy: 5\n"],
                         ids=["sharding_strategy", "reshard_after_forward", "zero2-by-number"])
def test_hybrid_sharding_under_fsdp2_names_the_mesh_not_only_the_bool(tmp_path: Path, fsdp: str):
    """`accelerate to-fsdp2` maps HYBRID_SHARD to `reshard_after_forward: true`, and the message
    said only that: followed, the job shards over every rank and has no replicas. FSDP2's hybrid
    sharding is accelerate's parallelism_config mesh, which the message now names."""
    problem = only_problem(write(tmp_path, "h.yaml", ACCELERATE_YAML.format(fsdp=fsdp)))
    assert HYBRID_MESH in problem.message and "(the replicas, such as one per node)" in problem.message
    assert "the two multiply to the number of processes" in problem.message  # accelerate refuses any other mesh
    assert "reshard_after_forward: " + ("false" if "5" in fsdp else "true") in problem.message


def test_hybrid_sharding_with_the_mesh_in_the_file_needs_only_the_bool(tmp_path: Path):
    mesh = "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 4\n"
    for fsdp, fragment in (("  fsdp_version: 2\n  fsdp_sharding_strategy: HYBRID_SHARD\n",
                            "true instead (the parallelism_config section makes the replicas)"),
                           ("  fsdp_version: 2\n  fsdp_reshard_after_forward: HYBRID_SHARD\n",
                            "maps HYBRID_SHARD to true)")):
        problem = only_problem(write(tmp_path, "m.yaml", ACCELERATE_YAML.format(fsdp=fsdp) + mesh))
        assert HYBRID_MESH not in problem.message and problem.message.endswith(fragment), problem.message


@pytest.mark.parametrize("fsdp", ["  fsdp_version: 2\n  fsdp_sharding_strategy: NO_SHARD\n",
                                  "  fsdp_version: 2\n  fsdp_reshard_after_forward: NO_SHARD\n"])
def test_no_shard_under_fsdp2_points_to_ddp(tmp_path: Path, fsdp: str):
    """FSDP2 has no unsharded mode; the bool accelerate maps NO_SHARD to still shards everything."""
    problem = only_problem(write(tmp_path, "n.yaml", ACCELERATE_YAML.format(fsdp=fsdp)))
    assert "use DDP (distributed_type: MULTI_GPU)" in problem.message
    assert "fsdp_reshard_after_forward: false is the nearest FSDP2 setting" in problem.message


def test_advice_never_says_to_set_the_trainers_fsdp_option_to_a_bool():
    """The Trainer's `fsdp` option string sets reshard_after_forward, and the advice was spelled
    with the key that set it: "use fsdp: false instead", which turns FSDP off."""
    problem = only_problem({"fsdp": "full_shard", "fsdp_config": {"version": 2, "sharding_strategy": "NO_SHARD"}})
    assert problem.path == "fsdp_config.sharding_strategy"
    assert "fsdp: false" not in problem.message and "reshard_after_forward: false" in problem.message
    assert "use DDP (no fsdp in TrainingArguments)" in problem.message


@pytest.mark.parametrize(("option", "fragment"), [
    ("hybrid_shard", "pass ParallelismConfig(dp_replicate_size="),
    ("hybrid_shard_zero2", "fsdp_config.reshard_after_forward: false"),
    ("no_shard", "use DDP (no fsdp in TrainingArguments)"),
])
def test_trainer_fsdp1_only_options_under_fsdp2_say_what_fsdp2_needs(option: str, fragment: str):
    problem = only_problem({"fsdp": f"{option} auto_wrap", "fsdp_config": {"version": 2}})
    assert problem.path == "fsdp" and "only available with FSDP1" in problem.message and fragment in problem.message


def test_fsdp_config_under_another_distributed_type(tmp_path: Path):
    text = ACCELERATE_YAML.format(fsdp="  fsdp_version: 2\n").replace("type: FSDP", "type: MULTI_GPU")
    problem = only_problem(write(tmp_path, "g.yaml", text))
    assert problem.path == "distributed_type" and "accelerate ignores fsdp_config" in problem.message
    no_fsdp = write(tmp_path, "ok.yaml", text.replace("  fsdp_version: 2\n", "  {}\n"))
    assert load_config(no_fsdp).distributed_type == "MULTI_GPU"


def test_rule_skipped_when_its_key_is_already_bad():
    problem = only_problem({"version": 7, "reshard_after_forward": "FULL_SHARD"})
    assert problem.path == "version"


# -------------------------------------------------------------------------------------------
# unknown keys, many problems, unreadable files, interpolation
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "suggestion"), [
    ("activaton_cpu_offload", "activation_cpu_offload"),
    ("fsdp_activaton_cpu_offload", "fsdp_activation_cpu_offload"),
    ("load_stratgy", "load_strategy"),
    ("fsdp_reshard_after_foward", "fsdp_reshard_after_forward"),
])
def test_unknown_key_suggests_the_closest(key: str, suggestion: str):
    problem = only_problem({key: True})
    assert problem.path == key and problem.message == f"unknown key; did you mean {suggestion!r}?"


def test_unknown_key_without_a_close_match_lists_the_keys():
    message = only_problem({"zzz": 1}).message
    assert "expected one of activation_budget_compute_tflops, activation_budget_copy_gb_per_s, " \
        "activation_budget_device_memory, activation_checkpointing" in message


def test_all_problems_reported_together(tmp_path: Path):
    fsdp = ("  fsdp_version: 2\n  fsdp_activaton_cpu_offload: true\n  fsdp_auto_wrap_policy: LAYER_WRAP\n"
            "  fsdp_activation_cpu_offload:\n    mode: fast\n  fsdp_load_strategy: sharded\n"
            "  fsdp_cpu_ram_efficient_loading: false\n")
    text = ACCELERATE_YAML.format(fsdp=fsdp).replace("mixed_precision: bf16", "mixed_precision: fp64")
    path = write(tmp_path, "many.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    paths = [p.path for p in info.value.problems]
    assert sorted(paths) == sorted(["fsdp_config.fsdp_activaton_cpu_offload", "fsdp_config.fsdp_auto_wrap_policy",
                                    "fsdp_config.fsdp_activation_cpu_offload.mode", "fsdp_config.fsdp_load_strategy",
                                    "mixed_precision"])
    lines = str(info.value).splitlines()
    assert len(lines) == 5 and all(line.startswith(f"{path}: ") for line in lines)
    assert not info.value.unreadable and isinstance(info.value, ValueError)


@pytest.mark.parametrize(("name", "content"), [
    ("syntax.yaml", "fsdp_config:\n  fsdp_version: [2\n"),
    ("dup.yaml", "fsdp_version: 2\nfsdp_version: 1\n"),
    ("tag.yaml", "fsdp_version: !!python/object/apply:os.system ['echo pwned']\n"),
    ("bad.json", '{"fsdp": "full_shard", "fsdp_config": {"version": 2,}'),
    ("binary.yaml", b"\xff\xfe\x00garbage\x00"),
])
def test_unparsable_file_is_unreadable_and_named(tmp_path: Path, name: str, content: str | bytes):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.unreadable
    assert str(info.value).startswith(f"{path}: cannot read or parse the file")


@pytest.mark.parametrize("path", ["/nonexistent/fsdp.yaml", "/"])
def test_missing_file_or_directory_is_unreadable(path: str):
    with pytest.raises(ConfigError, match=re.escape(path)) as info:
        load_config(path)
    assert info.value.unreadable and info.value.problems[0].file == path


def test_a_missing_relative_path_says_which_folder_it_was_read_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`patch("fsdp2.yaml")` in a script launched from another folder: the message named only the
    file, and the user looked beside the script, where it is."""
    monkeypatch.chdir(tmp_path)
    problem = only_problem("fsdp2.yaml")
    assert f"(a relative path is read from the current folder, {tmp_path})" in problem.message, problem.message
    assert "current folder" not in only_problem(str(tmp_path / "fsdp2.yaml")).message  # an absolute path says it all


@pytest.mark.parametrize(("content", "fragment"), [
    ("", "holds no settings"),
    ("- 1\n- 2\n", "expected a mapping at the top level"),
])
def test_empty_or_list_file_is_invalid_not_unreadable(tmp_path: Path, content: str, fragment: str):
    problem = only_problem(write(tmp_path, "x.yaml", content))
    assert fragment in problem.message


def test_interpolation_is_refused_and_no_resolver_runs(tmp_path: Path):
    from omegaconf import OmegaConf

    calls: list[str] = []
    with warnings.catch_warnings():  # omegaconf 2.4 deprecates the name, 2.3 has no other
        warnings.simplefilter("ignore")
        OmegaConf.register_new_resolver("fsdp_test_side_effect", lambda: calls.append("ran") or "true")
    try:
        path = write(tmp_path, "i.yaml", "fsdp_offload_params: ${fsdp_test_side_effect:}\nignored_modules: ${oc.env:HOME}\n")
        problems = problems_of(path)
        assert [p.path for p in problems] == ["fsdp_offload_params", "ignored_modules"]
        assert all("interpolation is not supported" in p.message for p in problems)
        assert "interpolation" in only_problem({}, ["offload_params=${oc.env:HOME}"]).message
    finally:
        OmegaConf.clear_resolver("fsdp_test_side_effect")
    assert calls == []


# -------------------------------------------------------------------------------------------
# environment
# -------------------------------------------------------------------------------------------


def test_env_is_none_without_accelerate_use_fsdp():
    assert config_from_env({}) is None
    assert config_from_env({"ACCELERATE_USE_FSDP": "false", "FSDP_VERSION": "2"}) is None


def test_env_from_a_real_accelerate_launch_matches_the_file():
    """Export the variables exactly as `accelerate launch` does, then rebuild the config."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = str(EXAMPLES / "fsdp2.yaml")
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", path, "train.py"]))
    env = {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith(("FSDP_", "ACCELERATE_"))}
    from_env, from_file = config_from_env(env), load_config(path)
    assert from_env is not None and from_env.source == "env FSDP_*"
    same = ["version", "reshard_after_forward", "sharding_strategy", "offload_params", "auto_wrap_policy",
            "transformer_layer_cls_to_wrap", "state_dict_type", "cpu_ram_efficient_loading", "activation_checkpointing",
            "activation_checkpointing_offload", "distributed_type", "mixed_precision"]
    assert {k: getattr(from_env, k) for k in same} == {k: getattr(from_file, k) for k in same}
    assert not from_env.activation_cpu_offload.enabled  # accelerate does not export the plugin's keys


def test_env_fsdp1_and_plugin_variables():
    config = config_from_env({
        "ACCELERATE_USE_FSDP": "true", "ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_CPU": "True",
        "WORLD_SIZE": "2", "FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "2", "FSDP_RESHARD_AFTER_FORWARD": "true",
        "FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE", "FSDP_MIN_NUM_PARAMS": "1000", "FSDP_IGNORED_MODULES": "lm_head",
        "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "FSDP_SYNC_MODULE_STATES": "true",
        "FSDP_ACTIVATION_CPU_OFFLOAD": '{"mode": "sync", "min_tensor_bytes": 0}',
    })
    assert config is not None
    assert (config.version, config.sharding_strategy, config.reshard_after_forward) == (1, "SHARD_GRAD_OP", "FULL_SHARD")
    assert (config.backward_prefetch, config.min_num_params, config.ignored_modules) == ("BACKWARD_PRE", 1000, "lm_head")
    assert (config.mixed_precision, config.use_cpu, config.num_processes) == ("bf16", True, 2)
    assert config.activation_cpu_offload == ActivationOffloadConfig(enabled=True, mode="sync", min_tensor_bytes=0)
    fsdp2 = config_from_env({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
                             "FSDP_LOAD_STRATEGY": "sharded"})
    assert fsdp2 is not None and fsdp2.load_strategy == "sharded"


def test_env_integral_float_from_older_accelerate_is_an_integer():
    """accelerate 1.10 exports `FSDP_MIN_NUM_PARAMS` as "100000000.0"; a fraction is still refused."""
    base = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}
    config = config_from_env({**base, "FSDP_MIN_NUM_PARAMS": "100000000.0"})
    assert config is not None and config.min_num_params == 100_000_000
    with pytest.raises(ConfigError, match="FSDP_MIN_NUM_PARAMS"):
        config_from_env({**base, "FSDP_MIN_NUM_PARAMS": "1000.5"})


def test_env_problems_name_the_variable():
    with pytest.raises(ConfigError) as info:
        config_from_env({"ACCELERATE_USE_FSDP": "1", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "maybe",
                         "FSDP_ACTIVATION_CPU_OFFLOAD": "{oops"})
    assert [(p.file, p.path) for p in info.value.problems] == [
        ("env FSDP_*", "FSDP_ACTIVATION_CPU_OFFLOAD"), ("env FSDP_*", "FSDP_OFFLOAD_PARAMS")]


# -------------------------------------------------------------------------------------------
# result, schema file
# -------------------------------------------------------------------------------------------


def test_result_is_frozen_hashable_and_serialisable():
    config = load_config(EXAMPLES / "fsdp2.yaml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.version = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.activation_cpu_offload.enabled = False  # type: ignore[misc]
    assert hash(config) == hash(load_config(EXAMPLES / "fsdp2.yaml"))
    data = normalized_dict(config)
    assert json.loads(json.dumps(data)) == yaml.safe_load(yaml.safe_dump(data)) == data
    assert data["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    assert data["activation_cpu_offload"]["max_pinned_bytes"] == 16 << 30


def test_config_error_survives_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(ConfigError([Problem("a.yaml", "x", "bad")], unreadable=True)))
    assert error.problems == [Problem("a.yaml", "x", "bad")] and error.unreadable and str(error) == "a.yaml: x: bad"
    assert ConfigError("plain message").problems == [Problem("", "", "plain message")]


def test_schema_is_valid_and_the_shipped_file_is_its_output():
    """schemas/fsdp_config.schema.json is generated: regenerate with `fsdp-offload-cfg schema > ...`."""
    from jsonschema import Draft202012Validator

    Draft202012Validator.check_schema(schema.load_schema())
    assert (ROOT / "schemas" / "fsdp_config.schema.json").read_text() == schema.schema_text()


def test_schema_is_built_from_the_key_table():
    """One definition per key: every key and alias of `keys.KEYS` is a schema key with its doc and type."""
    from fsdp_offload_cfg.config.keys import KEYS

    assert list(schema.canonical_keys()) == [k.name for k in KEYS] + [a for k in KEYS for a in k.aliases]
    for key in KEYS:
        node = schema.key_schema(key.name)
        assert (node["description"], node["$ref"]) == (key.doc, f"#/$defs/{key.type}")


def test_schema_enums_match_accelerate():
    from accelerate.utils import constants
    from accelerate.utils.dataclasses import DistributedType, PrecisionType

    assert schema.enum_names("sharding_strategy") == constants.FSDP_SHARDING_STRATEGY
    assert schema.enum_names("auto_wrap_policy") == constants.FSDP_AUTO_WRAP_POLICY
    assert schema.enum_names("backward_prefetch") == constants.FSDP_BACKWARD_PREFETCH
    assert schema.enum_names("state_dict_type") == constants.FSDP_STATE_DICT_TYPE
    launch = schema.definition("launch")["properties"]
    # The schema follows the newest accelerate; an older one lacks the types added since.
    installed = [t.value for t in DistributedType]
    assert [t for t in launch["distributed_type"]["enum"] if t in installed] == installed
    assert set(launch["distributed_type"]["enum"]) - set(installed) <= {"MULTI_NEURON"}
    assert launch["mixed_precision"]["enum"] == [p.value for p in PrecisionType]


def test_schema_covers_every_fsdp_key_accelerate_and_transformers_read():
    import inspect

    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import launch
    from transformers import training_args

    keys = set(schema.canonical_keys())
    flags = {a.dest.removeprefix("fsdp_") for a in launch_command_parser()._actions if a.dest.startswith("fsdp_")}
    assert flags <= keys
    exported = set(re.findall(r'"FSDP_([A-Z_]+)"', inspect.getsource(launch.prepare_multi_gpu_env)))
    from fsdp_offload_cfg.config import ENV_VARS

    assert {f"FSDP_{name}" for name in exported} <= set(ENV_VARS)
    args_cls = training_args.TrainingArguments  # transformers 4.x reads fsdp_config in __post_init__
    trainer = inspect.getsource(getattr(args_cls, "_process_fsdp_args", args_cls.__post_init__))
    read = set(re.findall(r'self\.fsdp_config(?:\.get\(|\[)"(\w+)"', trainer))
    assert read and read <= keys


# -------------------------------------------------------------------------------------------
# property: only ConfigError or a config, whatever the input
# -------------------------------------------------------------------------------------------

NAMES = [*schema.canonical_keys(), *(f"fsdp_{k}" for k in schema.canonical_keys()), "fsdp_config", "fsdp",
         "compute_environment", "distributed_type", "num_processes", "use_cpu", "mixed_precision", "enabled",
         "mode", "min_tensor_bytes", "max_pinned_bytes", "prefetch_groups", "offload_last_group"]
KEYS = st.one_of(st.sampled_from(NAMES), st.text(max_size=12), st.integers(-3, 3))
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=16),
    st.sampled_from(["true", "False", "FULL_SHARD", "2", "1", "sharded", "async", "${oc.env:HOME}", "${",
                     "TRANSFORMER_BASED_WRAP", "FSDP", "A,B", "(", "full_shard offload", "bf16"]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=4),
                      max_leaves=12)
OVERRIDES = st.none() | st.lists(st.builds("{}={}".format, st.sampled_from([*NAMES, "fsdp_config.mode", "a..b", ""]),
                                           st.sampled_from(["true", "[1, 2]", "{a: 1}", "", "${x}", "FULL_SHARD"])),
                                 max_size=3)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mapping=st.dictionaries(KEYS, VALUES, max_size=6), overrides=OVERRIDES)
def test_any_mapping_gives_a_config_or_a_config_error(mapping: dict, overrides: list[str] | None):
    try:
        config = load_config(mapping, overrides)
    except ConfigError as error:
        assert error.problems and all(isinstance(p, Problem) and p.message for p in error.problems)
    else:
        assert isinstance(config, FSDPOffloadConfig)
        json.dumps(normalized_dict(config))


# -------------------------------------------------------------------------------------------
# One definition per key
# -------------------------------------------------------------------------------------------


def test_the_model_is_generated_from_the_key_table():
    from fsdp_offload_cfg.config.keys import FIELD_KEYS, LAUNCH_KEYS

    fields = dataclasses.fields(FSDPOffloadConfig)
    assert [f.name for f in fields] == [k.name for k in FIELD_KEYS] + list(LAUNCH_KEYS) + ["source"]
    defaults = FSDPOffloadConfig()
    assert all(getattr(defaults, k.name) == k.default for k in FIELD_KEYS)


EVERY_KEY_SET = {
    "fsdp_version": 2, "fsdp_reshard_after_forward": False, "fsdp_offload_params": True,
    "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": "A,B",
    "fsdp_min_num_params": 1000, "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_cpu_ram_efficient_loading": True,
    "fsdp_sync_module_states": True, "fsdp_activation_checkpointing": True, "fsdp_ignored_modules": "lm_head",
    "fsdp_activation_cpu_offload": {"mode": "sync", "min_tensor_bytes": 0, "prefetch_groups": 2},
    "fsdp_load_strategy": "sharded",
}


@pytest.mark.parametrize("fsdp_config", [
    EVERY_KEY_SET,
    {**EVERY_KEY_SET, "fsdp_activation_cpu_offload": True, "fsdp_load_strategy": "broadcast"},
    {**EVERY_KEY_SET, "fsdp_activation_checkpointing": False, "fsdp_activation_memory_budget": "12GiB"},
    {**EVERY_KEY_SET, "fsdp_activation_checkpointing": False, "fsdp_activation_memory_budget": 2**33,
     "fsdp_activation_budget_compute_tflops": 0.05, "fsdp_activation_budget_copy_gb_per_s": 5},
    {**EVERY_KEY_SET, "fsdp_activation_checkpointing": False, "fsdp_activation_memory_budget": "auto-5%",
     "fsdp_activation_budget_device_memory": "40GiB"},
    {"fsdp_version": 1, "fsdp_reshard_after_forward": "SHARD_GRAD_OP", "fsdp_backward_prefetch": "BACKWARD_POST",
     "fsdp_forward_prefetch": True, "fsdp_use_orig_params": False, "fsdp_sync_module_states": False,
     "fsdp_cpu_ram_efficient_loading": False},
])
def test_the_environment_mapping_reads_back_the_same_config(fsdp_config: dict):
    """`patch()` exports every key, the plugin's two included; a process started with that
    environment (a DataLoader worker, a subprocess) reads back the same config."""
    from fsdp_offload_cfg.config import env_values

    config = load_config({"distributed_type": "FSDP", "mixed_precision": "bf16", "fsdp_config": fsdp_config})
    read_back = config_from_env({"ACCELERATE_USE_FSDP": "true", "ACCELERATE_MIXED_PRECISION": "bf16",
                                 **env_values(config)})
    assert read_back == config


def test_source_is_not_part_of_equality(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    write(tmp_path, "a.yaml", (EXAMPLES / "fsdp2.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    relative, dotted = load_config("a.yaml"), load_config("./a.yaml")
    assert (relative.source, dotted.source) == ("a.yaml", "./a.yaml")
    assert relative == dotted and hash(relative) == hash(dotted)


def test_activation_offload_config_checks_itself_once():
    with pytest.raises(ValueError, match=r"prefetch_groups: expected an integer >= 1; got 0"):
        ActivationOffloadConfig(prefetch_groups=0)
    with pytest.raises(ValueError, match=r"mode: expected one of auto, async, sync; got 'fast'.*min_tensor_bytes"):
        ActivationOffloadConfig(mode="fast", min_tensor_bytes=-1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_pinned_bytes"):
        ActivationOffloadConfig(max_pinned_bytes=True)  # type: ignore[arg-type]


def test_importing_the_offload_does_not_import_jsonschema():
    import subprocess
    import sys

    code = "import sys, fsdp_offload_cfg.offload; print('jsonschema' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "False"


def test_every_rule_is_named_and_has_a_case():
    from fsdp_offload_cfg.config.rules import RULES

    names = [rule.name for rule in RULES]
    assert len(set(names)) == len(names)
    assert set(names) == set(RULE_CASES)


RULE_CASES = {
    "fsdp2-reshard-is-a-bool": {"version": 2, "reshard_after_forward": "FULL_SHARD"},
    "fsdp1-reshard-is-a-strategy": {"version": 1, "reshard_after_forward": True},
    "sharding-strategy-is-fsdp1-only": {"version": 2, "sharding_strategy": "FULL_SHARD"},
    "efficient-loading-needs-sync": {"cpu_ram_efficient_loading": True, "sync_module_states": False},
    "load-strategy-needs-efficient-loading": {"load_strategy": "sharded"},
    "load-strategy-needs-fsdp2": {"version": 1, "cpu_ram_efficient_loading": True, "load_strategy": "sharded"},
    "checkpointing-offload-needs-checkpointing": {"activation_checkpointing_offload": True},
    "checkpointing-offload-needs-fsdp2": {"version": 1, "activation_checkpointing": True,
                                          "activation_checkpointing_offload": True},
    "one-activation-offload": {"activation_checkpointing": True, "activation_checkpointing_offload": True,
                               "activation_cpu_offload": True},
    "budget-is-positive": {"activation_memory_budget": "0GiB"},
    "budget-needs-fsdp2": {"version": 1, "activation_memory_budget": "12GiB"},
    "device-memory-needs-auto": {"activation_budget_device_memory": "80GiB"},
    "device-memory-is-a-size": {"activation_memory_budget": "auto", "activation_budget_device_memory": 2**51},
    "auto-on-the-cpu-needs-a-device-size": {"distributed_type": "FSDP", "use_cpu": True, "fsdp_config": {
        "fsdp_version": 2, "fsdp_activation_memory_budget": "auto"}},
    "budget-decides-checkpointing": {"activation_checkpointing": True, "activation_memory_budget": 10**9},
    "activation_budget_compute_tflops-needs-a-budget": {"activation_budget_compute_tflops": 300},
    "activation_budget_copy_gb_per_s-needs-a-budget": {"activation_budget_copy_gb_per_s": 50},
    "no-forward-prefetch-in-fsdp2": {"forward_prefetch": True},
    "no-local-state-dict-in-fsdp2": {"state_dict_type": "LOCAL_STATE_DICT"},
    "no-xla": {"xla": True},
    "fsdp-needs-distributed-type": {"compute_environment": "LOCAL_MACHINE", "fsdp_config": {"fsdp_version": 2}},
    "fsdp-config-needs-fsdp": {"distributed_type": "MULTI_GPU", "fsdp_config": {"fsdp_version": 2}},
    "parallelism-needs-fsdp2": {"distributed_type": "FSDP", "parallelism_config": {"parallelism_config_dp_shard_size": 2}},
}


def test_validate_refuses_auto_in_a_file_for_the_cpu_until_it_states_a_size(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]):
    """The example CPU file with `activation_memory_budget: auto`: `validate` said OK, and the
    launch loaded the model and stopped at the first forward."""
    from fsdp_offload_cfg import cli

    cpu_file = (Path(__file__).parent.parent / "examples" / "fsdp2_cpu.yaml").read_text()
    assert "use_cpu: true" in cpu_file
    auto = cpu_file.replace("fsdp_config:\n", "fsdp_config:\n  fsdp_activation_memory_budget: auto\n", 1)
    path = write(tmp_path, "auto.yaml", auto)
    assert cli.main(["validate", path]) == 1
    out = capsys.readouterr()
    assert "fsdp_config.fsdp_activation_memory_budget" in out.out + out.err, out
    assert "use_cpu: true computes on the CPU" in out.out + out.err, out
    assert "fsdp_activation_budget_device_memory (such as 8GiB)" in out.out + out.err, out
    stated = auto.replace("fsdp_activation_memory_budget: auto\n",
                          "fsdp_activation_memory_budget: auto\n  fsdp_activation_budget_device_memory: 8GiB\n")
    assert cli.main(["validate", write(tmp_path, "stated.yaml", stated)]) == 0
    on_gpus = auto.replace("use_cpu: true", "use_cpu: false")
    assert cli.main(["validate", write(tmp_path, "gpus.yaml", on_gpus)]) == 0


@pytest.mark.parametrize("name", sorted(RULE_CASES))
def test_each_rule_fires_alone_on_its_case(name: str):
    from fsdp_offload_cfg.config.rules import RULES

    (rule,) = [r for r in RULES if r.name == name]
    problem = only_problem(RULE_CASES[name])
    assert problem.path.rpartition(".")[2].removeprefix("fsdp_") == rule.at


# -------------------------------------------------------------------------------------------
# validate agrees with what will run
# -------------------------------------------------------------------------------------------


def test_distributed_type_is_case_sensitive_like_accelerate(tmp_path: Path):
    """accelerate builds `DistributedType("fsdp")`, which raises; mixed_precision it lowercases."""
    path = write(tmp_path, "a.yaml", "distributed_type: fsdp\nmixed_precision: BF16\nfsdp_config:\n  fsdp_version: 2\n")
    problem = only_problem(path)
    assert (problem.path, problem.message) == ("distributed_type", problem.message)
    assert "FSDP" in problem.message and 'got "fsdp"' in problem.message
    assert load_config(path, ["distributed_type=FSDP"]).mixed_precision == "bf16"


@pytest.mark.parametrize("text", [
    '{"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2,}}',
    '{"fsdp": "full_shard", // FSDP on\n "fsdp_config": {"fsdp_version": 2}}',
    "{'fsdp': 'full_shard', 'fsdp_config': {'fsdp_version': 2}}",
])
def test_a_json_file_is_read_as_json_like_transformers_does(text: str, tmp_path: Path):
    path = write(tmp_path, "args.json", text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert problem.file == path and "not valid JSON" in problem.message and "json.load" in problem.message
    assert info.value.exit_code in (1, 2)


def test_a_yaml_readable_json_file_is_invalid_not_unreadable(tmp_path: Path):
    path = write(tmp_path, "args.json", "{'fsdp': 'full_shard', 'fsdp_config': {'fsdp_version': 2}}")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.exit_code == 1


def test_load_strategy_under_fsdp1_is_refused(tmp_path: Path):
    path = write(tmp_path, "a.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 1\n"
                 "  fsdp_cpu_ram_efficient_loading: true\n  fsdp_load_strategy: sharded\n")
    problem = only_problem(path)
    assert problem.path == "fsdp_config.fsdp_load_strategy" and "only applies with FSDP2" in problem.message


def test_messages_show_the_value_as_written():
    problem = only_problem({"version": 2, "reshard_after_forward": 1})
    assert "got 1 " in problem.message and 'got "FULL_SHARD"' not in problem.message


def test_true_and_an_empty_mapping_both_enable_the_offload_and_do_not_conflict():
    config = load_config({"activation_cpu_offload": True, "fsdp_activation_cpu_offload": {}})
    assert config.activation_cpu_offload == ActivationOffloadConfig(enabled=True)
    problem = only_problem({"activation_cpu_offload": False, "fsdp_activation_cpu_offload": {}})
    assert "conflicts with" in problem.message


def test_messages_spell_keys_as_the_file_does(tmp_path: Path):
    path = write(tmp_path, "a.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
                 "  fsdp_cpu_ram_efficient_loading: true\n  fsdp_sync_module_states: false\n")
    problem = only_problem(path)
    assert problem.path == "fsdp_config.fsdp_sync_module_states"
    assert "when fsdp_cpu_ram_efficient_loading is true" in problem.message
    unprefixed = only_problem({"cpu_ram_efficient_loading": True, "sync_module_states": False})
    assert "when cpu_ram_efficient_loading is true" in unprefixed.message
    defaulted = only_problem({"fsdp_activation_checkpointing_offload": True})
    assert "needs fsdp_activation_checkpointing: true" in defaulted.message


def test_a_launch_file_is_judged_as_accelerate_launch_reads_it(tmp_path: Path):
    """`accelerate launch` exports a YAML list of layer classes as the text "['LlamaDecoderLayer']",
    which every rank then refused; `validate` passed the file. A list stays right where no launcher
    turns it into text: a mapping given in code, a Trainer's fsdp_config file."""
    launch = tmp_path / "fsdp2.yaml"
    launch.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
                      "  fsdp_transformer_layer_cls_to_wrap: [LlamaDecoderLayer, Qwen2DecoderLayer]\n")
    with pytest.raises(ConfigError) as error:
        load_config(launch)
    (problem,) = error.value.problems
    assert (problem.file, problem.path) == (str(launch), "fsdp_config.fsdp_transformer_layer_cls_to_wrap")
    assert "\"['LlamaDecoderLayer', 'Qwen2DecoderLayer']\"" in problem.message, problem.message
    assert problem.message.endswith("fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer,Qwen2DecoderLayer")
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(launch.read_text().replace("[LlamaDecoderLayer, Qwen2DecoderLayer]",
                                                "LlamaDecoderLayer,Qwen2DecoderLayer"))
    expected = ("LlamaDecoderLayer", "Qwen2DecoderLayer")
    assert load_config(fixed).transformer_layer_cls_to_wrap == expected
    assert load_config(yaml.safe_load(launch.read_text())).transformer_layer_cls_to_wrap == expected
    trainer = tmp_path / "trainer.json"
    trainer.write_text(json.dumps({"fsdp": "full_shard auto_wrap", "fsdp_config": {
        "fsdp_version": 2, "transformer_layer_cls_to_wrap": list(expected)}}))
    assert load_config(trainer).transformer_layer_cls_to_wrap == expected


@pytest.mark.parametrize("key, shown, named", [
    ("fsdp_versi\u043en", "fsdp_versi\\u043en", "U+043E CYRILLIC SMALL LETTER O"),
    ("fsdp_\u200bversion", "fsdp_\\u200bversion", "U+200B ZERO WIDTH SPACE"),
    ("activation_cpu_offload.m\u043ede", "activation_cpu_offload.m\\u043ede", "U+043E CYRILLIC SMALL LETTER O"),
])
def test_a_look_alike_key_is_shown_escaped_beside_its_suggestion(tmp_path: Path, key: str, shown: str, named: str):
    """Printed as written, the foreign letter made the key and the suggestion read the same."""
    path = tmp_path / "f.yaml"
    outer, _, inner = key.partition(".")
    body = f"  {outer}:\n    {inner}: async\n" if inner else f"  {key}: 2\n"
    path.write_text("distributed_type: FSDP\nfsdp_config:\n" + body, encoding="utf-8")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    (problem,) = error.value.problems
    assert problem.path == f"fsdp_config.{shown}" and str(problem).isascii(), str(problem)
    assert f"not plain ASCII: {named}; retype it" in problem.message and "did you mean" in problem.message, problem


def test_an_unquoted_no_is_said_to_be_yamls_false(tmp_path: Path):
    """`mixed_precision: no` (or `--set mixed_precision=no`) is YAML's false, as accelerate reads it:
    the message said "got false" of a value the user typed as no."""
    path = tmp_path / "a.yaml"
    path.write_text("distributed_type: FSDP\nmixed_precision: no\nfsdp_config:\n  fsdp_version: 2\n")
    hint = "mixed_precision: expected one of no, fp8, fp16, bf16; got false (YAML reads an unquoted no as false: " \
           "write 'no', in quotes)"
    with pytest.raises(ConfigError) as caught:
        load_config(str(path))
    assert str(caught.value) == f"{path}: {hint}"
    path.write_text("distributed_type: FSDP\nmixed_precision: 'no'\nfsdp_config:\n  fsdp_version: 2\n")
    with pytest.raises(ConfigError) as caught:
        load_config(str(path), ["mixed_precision=no"])
    assert hint in str(caught.value)
    assert load_config(str(path), ["mixed_precision='no'"]).mixed_precision == "no"
