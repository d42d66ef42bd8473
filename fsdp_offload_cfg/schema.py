"""The JSON Schema of one `fsdp_config` mapping, and the two things the loader does with it.

The schema file (`schemas/fsdp_config.schema.json`, shipped as package data) is the single
source of truth for key names and value types. This module:

- loads it (package data first, the repository copy as a fallback for source checkouts);
- `coerce`s values into their canonical form *by reading the schema*: "true" -> True, "8" -> 8,
  "full_shard" -> "FULL_SHARD". accelerate's CLI and environment hand us strings, and
  accelerate itself is case-insensitive about enum names, so we accept what it accepts;
- `validate`s and turns jsonschema errors into `(key path, message)` pairs that say what was
  expected, for `fsdp_offload_cfg.config.ConfigError`.

It knows nothing about files, spellings or rules between keys; `config.py` does.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

SCHEMA_FILE = "fsdp_config.schema.json"
_PREFIXED_KEY = re.compile(r"^\^\(fsdp_\)\?(\w+)\$$")  # "^(fsdp_)?offload_params$"
_INTEGER_TEXT = re.compile(r"([0-9]+)(\.0*)?")  # "8"; "100000000.0" as accelerate 1.10 exports FSDP_MIN_NUM_PARAMS

KeyPath = tuple[Any, ...]


@functools.cache
def load_schema() -> dict[str, Any]:
    """The schema as a dict: the wheel's package data, else the source checkout's `schemas/`."""
    try:
        text = (resources.files("fsdp_offload_cfg") / "schemas" / SCHEMA_FILE).read_text("utf-8")
    except (FileNotFoundError, NotADirectoryError, ModuleNotFoundError):
        text = (Path(__file__).resolve().parent.parent / "schemas" / SCHEMA_FILE).read_text("utf-8")
    return json.loads(text)


def schema_text() -> str:
    """The schema, pretty-printed (what `fsdp-offload-cfg schema` prints)."""
    return json.dumps(load_schema(), indent=2) + "\n"


@functools.cache
def canonical_keys() -> tuple[str, ...]:
    """fsdp_config key names without the `fsdp_` prefix, in schema order."""
    names = []
    for pattern in load_schema()["patternProperties"]:
        match = _PREFIXED_KEY.match(pattern)
        if match is None:
            raise RuntimeError(f"schema key pattern {pattern!r} is not of the form ^(fsdp_)?name$")
        names.append(match.group(1))
    return tuple(names)


def key_schema(key: str) -> dict[str, Any]:
    """The schema node of a canonical fsdp_config key."""
    return load_schema()["patternProperties"][f"^(fsdp_)?{key}$"]


def definition(name: str) -> dict[str, Any]:
    return load_schema()["$defs"][name]


def enum_names(name: str) -> list[str]:
    """The string names of an enum definition; accelerate numbers them from 1 in this order."""
    node = definition(name)
    for branch in node.get("anyOf", [node]):
        if "enum" in branch:
            return [v for v in branch["enum"] if isinstance(v, str)]
    raise KeyError(name)


# -------------------------------------------------------------------------------------------
# coercion
# -------------------------------------------------------------------------------------------


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = definition(node["$ref"].removeprefix("#/$defs/"))
    return node


def coerce(value: Any, node: dict[str, Any]) -> Any:
    """Bring `value` into the canonical form `node` describes, or return it unchanged.

    Never raises and never invents a value: what cannot be converted is left for `validate` to
    report, so error messages show what the user wrote.
    """
    node = _resolve(node)
    if "if" in node:  # activation_cpu_offload: a mapping, else a bool
        branch = node["then"] if isinstance(value, dict) else node["else"]
        return coerce(value, branch)
    for branch in node.get("anyOf", ()):
        converted = coerce(value, branch)
        if converted is not value:
            return converted
    if isinstance(value, str):
        if node.get("type") == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
        integer = _INTEGER_TEXT.fullmatch(value.strip())
        if node.get("type") == "integer" and integer:
            return int(integer.group(1))
        for candidate in (value.upper(), value.lower()):
            if candidate != value and candidate in node.get("enum", ()):
                return candidate
    if isinstance(value, float) and node.get("type") == "integer" and value.is_integer():
        return int(value)
    if isinstance(value, dict) and "properties" in node:
        props = node["properties"]
        return {k: coerce(v, props[k]) if k in props else v for k, v in value.items()}
    return value


def coerce_key(key: str, value: Any) -> Any:
    """`coerce` for a canonical fsdp_config key."""
    return coerce(value, key_schema(key))


# -------------------------------------------------------------------------------------------
# validation
# -------------------------------------------------------------------------------------------


@functools.cache
def _validator(def_name: str | None) -> Draft202012Validator:
    schema = load_schema()
    if def_name is not None:  # a sub-schema that still resolves "#/$defs/..." references
        schema = {**schema["$defs"][def_name], "$defs": schema["$defs"]}
    return Draft202012Validator(schema)


def validate(instance: dict[str, Any], def_name: str | None = None) -> list[tuple[KeyPath, str]]:
    """Every problem in `instance` (canonical fsdp_config keys, or the `def_name` definition).

    Returns `(key path, message)` pairs sorted by path, one per path; messages say what was expected.
    """
    problems: dict[KeyPath, str] = {}
    for error in _validator(def_name).iter_errors(instance):
        for path, message in _explain(error):
            problems.setdefault(path, message)  # one message per key: "type" and "enum" may both fail
    return sorted(problems.items(), key=lambda p: [str(part) for part in p[0]])


def _explain(error: ValidationError) -> list[tuple[KeyPath, str]]:
    path = tuple(error.absolute_path)
    schema = error.schema if isinstance(error.schema, dict) else {}
    if error.validator == "additionalProperties":
        known = list(schema.get("properties", {}))
        extra = [k for k in error.instance if k not in known]
        return [((*path, k), unknown_key_message(k, known)) for k in extra]
    expected = schema.get("description")
    if expected is None and error.validator == "enum":
        expected = "one of " + ", ".join(str(v) for v in error.validator_value)
    return [(path, f"expected {expected or error.message}; got {show(error.instance)}")]


def unknown_key_message(key: Any, candidates: list[str], what: str = "unknown key",
                        listing: list[str] | None = None) -> str:
    """"unknown key; did you mean 'x'?" with the closest candidate, else the `listing` (default:
    the candidates; empty: none)."""
    close = difflib.get_close_matches(str(key), candidates, n=1, cutoff=0.6)
    if close:
        return f"{what}; did you mean {close[0]!r}?"
    listing = candidates if listing is None else listing
    return f"{what}; expected one of {', '.join(listing)}" if listing else what


def show(value: Any, limit: int = 80) -> str:
    """A value as the user would write it in YAML/JSON (true, null, "text"), cut at `limit`."""
    try:
        text = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
