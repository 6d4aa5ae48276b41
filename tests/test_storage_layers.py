"""Storage and config keep their layering: imports point down only (no cycle, TYPE_CHECKING
imports included), config imports nothing from storage, and no module reaches into
another module's `_private` names. Read from the source with ast, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "queued"
PACKAGES = ("storage", "config")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            name = f"queued.{package}" if path.stem == "__init__" else \
                f"queued.{package}.{path.stem}"
            found[name] = path
    return found


def local_imports(path: Path) -> set[str]:
    """queued.* modules `path` imports, anywhere in the file (TYPE_CHECKING blocks too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("queued.")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("queued"):
            assert node.level == 0, f"{path}: relative import"
            module = node.module or ""
            names.add(module)
            # `from queued.storage import compaction` imports a module, not a name
            names |= {f"{module}.{a.name}" for a in node.names
                      if (ROOT.parent / module.replace(".", "/") / f"{a.name}.py").exists()}
    return names


def test_storage_and_config_imports_have_no_cycle() -> None:
    mods = modules()
    graph = {name: {m for m in local_imports(path) if m in mods} for name, path in mods.items()}
    assert "queued.storage.files" in graph["queued.storage.writer"]  # the scan sees edges
    visiting: list[str] = []
    done: set[str] = set()

    def visit(name: str) -> None:
        assert name not in visiting, "import cycle: " + " -> ".join([*visiting, name])
        if name in done:
            return
        visiting.append(name)
        for dep in sorted(graph[name]):
            visit(dep)
        visiting.pop()
        done.add(name)

    for name in graph:
        visit(name)


def test_config_imports_nothing_from_storage() -> None:
    for name, path in modules().items():
        if name.startswith("queued.config"):
            assert not any(m.startswith("queued.storage") for m in local_imports(path)), name


def test_no_module_touches_another_modules_private_names() -> None:
    for name, path in modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        # Private names this module defines: its functions, methods and self._x attributes.
        own = {n.name for n in ast.walk(tree)
               if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
        own |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id == "self"}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{name} imports {private} from {node.module}"
            elif (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                  and not node.attr.startswith("__") and node.attr not in own):
                raise AssertionError(f"{name}:{node.lineno}: {ast.unparse(node)}")
