"""The config reader never crashes: every input ends as exit 0, 1 or 2 with the file named.

From the CLI (in process, and the installed console script for what only a real process
shows: segfaults, broken pipes) and from `patch()` under a launcher. The property tests are
derandomized: the same examples on every run, so a failure here is reproducible, never flaky.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_offload_cfg import cli
from fsdp_offload_cfg.config import ConfigError, load_config
from fsdp_offload_cfg.config.reading import MAX_DEPTH

ROOT = Path(__file__).resolve().parent.parent
GOOD = ROOT / "examples" / "fsdp2.yaml"
SCRIPT = Path(sys.executable).parent / "fsdp-offload-cfg"
PROPERTY = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _validate(path: Path | str, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = cli.main(["validate", str(path)])
    out = capsys.readouterr().out
    return code, out.splitlines()


def _assert_named(code: int, lines: list[str], path: Path | str) -> None:
    assert code in (0, 1, 2)
    assert lines and all(line.startswith(f"{path}:") for line in lines), lines


# -------------------------------------------------------------------------------------------
# The inputs the issue names
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tagged", ['!!float "abc"', '!!int "abc"', '!!bool "maybe"', '!!timestamp "x"',
                                    '!!binary "%%%"', "!!set {a: 1}", '!!python/object:os.system "x"'])
def test_yaml_tags_that_yaml_cannot_build_are_unreadable_files_named(tagged: str, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]):
    bad = tmp_path / "tagged.yaml"
    bad.write_text(f"distributed_type: FSDP\nfsdp_config:\n  fsdp_version: {tagged}\n")
    assert cli.main(["validate", str(bad), str(GOOD)]) in (1, 2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"{GOOD}: OK"  # the other files of the same call are still checked
    assert lines[0].startswith(f"{bad}: ")


def test_a_tag_yaml_cannot_construct_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    bad = tmp_path / "tagged.yaml"
    bad.write_text('fsdp_version: !!float "abc"\n')
    code, lines = _validate(bad, capsys)
    assert code == 2 and lines[0].startswith(f"{bad}: cannot read or parse the file"), lines


@pytest.mark.parametrize(("text", "said"), [
    ("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_version: 1\n",
     "duplicate key 'fsdp_version'; keep one (line 4, column 3)"),
    ("distributed_type: FSDP\nfsdp_config:\n\tfsdp_version: 2\n",
     "while scanning for the next token: found character '\\t' that cannot start any token (line 3, column 1)"),
    ("fsdp_config:\n  fsdp_version: 2\n   load_strategy: auto\n", "mapping values are not allowed here (line 3, column 17)"),
])
def test_a_yaml_slip_is_said_by_line_and_column_of_the_file(text: str, said: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]):
    """The parser's own text named the parsed string (`in "<unicode string>"`) rather than the
    file, and its quote of the line with a caret under it came out run together on one line."""
    bad = tmp_path / "fsdp2.yaml"
    bad.write_text(text)
    code, lines = _validate(bad, capsys)
    assert code == 2 and lines == [f"{bad}: cannot read or parse the file: {said}"], lines


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 100, 5000])
@pytest.mark.parametrize("style", ["flow", "block"])
def test_deep_nesting_is_refused_before_the_parser_recurses(depth: int, style: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "deep.yaml"
    if style == "flow":
        path.write_text("fsdp_config: " + "[" * depth + "]" * depth + "\n")
    else:
        path.write_text("".join(" " * i + f"k{i}:\n" for i in range(depth)) + " " * depth + "v: 1\n")
    code, lines = _validate(path, capsys)
    assert code == 2 and lines == [f"{path}: nested deeper than {MAX_DEPTH} levels; a config file needs 3"]


def test_deep_json_and_deep_mappings_are_refused(tmp_path: Path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="nested deeper") as info:
        load_config(path)
    assert info.value.exit_code == 2
    nested: dict = {}
    for _ in range(5000):
        nested = {"fsdp_config": nested}
    with pytest.raises(ConfigError, match="<dict>: nested deeper"):
        load_config(nested)
    cycle: dict = {}
    cycle["fsdp_config"] = cycle
    with pytest.raises(ConfigError, match="nested deeper"):
        load_config(cycle)


def test_an_alias_bomb_is_refused(tmp_path: Path):
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="more than 100000 values") as info:
        load_config(path)
    assert info.value.exit_code == 2


def test_an_endless_file_is_refused_not_read_to_the_end():
    with pytest.raises(ConfigError, match="/dev/zero: cannot read or parse the file: larger than 16 MiB"):
        load_config("/dev/zero")


def test_the_console_script_survives_50000_levels(tmp_path: Path):
    """This used to overflow the C stack: exit 139, nothing printed."""
    path = tmp_path / "deep.yaml"
    path.write_text("a: " + "[" * 50_000 + "]" * 50_000 + "\n")
    proc = subprocess.run([str(SCRIPT), "validate", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc
    assert proc.stdout.startswith(f"{path}: nested deeper") and "Traceback" not in proc.stderr


def test_a_closed_pipe_is_not_a_traceback(tmp_path: Path):
    """`fsdp-offload-cfg validate good.yaml | true`: the reader is gone before anything is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([str(SCRIPT), "validate", str(GOOD)], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


PATCH_UNDER_LAUNCHER = textwrap.dedent("""\
    import sys, fsdp_offload_cfg
    fsdp_offload_cfg.patch(sys.argv[1])
    print("patched")
""")


@pytest.mark.parametrize("content", ['fsdp_version: !!int "abc"\n', "a: " + "[" * 5000 + "]" * 5000 + "\n",
                                     "fsdp_config:\n  fsdp_activaton_cpu_offload: true\n"])
@pytest.mark.own_code
def test_patch_under_a_launcher_reports_the_file_without_a_traceback(content: str, tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    # both ranks at once, as a launcher starts them
    ranks = [subprocess.Popen([sys.executable, "-c", PATCH_UNDER_LAUNCHER, str(path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**env, "RANK": rank, "LOCAL_RANK": rank})
             for rank in ("0", "1")]
    (_, err), (_, other_err) = (rank.communicate(timeout=300) for rank in ranks)
    assert ranks[0].returncode == 1, err
    assert "Traceback" not in err and f"{path}: " in err, err
    # Every rank speaks for itself: the launcher kills the others when the first one exits.
    assert ranks[1].returncode == 1 and "Traceback" not in other_err, other_err
    assert other_err.startswith("[fsdp_offload_cfg rank 1] invalid config") and f"{path}: " in other_err


# -------------------------------------------------------------------------------------------
# Properties
# -------------------------------------------------------------------------------------------

NAMES = st.sampled_from(["distributed_type", "fsdp_config", "fsdp", "fsdp_version", "version",
                         "activation_cpu_offload", "fsdp_load_strategy", "mixed_precision", "num_processes", "x"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True),
                    st.text(max_size=8), st.sampled_from(["FSDP", "true", "2", "sharded", "bf16", "${x}"]))
DATA = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NAMES, inner, max_size=4),
                    max_leaves=10)
TAGS = st.sampled_from(["!!float", "!!int", "!!bool", "!!timestamp", "!!binary", "!!str", "!!null", "!!set",
                        "!!omap", "!!pairs", "!!map", "!!seq", "!!python/name:os.system", "!custom", "&a", "*a",
                        "!!merge", "<<:"])


def _dump(data: object, as_json: bool) -> str:
    return json.dumps(data, default=str) if as_json else yaml.safe_dump(data, default_flow_style=None)


@PROPERTY
@given(data=st.dictionaries(NAMES, DATA, max_size=5), as_json=st.booleans(),
       mutations=st.lists(st.tuples(st.integers(0, 10_000), st.binary(min_size=0, max_size=3)), max_size=4))
def test_any_mutated_file_gives_exit_0_1_or_2_naming_it(data: dict, as_json: bool, mutations: list,
                                                        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    raw = bytearray(_dump(data, as_json).encode())
    for where, replacement in mutations:
        where = where % (len(raw) + 1)
        raw[where:where + len(replacement)] = replacement
    path = tmp_path / ("m.json" if as_json else "m.yaml")
    path.write_bytes(bytes(raw))
    _assert_named(*_validate(path, capsys), path)


@PROPERTY
@given(tag=TAGS, value=st.sampled_from(['"abc"', '"maybe"', "x", "{a: 1}", "[1, 2]", '""', "1", "2001-13-45"]),
       key=st.sampled_from(["fsdp_version", "fsdp_activation_cpu_offload", "fsdp_min_num_params"]),
       depth=st.integers(0, 2 * MAX_DEPTH))
def test_any_tag_at_any_depth_gives_exit_0_1_or_2_naming_it(tag: str, value: str, key: str, depth: int,
                                                            tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "t.yaml"
    nested = "".join(" " * i + f"n{i}:\n" for i in range(depth))
    path.write_text(f"distributed_type: FSDP\nfsdp_config:\n  {key}: {tag} {value}\n" + nested + " " * depth + "v: 1\n")
    _assert_named(*_validate(path, capsys), path)
