"""The autopatch hook as part of the installed package: listed in its RECORD, so that
`pip uninstall fsdp-offload-cfg` removes it with everything else.

A `.pth` file that outlives its package runs on every Python start. pip removes exactly the
files the distribution's RECORD lists (paths relative to the folder that holds the `.dist-info`),
so `install-hook` adds the hook's row there when the hook sits in that folder, and
`uninstall-hook` takes the row out again. A hook in any other folder is not the package's to
list; `install-hook` says so.
"""

from __future__ import annotations

import csv
import io
import os
from importlib import metadata

DISTRIBUTION = "fsdp-offload-cfg"


def _record(folder: str) -> str | None:
    """The RECORD of the distribution installed in `folder` (its rows are relative to it), if any.
    Looked up in that folder only: a source checkout's `.egg-info` earlier on the path is not it."""
    for dist in metadata.distributions(name=DISTRIBUTION, path=[folder]):
        for file in dist.files or []:
            if file.name == "RECORD" and file.parent.name.endswith(".dist-info"):
                return os.path.abspath(str(file.locate()))
    return None


def _rows(record: str) -> list[list[str]]:
    with open(record, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def _write(record: str, rows: list[list[str]]) -> None:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    with open(record, "w", encoding="utf-8") as f:
        f.write(out.getvalue())


def add(path: str) -> bool:
    """List the hook at `path` in the RECORD of the package installed beside it; False where
    there is none (the hook is then not the package's to list)."""
    record, name = _record(os.path.dirname(path)), os.path.basename(path)
    if record is None:
        return False
    rows = _rows(record)
    if not any(row and row[0] == name for row in rows):
        _write(record, [*rows, [name, "", ""]])
    return True


def remove(path: str) -> None:
    """Take the hook's row out of RECORD (pip would otherwise look for a file that is gone)."""
    record, name = _record(os.path.dirname(path)), os.path.basename(path)
    if record is not None:
        _write(record, [row for row in _rows(record) if not (row and row[0] == name)])
