"""The typed model every other module consumes: `FSDPOffloadConfig`, and the errors of reading one.

`FSDPOffloadConfig` is generated from `keys.KEYS` (one field per key that has one, in table
order) plus the launch keys and `source`. It is frozen and hashable. `source` says where the
values came from, for messages; it is not part of equality, so the same settings read from
`./a.yaml` and `a.yaml` are the same config (and `patch()` does not re-apply).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fsdp_offload_cfg.config.keys import FIELD_KEYS, LAUNCH
from fsdp_offload_cfg.offload.options import ActivationOffloadConfig


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: where (file, key path) and what was expected."""

    file: str
    path: str
    message: str

    def __str__(self) -> str:
        return ": ".join(part for part in (self.file, self.path, self.message) if part)


class ConfigError(ValueError):
    """Every problem found in a config, reported together (file, key path, what was expected).

    `problems` holds them one by one (the CLI prints them as JSON). `unreadable` is True when
    the file itself could not be read or parsed, as opposed to holding bad values; `exit_code`
    is what the CLI (and `patch()` under a launcher) exits with: 2 unreadable, 1 invalid.
    """

    def __init__(self, problems: Sequence[Problem] | str, *, unreadable: bool = False) -> None:
        if isinstance(problems, str):
            problems = [Problem("", "", problems)]
        self.problems: list[Problem] = list(problems)
        self.unreadable = unreadable
        super().__init__("\n".join(str(p) for p in self.problems))

    @property
    def exit_code(self) -> int:
        return 2 if self.unreadable else 1

    def __reduce__(self) -> tuple[Any, ...]:  # survive pickling between processes, problems included
        return (type(self), (self.problems,), {"unreadable": self.unreadable})


def _field(default: Any) -> Any:
    if dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=type(default))  # type: ignore[arg-type]
    return dataclasses.field(default=default)


FSDPOffloadConfig = dataclasses.make_dataclass(
    "FSDPOffloadConfig",
    [(k.name, k.annotation, _field(k.default)) for k in FIELD_KEYS]
    + [(k.name, k.annotation, dataclasses.field(default=None)) for k in LAUNCH]
    + [("source", "str", dataclasses.field(default="<defaults>", compare=False))],
    frozen=True,
    namespace={
        "__doc__": "Normalised fsdp_config plus the launch keys we read; defaults filled in. Fields: the keys "
                   "of fsdp_offload_cfg.config.keys.KEYS (names without `fsdp_`), the launch keys "
                   "(None when the source had none), and `source` (where it came from; not compared).",
        "__module__": __name__,
    },
)


def normalized_dict(config: Any) -> dict[str, Any]:
    """The effective config as plain JSON/YAML-able data (for logs)."""
    data = dataclasses.asdict(config)
    if data["transformer_layer_cls_to_wrap"] is not None:
        data["transformer_layer_cls_to_wrap"] = list(data["transformer_layer_cls_to_wrap"])
    return data


__all__ = ["ActivationOffloadConfig", "ConfigError", "FSDPOffloadConfig", "Problem", "normalized_dict"]
