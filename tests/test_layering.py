"""The package's layers, checked from the source (every import counts: TYPE_CHECKING ones
and those inside functions too).

- the pure layers (queued.errors/sansio/stats, queued/journal, queued/wire, queued/reader, the
  client's pure parts) import no trio/socket/os/time;
- each layer imports only the layers below it (storage nothing of the broker or server,
  the client nothing but the core, ...);
- no import cycles between modules;
- no module touches another module's `_private` names.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import queued

ROOT = Path(queued.__file__).resolve().parent
#: Modules of the pure layer and what they may never import (directly or through another
#: queued module).
PURE = ("queued.errors", "queued.sansio", "queued.stats", "queued.wire.", "queued.journal.",
        "queued.reader.", "queued.client.common", "queued.client.servers", "queued.client.framing")
FORBIDDEN = {"trio", "socket", "os", "time", "prometheus_client", "select", "selectors",
             "threading", "asyncio", "subprocess", "importlib"}
#: Layer of each module (by prefix, longest first) and the layers it may import.
LAYERS = {
    "queued": "base", "queued.errors": "base", "queued.sansio": "base", "queued.stats": "base",
    "queued.journal.": "journal", "queued.wire.": "wire", "queued.reader.": "reader",
    "queued.config.": "config", "queued.storage.": "storage", "queued.broker.": "broker",
    "queued.server.": "server", "queued.client.": "client", "queued.spark.": "spark",
    "queued.cli": "cli", "queued.cli_stdout": "cli", "queued.logs": "cli",
}
#: The pure layers (base, journal, wire, reader) at the bottom; the broker knows no wire
#: format, the client no journal, storage no protocol.
ALLOWED = {
    "base": {"base"},
    "journal": {"base", "journal"},
    "wire": {"base", "journal", "wire"},
    "reader": {"base", "journal", "reader"},
    "config": {"base", "journal", "wire", "config"},
    "storage": {"base", "journal", "reader", "config", "storage"},
    "broker": {"base", "journal", "reader", "config", "storage", "broker"},
    "server": {"base", "journal", "wire", "reader", "config", "storage", "broker", "server"},
    "client": {"base", "wire", "client"},
    "spark": {"base", "journal", "config", "storage", "client", "spark"},
    "cli": {"base", "journal", "wire", "reader", "config", "storage", "broker", "server",
            "client", "cli"},
}


def module_name(path: Path) -> str:
    parts = ("queued", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer(module: str) -> str:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix.rstrip(".") or (prefix.endswith(".") and module.startswith(prefix)):
            return LAYERS[prefix]
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


def imports(module: str) -> Iterator[tuple[str, int]]:
    """(imported module, line) of every import in `module`; `from pkg import sub` names the
    submodule when there is one."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in MODULES else base), node.lineno


def internal_graph() -> dict[str, set[str]]:
    return {m: {t for t, _ in imports(m) if t in MODULES and t != m} for m in MODULES}


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        assert layer(module) in ALLOWED


@pytest.mark.parametrize("module", [m for m in MODULES if m.startswith(PURE)])
def test_the_pure_layer_does_no_io(module: str) -> None:
    graph = internal_graph()
    seen, todo = {module}, [module]
    while todo:  # what it imports from queued counts too
        current = todo.pop()
        for target, line in imports(current):
            root = target.split(".")[0]
            assert root not in FORBIDDEN, f"{current}:{line} imports {target}"
        for target in graph[current] - seen:
            seen.add(target)
            todo.append(target)


def test_imports_point_down_only() -> None:
    wrong = []
    for module in MODULES:
        mine = layer(module)
        for target, line in imports(module):
            if target in MODULES and layer(target) not in ALLOWED[mine]:
                wrong.append(f"{module}:{line} ({mine}) imports {target} ({layer(target)})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    graph = internal_graph()
    # A package's __init__ that re-exports its submodules is imported by them only as the
    # package itself; such an edge is not a dependency of the submodule on its siblings.
    for module, targets in graph.items():
        graph[module] = {t for t in targets if not module.startswith(t + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle = [*stack[stack.index(t):], t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    sys.setrecursionlimit(max(1000, 10 * len(graph)))
    for m in sorted(graph):
        if m not in state:
            visit(m)


def defined_names(tree: ast.Module) -> set[str]:
    """Every name a module defines: functions, classes, assignments, self/cls attributes,
    slots."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # __slots__ entries
    return names


def test_no_module_touches_another_modules_private_names() -> None:
    wrong = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        own = defined_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                wrong += [f"{module}:{node.lineno} imports {node.module}.{a.name}"
                          for a in node.names if a.name.startswith("_")
                          and not a.name.startswith("__")]
            elif (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                  and not node.attr.startswith("__") and node.attr not in own):
                wrong.append(f"{module}:{node.lineno} touches {ast.unparse(node)}")
    assert not wrong, "\n".join(wrong)


def test_the_checks_can_fail() -> None:
    """The checks above see what they look for (a check that cannot fail proves nothing)."""
    cycle = ast.parse("from queued.server.session import Session\nx = y._secret\n")
    found = [n for n in ast.walk(cycle) if isinstance(n, ast.ImportFrom)]
    assert found and layer("queued.storage.journal") == "storage"
    assert "server" not in ALLOWED["storage"]
    assert "_secret" not in defined_names(cycle)
    assert layer("queued.wire.parsing") == "wire" and layer("queued.broker.broker") == "broker"
