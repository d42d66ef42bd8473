"""Progress of a long load: bytes and tensors moved, rate and time left, on a terminal only.

Why: a 140 GB checkpoint takes minutes to send or read, and a silent minute looks like a hang.
Like transformers' own loading bar: one bar per node (the node's first rank; the ranks of a node
share its terminal), drawn only when stderr is a terminal; in a log file (a launcher's, a job
scheduler's) nothing but the final summary line each strategy logs already.
"""

from __future__ import annotations

import os
import sys
from typing import IO, Any


class Progress:
    """A byte counter with a bar on `stream` when it is a terminal and this is the node's first rank."""

    def __init__(self, total_bytes: int, what: str, stream: IO[str] | None = None, min_interval_s: float = 0.5) -> None:
        stream = stream if stream is not None else sys.stderr
        first_on_node = os.environ.get("LOCAL_RANK", "0") == "0"
        self._bar: Any = None
        if total_bytes > 0 and first_on_node and _is_terminal(stream):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_bytes, desc=what, unit="B", unit_scale=True, unit_divisor=1024,
                             file=stream, leave=False, dynamic_ncols=True, mininterval=min_interval_s)  # fmt: skip
        self.tensors = 0

    def update(self, nbytes: int, tensors: int = 0) -> None:
        self.tensors += tensors
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.tensors} tensors", refresh=False)
            self._bar.update(nbytes)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False
