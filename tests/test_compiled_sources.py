"""What the source of a compiled module (tools/build_compiled.py's COMPILED) must not do
because mypyc compiles it to something else than Python runs: a call in a slice's bound.
mypyc (mypy 2.4.1) computes a memoryview's slice bound, drops the value and computes it
again, so `view[os.write(fd, view):]` writes twice: after a short writev, the compiled
build wrote the rest of a piece twice into the journal that way (found by
tests/test_storage_writer.py's short-writev test; the generated IR calls the bound's
function on two paths one after the other)."""

from __future__ import annotations

import ast
from pathlib import Path

from compiled_util import compiled_module_names

ROOT = Path(__file__).resolve().parent.parent


def calls_in_slice_bounds(source: str) -> list[int]:
    """The lines of every slice whose lower, upper or step bound holds a call."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Slice):
            for bound in (node.lower, node.upper, node.step):
                if bound is not None and any(isinstance(n, ast.Call)
                                             and not _pure(n) for n in ast.walk(bound)):
                    lines.append(node.lineno)
    return lines


def _pure(call: ast.Call) -> bool:
    """A call of a builtin without side effects (`len(x)`, `min(a, b)`): evaluated twice,
    it gives the same value."""
    return isinstance(call.func, ast.Name) and call.func.id in {"len", "min", "max", "int"}


def test_the_check_finds_a_call_in_a_bound_and_lets_len_pass() -> None:
    assert calls_in_slice_bounds("v = v[os.write(fd, v):]\nw = w[: len(w) - 1]\n") == [1]
    assert calls_in_slice_bounds("x = b[i : i + f()]\ny = b[::g()]\n") == [1, 2]


def test_no_compiled_module_calls_a_function_in_a_slice_bound() -> None:
    found = {}
    for name in compiled_module_names():
        path = ROOT / (name.replace(".", "/") + ".py")
        lines = calls_in_slice_bounds(path.read_text())
        if lines:
            found[str(path.relative_to(ROOT))] = lines
    assert found == {}, "compute the bound first, into a name (mypyc evaluates it twice)"
