"""The docs speak to users: no internal work-unit names, and the benchmarks open with today's
result for each feature (what, figure, machine, command, date)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what users read: the README, the docs, the scripts they run, the package and benchmark sources
READ_BY_USERS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "scripts").glob("*")),
                 *sorted((ROOT / "fsdp_offload_cfg").rglob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py")),
                 *sorted((ROOT / "examples").glob("*"))]
WORK_UNIT = re.compile(r"\b(?:stops?|issues?) [0-9]+\b", re.IGNORECASE)


def test_no_internal_work_unit_names():
    """A figure says its date, machine, commit and command; "stop 44" or "issue 23" means nothing
    to a reader outside the team (38 places did)."""
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in READ_BY_USERS if path.is_file()
             for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if WORK_UNIT.search(line)]
    assert not found, "\n".join(found)


def test_the_benchmarks_open_with_todays_result_per_feature():
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    first_table = text[:text.index("\n## ")]  # before the first section
    header = next(line for line in first_table.splitlines() if line.startswith("|"))
    assert [c.strip() for c in header.strip("|").split("|")] == ["what", "figure", "machine", "command", "date, commit"]
    rows = [line for line in first_table.splitlines() if line.startswith("|")][2:]
    assert len(rows) >= 8, rows
    for row in rows:  # every row dated and its commit named
        assert re.search(r"\| 20\d\d-\d\d-\d\d, `[0-9a-f]{7}` \|$", row), row


def test_the_readmes_estimate_output_is_what_the_cli_prints(capsys, monkeypatch):
    """The README's "Will it fit?" shows the estimate's output for its command. Its activation
    rows (saved, on the device, host) are the same on every leg and must match the CLI's, line
    for line (they had drifted: sizes print as `0 B`, not `0.0 MiB`); the states and peaks depend
    on the installed accelerate's master weights, so the README shows the newest leg's."""
    import shlex

    from fsdp_offload_cfg import cli

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = next(line for line in readme.splitlines() if line.startswith("fsdp-offload-cfg estimate examples/"))
    output = readme[readme.index(command):].split("\n```\n\n```\n", 1)[1]  # the command's block, then its output's
    monkeypatch.chdir(ROOT)
    assert cli.main(shlex.split(command)[1:]) == 0
    printed = capsys.readouterr().out

    def activation_rows(text: str) -> list[str]:
        table = text[text.index("| activations | saved |"):].split("\n\n", 1)[0]
        return ["|".join(line.split("|")[:5]) for line in table.splitlines()]  # setting, saved, device, host

    assert activation_rows(output[:output.index("\n```")]) == activation_rows(printed)


def _package_string_literals() -> list[str]:
    """Every string literal of the package, implicit concatenations joined as Python joins them, an
    f-string's replacement fields as `…`, whitespace runs as one space."""
    import ast

    def text(node: ast.AST) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return "".join(text(v) if isinstance(v, ast.Constant) else "…" for v in node.values)  # an f-string

    literals = []
    for path in sorted((ROOT / "fsdp_offload_cfg").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                literals.append(" ".join(text(node).split()))
    return literals


def test_the_troubleshooting_pages_messages_are_the_packages_own_words():
    """docs/troubleshooting.md is found by searching for a message: each `>` line there must still
    be what the package says, or the page sends users nowhere. The words between two `…` (where a
    name or a number goes) must stand in one of the package's strings as written."""
    page = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    quoted = [line[2:] for line in page.splitlines() if line.startswith("> ")]
    assert len(quoted) >= 15, quoted
    literals = _package_string_literals()
    missing = [(line, part) for line in quoted for part in (p.strip() for p in line.split("…"))
               if len(part) >= 8 and not any(part in literal for literal in literals)]
    assert not missing, missing


def test_the_troubleshooting_pages_references_name_sections_that_exist():
    """Its "see `docs/x.md`, "Section"" pointers must lead somewhere: a heading of that page, or a
    paragraph opening in bold, that holds the words."""
    page = " ".join((ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8").split())
    references = re.findall(r'`docs/([a-z]+\.md)`, "([^"]+)"', page)
    assert len(references) >= 6, references
    dangling = []
    for name, section in references:
        lines = (ROOT / "docs" / name).read_text(encoding="utf-8").splitlines()
        openings = [line for line in lines if line.startswith("#") or line.startswith("**")]
        if not any(section in line for line in openings):
            dangling.append((name, section))
    assert not dangling, dangling
