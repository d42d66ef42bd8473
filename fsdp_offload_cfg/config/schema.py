"""The JSON Schema of one `fsdp_config` mapping, built from `keys.KEYS`, and what the reader does with it.

The schema is generated, never hand-edited: one pattern property per key and per alias, its type
a `$defs` entry from `keys.TYPES`. `schemas/fsdp_config.schema.json` (shipped as package data,
for editors and other tools) is this output, written by `fsdp-offload-cfg schema`; a test keeps
the two equal. This module:

- `coerce`s values into their canonical form *by reading the schema*: "true" -> True, "8" -> 8,
  "full_shard" -> "FULL_SHARD". accelerate's CLI and environment hand us strings, and
  accelerate itself is case-insensitive about fsdp_config enum names, so we accept what it
  accepts (and no more: launch keys such as `distributed_type` are case-sensitive there);
- `validate`s and turns jsonschema errors into `(key path, message)` pairs that say what was
  expected, for `ConfigError`. jsonschema is imported on first use, not with the package.

It knows nothing about files, spellings or rules between keys.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from typing import Any

from fsdp_offload_cfg.config.keys import KEYS, LAUNCH, TYPES

SCHEMA_FILE = "fsdp_config.schema.json"
_INTEGER_TEXT = re.compile(r"([0-9]+)(\.0*)?")  # "8"; "100000000.0" as accelerate 1.10 exports FSDP_MIN_NUM_PARAMS
_NUMBER_TEXT = re.compile(r"[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?|\.[0-9]+")  # "350", "0.05", "5e1": command line, environment
_DESCRIPTION = (
    "One `fsdp_config` mapping as written in an accelerate config file, a transformers TrainingArguments / "
    "ms-swift JSON, or on its own. Every key may carry the `fsdp_` prefix (`fsdp_offload_params` == "
    "`offload_params`). Accepts accelerate 1.15 keys, transformers 5.23 Trainer keys and this plugin's keys. "
    "Types only: rules between keys (FSDP1 vs FSDP2, cpu_ram_efficient_loading needs sync_module_states, ...) "
    "are checked by fsdp_offload_cfg.config after defaults are filled in, see docs/config.md. Generated from "
    "fsdp_offload_cfg/config/keys.py by `fsdp-offload-cfg schema`."
)

KeyPath = tuple[Any, ...]


def _pattern(name: str) -> str:
    return f"^(fsdp_)?{name}$"


@functools.cache
def load_schema() -> dict[str, Any]:
    """The schema as a dict, built from the key table."""
    properties: dict[str, Any] = {}
    for key in KEYS:
        node: dict[str, Any] = {"$ref": f"#/$defs/{key.type}", "description": key.doc}
        default = key.schema_default if key.schema_default is not None else key.default
        if default is not None:
            node["default"] = default
        properties[_pattern(key.name)] = node
    for key in KEYS:
        for alias in key.aliases:
            properties[_pattern(alias)] = {"$ref": f"#/$defs/{key.type}",
                                           "description": f"transformers Trainer spelling of {key.name}."}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "urn:fsdp-offload-cfg:fsdp_config.schema.json",
        "title": "fsdp_config",
        "description": _DESCRIPTION,
        "type": "object",
        "patternProperties": properties,
        "additionalProperties": False,
        "$defs": TYPES,
    }


def schema_text() -> str:
    """The schema, pretty-printed (what `fsdp-offload-cfg schema` prints and the shipped file holds)."""
    return json.dumps(load_schema(), indent=2) + "\n"


@functools.cache
def canonical_keys() -> tuple[str, ...]:
    """fsdp_config key names without the `fsdp_` prefix, aliases included, in schema order."""
    return tuple(pattern.removeprefix("^(fsdp_)?").removesuffix("$") for pattern in load_schema()["patternProperties"])


def key_schema(key: str) -> dict[str, Any]:
    """The schema node of a canonical fsdp_config key."""
    return load_schema()["patternProperties"][_pattern(key)]


def definition(name: str) -> dict[str, Any]:
    return load_schema()["$defs"][name]


def enum_names(name: str) -> list[str]:
    """The string names of an enum definition; accelerate numbers them from 1 in this order."""
    node = definition(name)
    for branch in node.get("anyOf", [node]):
        if "enum" in branch:
            return [v for v in branch["enum"] if isinstance(v, str)]
    raise KeyError(name)


def coerce_launch(name: str, value: Any) -> Any:
    """`coerce` for a top-level launch key, case-sensitive where accelerate is."""
    launch = next(k for k in LAUNCH if k.name == name)
    return coerce(value, launch.schema, change_case=not launch.case_sensitive)


# -------------------------------------------------------------------------------------------
# coercion
# -------------------------------------------------------------------------------------------


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = definition(node["$ref"].removeprefix("#/$defs/"))
    return node


def coerce(value: Any, node: dict[str, Any], change_case: bool = True) -> Any:
    """Bring `value` into the canonical form `node` describes, or return it unchanged.

    Never raises and never invents a value: what cannot be converted is left for `validate` to
    report, so error messages show what the user wrote.
    """
    node = _resolve(node)
    if "if" in node:  # activation_cpu_offload: a mapping, else a bool
        branch = node["then"] if isinstance(value, dict) else node["else"]
        return coerce(value, branch, change_case)
    for branch in node.get("anyOf", ()):
        converted = coerce(value, branch, change_case)
        if converted is not value:
            return converted
    if isinstance(value, str):
        if node.get("type") == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
        integer = _INTEGER_TEXT.fullmatch(value.strip())
        if node.get("type") == "integer" and integer:
            return int(integer.group(1))
        if node.get("type") == "number" and _NUMBER_TEXT.fullmatch(value.strip()):
            return float(value)
        for candidate in (value.upper(), value.lower()) if change_case else ():
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
def _validator(def_name: str | None) -> Any:
    from jsonschema import Draft202012Validator

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


def _explain(error: Any) -> list[tuple[KeyPath, str]]:
    path = tuple(error.absolute_path)
    schema = error.schema if isinstance(error.schema, dict) else {}
    if error.validator == "additionalProperties":
        known = list(schema.get("properties", {}))
        extra = [k for k in error.instance if k not in known]
        return [((*path, k), unknown_key_message(k, known)) for k in extra]
    expected = schema.get("description")
    if expected is None and error.validator == "enum":
        expected = "one of " + ", ".join(str(v) for v in error.validator_value)
    return [(path, f"expected {expected or error.message}; got {show(error.instance)}{_yaml_boolean_hint(error)}")]


def _yaml_boolean_hint(error: Any) -> str:
    """YAML reads an unquoted `no` (`off`, `yes`, `on`) as a boolean, as accelerate's
    `yaml.safe_load` does: `mixed_precision: no` (and `--set mixed_precision=no`) arrive as false,
    which the message would show without saying why."""
    options = error.schema.get("enum", []) if isinstance(error.schema, dict) else []
    words = {False: ("no", "off", "false"), True: ("yes", "on", "true")}.get(error.instance, ()) \
        if isinstance(error.instance, bool) else ()
    quoted = next((word for word in words if word in options), None)
    return f" (YAML reads an unquoted {quoted} as {show(error.instance)}: write '{quoted}', in quotes)" if quoted else ""


def unknown_key_message(key: Any, candidates: list[str], what: str = "unknown key",
                        listing: list[str] | None = None) -> str:
    """"unknown key; did you mean 'x'?" with the closest candidate, else the `listing` (default:
    the candidates; empty: none)."""
    close = difflib.get_close_matches(str(key), candidates, n=1, cutoff=0.6)
    foreign = _foreign_characters(str(key))
    if foreign:  # printed as is, the key would read exactly like its suggestion
        what = f"{what} (not plain ASCII: {foreign}; retype it)"
    if close:
        return f"{what}; did you mean {close[0]!r}?"
    listing = candidates if listing is None else listing
    return f"{what}; expected one of {', '.join(listing)}" if listing else what


def key_text(key: Any) -> str:
    """A key as the user wrote it, with anything outside printable ASCII escaped (`fsdp_versi\\u043en`):
    every key we know is ASCII, and a Cyrillic o or a zero-width space prints like nothing odd."""
    return str(key).encode("ascii", "backslashreplace").decode("ascii") if _foreign_characters(str(key)) else str(key)


def _foreign_characters(text: str) -> str:
    import unicodedata

    odd = [c for c in dict.fromkeys(text) if not (c.isascii() and c.isprintable())]
    return ", ".join(f"U+{ord(c):04X} {unicodedata.name(c, 'unnamed character')}" for c in odd)


def show(value: Any, limit: int = 80) -> str:
    """A value as the user would write it in YAML/JSON (true, null, "text"), cut at `limit`."""
    try:
        text = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
