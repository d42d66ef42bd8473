"""The package's log lines, kept as text for a test to read (ranks return them to the test)."""

from __future__ import annotations

import logging
from typing import Any


class MessageLog(list):
    """The messages `logger` (and its children) emits at `level` or above, from its creation on.
    A rank that exits drops it with the process; a test in the suite's own process closes it (a
    `with` block), so later tests' lines do not pile up in it."""

    def __init__(self, logger: str = "fsdp_offload_cfg", level: int = logging.INFO) -> None:
        super().__init__()
        self._logger = logging.getLogger(logger)
        self._handler = logging.Handler(level)
        self._handler.emit = lambda record: self.append(record.getMessage())  # type: ignore[method-assign]
        self._logger.addHandler(self._handler)

    def __reduce__(self) -> tuple[type, tuple[list[str]]]:
        """Sent back from a rank as the plain list of its messages (the handler stays behind)."""
        return list, (list(self),)

    def close(self) -> None:
        self._logger.removeHandler(self._handler)

    def __enter__(self) -> MessageLog:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
