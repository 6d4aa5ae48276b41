"""The suite against the compiled build (`make test-compiled`): imported by conftest.py
before anything imports queued.

With COMPILED_BUILD set (the build's directory, tools/build_compiled.py's OUT), that
directory goes first on sys.path and on PYTHONPATH (for the servers the tests start: the
venv's `queued` script, `python -m`, crash drivers), and `check()` makes the run fail
unless every module the build compiled is imported from its extension module there and the
build is up to date with queued/. Without it (`make test`), nothing changes: pure Python.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

BUILD_ENV = "COMPILED_BUILD"
BUILD: Path | None = Path(os.environ[BUILD_ENV]).resolve() if os.environ.get(BUILD_ENV) else None

if BUILD is not None:
    sys.path.insert(0, str(BUILD))
    # pytest-xdist's workers put their working directory (the checkout: queued/ as source)
    # first on PYTHONPATH; the build goes before it.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(BUILD), os.environ.get("PYTHONPATH", "")])



def not_compiled(why: str) -> pytest.MarkDecorator:
    """Marks a test that cannot run against the compiled build (a mypyc class takes no
    interpreted subclass, a compiled function no monkeypatch): `why` says which. The
    tests so marked are listed in docs/development.md."""
    return pytest.mark.skipif(BUILD is not None, reason=f"pure Python only: {why}")


def compiled_module_names() -> list[str]:
    """The modules the build compiles (tools/build_compiled.py's COMPILED)."""
    from tools.build_compiled import COMPILED

    return [path.removesuffix(".py").replace("/", ".") for path in COMPILED]


def check() -> str | None:
    """None when the run is pure Python; else what was checked, or pytest.UsageError."""
    if BUILD is None:
        return None
    import importlib

    from tools.build_compiled import COMPILED, up_to_date

    if not up_to_date(BUILD, COMPILED):
        raise pytest.UsageError(f"{BUILD} is not a build of this tree's queued/: make compiled")
    wrong = []
    for name in compiled_module_names():
        where = str(importlib.import_module(name).__file__)
        if not (where.startswith(str(BUILD) + "/") and where.endswith(".so")):
            wrong.append(f"{name}: {where}")
    if wrong:
        raise pytest.UsageError("not the compiled build's modules:\n  " + "\n  ".join(wrong))
    return f"compiled build {BUILD}: {len(COMPILED)} modules compiled, each imported from it"


def server_build_ok(log: bytes) -> bool:
    """Whether a `queued serve` log's start-up line names the build this run expects."""
    if BUILD is None:
        return b"(pure Python) starting" in log
    return f"modules, {BUILD}) starting".encode() in log
