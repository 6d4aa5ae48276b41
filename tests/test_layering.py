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
import functools
import os
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
    "queued.cli.": "cli",
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
    yield from _imports(module)


@functools.cache
def _imports(module: str) -> tuple[tuple[str, int], ...]:
    """`imports`, each module's source parsed once per run (the checks below walk the
    whole graph once per pure module)."""
    return tuple(_parse_imports(module))


def _parse_imports(module: str) -> Iterator[tuple[str, int]]:
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


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reaches(modules: dict[str, Path]) -> list[str]:
    """Every use of a `_private` attribute that belongs to another module than the one
    using it: `obj._x` where the class that defines `_x` (the first in the MRO of obj's
    type, as mypy infers it; `self` included, so an inherited private counts too) lives
    elsewhere, `Class._x` likewise, `module._x`, and `from module import _x`.

    Where mypy cannot tell the receiver's type (Any: a module outside `modules`), the
    name decides: a reach unless the module defines such a name itself.
    """
    from mypy import build
    from mypy.modulefinder import BuildSource
    from mypy.nodes import MemberExpr, MypyFile, RefExpr, TypeInfo
    from mypy.options import Options
    from mypy.traverser import NameAndMemberCollector
    from mypy.types import (
        CallableType,
        Instance,
        LiteralType,
        NoneType,
        TupleType,
        TypeType,
        TypeVarType,
        UnionType,
        get_proper_type,
    )

    options = Options()
    options.export_types = options.preserve_asts = True
    options.incremental = False
    options.cache_dir = os.devnull
    options.follow_imports = "skip"  # the types of these modules are what matters
    options.ignore_missing_imports = True
    built = build.build([BuildSource(str(p), m) for m, p in modules.items()], options)

    def owners(typ: object, name: str) -> Iterator[str | None]:
        """The module of the class that defines `name` on each type `typ` may be."""
        typ = get_proper_type(typ)  # type: ignore[arg-type]
        if isinstance(typ, UnionType):
            for item in typ.items:
                yield from owners(item, name)
            return
        if isinstance(typ, TypeVarType):
            typ = get_proper_type(typ.upper_bound)
        if isinstance(typ, TypeType):
            typ = get_proper_type(typ.item)
        if isinstance(typ, CallableType) and typ.is_type_obj():
            typ = get_proper_type(typ.ret_type)
        if isinstance(typ, (TupleType, LiteralType)):
            typ = typ.fallback if isinstance(typ, LiteralType) else typ.partial_fallback
        if isinstance(typ, NoneType):
            return
        if isinstance(typ, Instance):
            yield next((b.module_name for b in typ.type.mro if name in b.names), None)
            return
        yield None  # Any, or a type mypy could not infer

    def owner_of(info: TypeInfo, name: str) -> str | None:
        return next((b.module_name for b in info.mro if name in b.names), None)

    wrong = []
    for module, path in modules.items():
        tree = built.graph[module].tree
        assert tree is not None, module
        own = defined_names(ast.parse(path.read_text()))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                wrong += [f"{module}:{node.lineno} imports {node.module}.{a.name}"
                          for a in node.names if private(a.name)]
        found = NameAndMemberCollector()
        tree.accept(found)
        for expr in found.member_exprs:
            if not private(expr.name):
                continue
            assert isinstance(expr, MemberExpr)
            receiver = expr.expr
            if isinstance(receiver, RefExpr) and isinstance(receiver.node, MypyFile):
                homes: list[str | None] = [receiver.node.fullname]
            elif isinstance(receiver, RefExpr) and isinstance(receiver.node, TypeInfo):
                homes = [owner_of(receiver.node, expr.name)]
            else:
                homes = list(owners(built.types.get(receiver), expr.name))
            for home in homes:
                if home == module or (home is None and expr.name in own):
                    continue
                where = home or "a type mypy cannot see"
                wrong.append(f"{module}:{expr.line} touches .{expr.name} of {where}")
    return wrong


