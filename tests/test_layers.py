"""The package's import graph: no cycle, and no module importing one on a floor above its own.

Floors, lowest first (a module may import its own floor and those below): the ground helpers;
the config and the agreement rule every rank follows (`ranks.py`, which raises the config's
error); the per-version compat code (and `layer_classes`, which reads both transformers' layer lists one way); the offload; loading; the estimate; what acts on a model
at prepare, in training and when it is saved (ties, dtypes, the budget, the KV cache, the vision tower, saving and its streamed writes); the integrations with accelerate,
transformers, TRL and PEFT; then the entry points (patching, the CLI, the plugins frameworks
load by name, the autopatch hook) with the package's lazy facade. Imports inside functions count
as much as those at the top: a cycle hidden in a function still ties two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fsdp_offload_cfg"

FLOORS: list[tuple[str, ...]] = [
    ("_sizes", "_logging", "_lazy", "_signatures", "_script", "safetensors_index", "safetensors_writer", "model_state"),
    ("config", "ranks", "offload.options"),  # the offload's options are a leaf the config reads
    ("compat", "layer_classes"),  # layer_classes: what transformers 4 and 5 declare as layers, read one way
    ("offload",),
    ("loading",),
    ("estimate",),
    ("tie_groups", "dtype_groups", "shard_groups", "budget", "training_cache", "vision_sync", "saving", "streamed_save",
     "clean_exit", "post_import"),
    ("integrations", "registry"),
    # entry points: what users and frameworks call or load by name (the frameworks' plugins, and
    # the documented path of axolotl's, `fsdp_offload_cfg.integrations.axolotl`, which re-exports
    # it), and the package itself, whose lazy exports are the public API they use
    # (`import fsdp_offload_cfg; fsdp_offload_cfg.patch()`)
    ("patching", "discovery", "launch_command", "autopatch", "hook_record", "cli", "__main__", "_bootstrap", "plugins",
     "integrations.axolotl", ""),
    ("testing",),  # the test kit: it may use anything, nothing in the package uses it
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports anywhere in its body (names relative to the package:
    "" is the package itself); `from pkg import mod` counts as importing `pkg.mod`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [_short(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = _short(node.module or "")
            targets = [f"{base}.{a.name}".lstrip(".") if f"{base}.{a.name}".lstrip(".") in modules else base
                       for a in node.names]
        else:
            continue
        out.update(t for t in targets if t is not None and t in modules and t != name)
    return out


def _short(module: str) -> str | None:
    """`fsdp_offload_cfg.x.y` as `x.y` ("" for the package); None outside the package."""
    if module == "fsdp_offload_cfg" or module.startswith("fsdp_offload_cfg."):
        return module.removeprefix("fsdp_offload_cfg").lstrip(".")
    return None


def _floor(name: str) -> int:
    best, length = len(FLOORS), -1
    for floor, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > length:
                best, length = floor, len(prefix)
    return best


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_floor():
    assert [name for name in _modules() if _floor(name) == len(FLOORS)] == []


def test_no_module_imports_one_on_a_higher_floor():
    upward = [f"{name} -> {target}" for name, targets in _graph().items() for target in sorted(targets)
              if _floor(target) > _floor(name)]
    assert upward == []


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []
