"""Files and mappings -> plain data, for any input: a `ConfigError` naming the file, never a crash.

Users and attackers write things no config should hold; every one of them must end as a
`ConfigError` (exit 1 or 2 in the CLI), never as a traceback, a `RecursionError` or a segfault:

- YAML is read the way accelerate reads it (`yaml.SafeLoader`: no code, no Python tags), but
  the event stream is scanned first, iteratively, so nesting past `MAX_DEPTH` is refused before
  the recursive composer sees it (50,000 levels overflow its C stack: the process dies, exit 139);
- tagged scalars that yaml's constructors cannot build (`!!float "abc"`, `!!bool "maybe"`,
  `!!timestamp "x"`) raise assorted exception types inside yaml; they become "cannot parse";
- a `.json` file is read with `json`, as transformers (`TrainingArguments`) and accelerate
  (`ClusterConfig.from_json_file`) read it: comments, trailing commas and single quotes pass a
  YAML reader but fail the run, so they are an invalid config here too (exit 1, not 2, because
  the file is readable: the tools that will consume it refuse it);
- duplicate keys are refused (yaml and json both keep the last silently; it is always a slip);
- whatever was parsed (or handed over as a mapping) is walked iteratively before anything
  recursive touches it: deeper than `MAX_DEPTH`, more than `MAX_NODES` (an alias bomb), or a
  cycle, and it is refused.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Mapping
from typing import Any

import yaml

from fsdp_offload_cfg.config.model import ConfigError, Problem

MAX_DEPTH = 32  # accelerate's deepest real key is 3 levels down (fsdp_config.activation_cpu_offload.mode)
MAX_NODES = 100_000  # counted with aliases expanded; real configs hold well under 1,000
MAX_BYTES = 16 * 2**20  # a TrainingArguments JSON is a few KB; /dev/zero is not a config


class _Loader(yaml.SafeLoader):
    """accelerate's loader (SafeLoader), refusing duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # unhashable key: the base class reports it properly
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}; keep one", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def read_config_file(path: str) -> dict[Any, Any]:
    """A config file as a plain dict; `ConfigError` naming the file for anything else."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(MAX_BYTES + 1)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _unreadable(path, _reason(exc) + _where_relative(path, exc)) from exc
    if len(text) > MAX_BYTES:
        raise _unreadable(path, f"larger than {MAX_BYTES // 2**20} MiB; a config file is a few KB")
    data = _parse_json_file(text, path) if path.lower().endswith(".json") else parse_yaml(text, path)
    if data is None or data == {}:
        raise ConfigError([Problem(path, "", "the file holds no settings (empty)")])
    if not isinstance(data, dict):
        raise ConfigError([Problem(path, "", f"expected a mapping at the top level, got a {type(data).__name__}")])
    return data


def parse_yaml(text: str, where: str) -> Any:
    """YAML text -> data, as accelerate's `yaml.safe_load` reads it, within the depth and size limits."""
    try:
        _check_event_depth(text, where)
        data = yaml.load(text, Loader=_Loader)
    except ConfigError:
        raise
    except Exception as exc:
        raise _unreadable(where, _reason(exc)) from exc
    check_shape(data, where)
    return data


def _parse_json_file(text: str, path: str) -> Any:
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except RecursionError as exc:
        raise _too_deep(path) from exc
    except ValueError as exc:
        try:
            parse_yaml(text, path)
            readable = True
        except ConfigError:
            readable = False  # neither JSON nor YAML: exit 2, as any unparsable file
        prefix = "" if readable else "cannot read or parse the file: "
        raise ConfigError([Problem(path, "", f"{prefix}not valid JSON ({exc}); transformers and accelerate read .json "
                                   "files with json.load, which refuses it: remove comments and trailing commas "
                                   "and use double quotes")], unreadable=not readable) from exc
    check_shape(data, path)
    return data


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"duplicate key {key!r}; keep one")
        data[key] = value
    return data


def _check_event_depth(text: str, where: str) -> None:
    """Refuse nesting past MAX_DEPTH from the event stream (the parser is a loop, the composer recurses)."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise _too_deep(where)
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def check_shape(data: Any, where: str) -> None:
    """Iteratively: refuse nesting past MAX_DEPTH, more than MAX_NODES values, or a cycle."""
    stack: list[tuple[Any, int]] = [(data, 0)]
    nodes = 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise ConfigError([Problem(where, "", f"holds more than {MAX_NODES} values (repeated YAML aliases?); "
                                       "a config file needs a few dozen")], unreadable=True)
        children = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
        for child in children:
            if isinstance(child, (Mapping, list, tuple)):
                if depth + 1 >= MAX_DEPTH:
                    raise _too_deep(where)
                stack.append((child, depth + 1))


def plain(value: Any) -> Any:
    """Deep copy of a user mapping as plain dicts/lists; enum members become their names.

    Call `check_shape` first: this recurses.
    """
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.name
    return value


def _too_deep(where: str) -> ConfigError:
    return ConfigError([Problem(where, "", f"nested deeper than {MAX_DEPTH} levels; a config file needs 3")],
                       unreadable=True)


def _unreadable(where: str, reason: str) -> ConfigError:
    return ConfigError([Problem(where, "", f"cannot read or parse the file: {reason}")], unreadable=True)


def _where_relative(path: str, exc: BaseException) -> str:
    """Where a relative path that was not found was looked for: `patch("fsdp2.yaml")` in a script
    started from another folder reads the current folder, not the script's."""
    if not isinstance(exc, FileNotFoundError) or os.path.isabs(path):
        return ""
    return f" (a relative path is read from the current folder, {os.getcwd()})"


def _reason(exc: BaseException) -> str:
    """One line saying what is wrong. A YAML error says where by line and column of the user's
    file: its own text names the parsed string (`in "<unicode string>"`) and quotes the line with
    a caret under it, which a one-line message turns into noise."""
    if isinstance(exc, yaml.MarkedYAMLError):
        what = ": ".join(" ".join(part.split()) for part in (exc.context, exc.problem) if part)
        mark = exc.problem_mark or exc.context_mark
        return what + (f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else "")
    return " ".join(str(exc).split()) or type(exc).__name__