def test_no_module_touches_another_modules_private_names() -> None:
    wrong = private_reaches(MODULES)
    assert not wrong, "\n".join(wrong)


def test_the_checks_can_fail() -> None:
    """The checks above see what they look for (a check that cannot fail proves nothing)."""
    cycle = ast.parse("from queued.server.session import Session\nx = y._secret\n")
    found = [n for n in ast.walk(cycle) if isinstance(n, ast.ImportFrom)]
    assert found and layer("queued.storage.journal") == "storage"
    assert "server" not in ALLOWED["storage"]
    assert "_secret" not in defined_names(cycle)
    assert layer("queued.wire.parsing") == "wire" and layer("queued.broker.broker") == "broker"


def test_the_private_names_check_sees_reaches_through_types(tmp_path: Path) -> None:
    """A private name of another module's class is a reach whatever this module calls its
    own names (the check used to pass any name the module also defined); the module's own
    class's private names, on any object of it, are not."""
    (tmp_path / "home.py").write_text(
        "class Box:\n"
        "    def __init__(self) -> None:\n"
        "        self._secret = 1\n\n\n"
        "def fine(box: Box) -> int:\n"
        "    return box._secret\n")
    (tmp_path / "away.py").write_text(
        "from typing import Any\n\n"
        "from home import Box\n\n\n"
        "class Mine(Box):\n"
        "    def __init__(self) -> None:\n"
        "        super().__init__()\n"
        "        self._mine = 2\n\n"
        "    def inherited(self) -> int:\n"
        "        return self._secret\n\n\n"
        "class Other:\n"
        "    def __init__(self) -> None:\n"
        "        self._secret = 3  # the same name, defined here too\n\n\n"
        "def reach(box: Box | None, other: Other, mine: Mine, x: Any) -> int:\n"
        "    assert box is not None\n"
        "    return box._secret + other._secret + mine._mine + x._mine + x._unknown\n")
    wrong = private_reaches({"home": tmp_path / "home.py", "away": tmp_path / "away.py"})
    assert sorted(wrong) == [
        "away:12 touches ._secret of home",  # inherited from another module's class
        "away:22 touches ._secret of home",  # the name is defined here too: still a reach
        "away:22 touches ._unknown of a type mypy cannot see",
    ], wrong


TESTS = Path(__file__).resolve().parent


def test_no_test_module_imports_another() -> None:
    """Helpers shared by test files live in `*_util.py` modules (tests/README.md): a test
    module that imports another runs that one's module-level set-up and couples them."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(TESTS)}:{node.lineno}: {name}" for name in names
                      if name.split(".")[-1].startswith("test_")]
    assert found == []


def layer_arrows() -> dict[tuple[str, str], int]:
    """(importing layer, imported layer) -> how many module pairs make that arrow."""
    arrows: dict[tuple[str, str], int] = {}
    for module, targets in internal_graph().items():
        for target in targets:
            if (pair := (layer(module), layer(target)))[0] != pair[1]:
                arrows[pair] = arrows.get(pair, 0) + 1
    return arrows


if __name__ == "__main__":  # the house as this test sees it: `python tests/test_layering.py`
    by_layer: dict[str, list[str]] = {}
    for name in MODULES:
        by_layer.setdefault(layer(name), []).append(name)
    arrows = layer_arrows()
    for name in ALLOWED:
        sizes = sorted((len(MODULES[m].read_text().splitlines()), m) for m in by_layer[name])
        print(f"{name:8} {len(sizes):2} modules, {sum(n for n, _ in sizes):6} lines "
              f"(largest {sizes[-1][1]}, {sizes[-1][0]})")
        print("         -> " + ", ".join(f"{to} ({n})" for (frm, to), n in sorted(arrows.items())
                                        if frm == name))
    print(f"private reaches: {len(private_reaches(MODULES))}")
