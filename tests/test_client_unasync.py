"""The blocking client is generated from the trio client: tests of that generation.

The committed queued/client/sync.py must be exactly what tools/unasync.py makes of
aio.py now (the drift check), and the generator must refuse output it cannot vouch for.
"""

from __future__ import annotations

import ast

import pytest

from tools.unasync import SOURCE, TARGET, drift, generate

#: Modules that do I/O: aio.py reaches them only through io_trio, which the generator swaps.
IO_MODULES = {"trio", "socket", "time", "threading", "selectors", "asyncio"}


def test_sync_client_is_generated_from_aio() -> None:
    diff = drift(SOURCE.read_text(), TARGET.read_text())
    assert not diff, ("queued/client/sync.py differs from what aio.py generates; edit aio.py "
                      "and run `python tools/unasync.py`:\n" + "".join(diff))


def test_drift_is_detected_either_way() -> None:
    source, committed = SOURCE.read_text(), TARGET.read_text()
    assert drift(source, committed.replace("def put(", "def put_one(", 1))
    assert drift(source.replace("async def put(", "async def put_one(", 1), committed)
    assert drift(source, committed + "\n# a hand edit\n")


def test_generator_refuses_async_left_and_unused_rules() -> None:
    source = SOURCE.read_text()
    with pytest.raises(ValueError, match="async code left"):
        generate(source + "\n\nasync  def spaced() -> None:\n    pass\n")  # no rule matches
    with pytest.raises(ValueError, match="never used"):
        generate(source.replace("aclose", "shut"))
    with pytest.raises(ValueError, match="docstring"):
        generate("import trio\n")


def test_continuation_lines_stay_aligned_with_their_bracket() -> None:
    generated = TARGET.read_text().splitlines()
    row = next(i for i, line in enumerate(generated) if "def _get_from(" in line)
    assert generated[row].index("(") + 1 == len(generated[row + 1]) - len(
        generated[row + 1].lstrip())


def test_aio_itself_does_no_io() -> None:
    """Only io_trio (swapped for io_sync) touches I/O, so tokens are the twins' only difference."""
    imported: set[str] = set()
    for node in ast.walk(ast.parse(SOURCE.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported
    assert imported & IO_MODULES == set()
