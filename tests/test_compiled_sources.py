"""What the source of a compiled module (tools/build_compiled.py's COMPILED) must not do
because mypyc compiles it to something else than Python runs: a call in a slice's bound;
and, read from the compiled build's C, what its hot functions must not do because it
costs: look a module constant up by name.
mypyc (mypy 2.4.1) computes a memoryview's slice bound, drops the value and computes it
again, so `view[os.write(fd, view):]` writes twice: after a short writev, the compiled
build wrote the rest of a piece twice into the journal that way (found by
tests/test_storage_writer.py's short-writev test; the generated IR calls the bound's
function on two paths one after the other)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from compiled_util import BUILD, compiled_module_names

from tools.compiled_globals import scan

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


#: The functions every request (or every pass) runs, by module, and the module globals
#: they may still look up by name: `fileio` (the seam the power-loss tests replace:
#: looked up at each call, so the replacement holds), `log`, and the constants a test
#: replaces on the module (LINGER, SLOW_PASS, MAX_BATCH_BYTES).
HOT: dict[str, tuple[str, ...]] = {
    "queued.server.reactor": ("Reactor____read", "Reactor____run", "Reactor____finish",
                              "Reactor____took"),
    "queued.server.connections": ("Connections___send_raw", "Connections___set_mask"),
    "queued.storage.synced_files": ("_writev_all", "SegmentFile___write"),
    "queued.storage.journal": ("QueueJournal____append_one", "QueueJournal___append_nowait",
                               "QueueJournal___finish_round"),
    "queued.storage.files": ("SegmentInfo___note_batch",),
    "queued.storage.writer": ("Writer___write_round_now",),
    "queued.journal.records": ("put_head", "encode_check_crc", "crc_seed"),
    "queued.broker.queues": ("QueueState____inflight", "QueueState___drain"),
    "queued.broker.base": ("wall_ms",),
    "queued.broker.puts": ("JoinedPuts___add", "JoinedPuts____begin", "JoinedPuts___end_all"),
    "queued.reader.state": ("Reader____mem", "Reader___add", "pack_max_for"),
}
ALLOWED = {"fileio", "log", "LINGER", "LINGER_BUDGET", "SLOW_PASS", "MAX_BATCH_BYTES"}


@pytest.mark.skipif(BUILD is None or not (BUILD / "build").is_dir(),
                    reason="reads the compiled build's C (make test-compiled)")
def test_hot_compiled_functions_look_no_module_constant_up_by_name() -> None:
    """A module constant without `Final` (or a function or class imported from a module
    that is not compiled) is a look-up in the module's globals at each use, ~130
    instructions; `Final`, it is a C static (tools/compiled_globals.py lists them all)."""
    assert BUILD is not None
    found = scan(BUILD / "build")
    looked_up = {}
    for module, functions in HOT.items():
        by_function = found.get(module, {})
        for function in functions:
            assert function in by_function or _compiled(module, function), (module, function)
            names = set(by_function.get(function, ())) - ALLOWED
            if names:
                looked_up[f"{module}.{function}"] = sorted(names)
    assert looked_up == {}, "make these Final (or import them by name into a Final)"


def _compiled(module: str, function: str) -> bool:
    """The function is in the build's C at all (it may look nothing up)."""
    assert BUILD is not None
    c_file = BUILD / "build" / ("__native_" + module.replace(".", "___") + ".c")
    return f"___{function}(" in c_file.read_text(errors="replace")
