"""The Makefile's installs: `make run` installs only what the server needs, `make test`
adds the test, Spark and docs extras, `make docs` only the docs extra, and their stamps
keep each from installing again what is there.

Checked with make's own dry run (`make -n` prints the commands it would run, deciding
from the real files' times) on a copy of the Makefile and pyproject.toml in a temp dir,
so nothing is installed. The sizes of the two installs are measured by hand (docs/development.md,
Tests and tools).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVER_ONLY = "-e ."
WITH_EXTRAS = "-e '.[test,spark,docs]'"
DOCS_ONLY = "-e '.[docs]'"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    if shutil.which("make") is None:
        pytest.skip("no make here")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    past = time.time() - 3600
    os.utime(tmp_path / "pyproject.toml", (past, past))
    return tmp_path


def dry_run(cwd: Path, target: str) -> list[str]:
    r = subprocess.run(["make", "-n", target], cwd=cwd, capture_output=True, text=True,
                       timeout=30, check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def installs(lines: list[str]) -> list[str]:
    """What each `pip install` of the project would install ("-e ." or with extras)."""
    return [line.partition("editable_mode=compat ")[2] for line in lines
            if " pip install " in line and "--upgrade pip" not in line]


def done(project: Path, *stamps: str) -> None:
    """As if the venv existed and these installs had run (files newer than pyproject)."""
    (project / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
    (project / ".venv" / "bin" / "python").touch()
    for stamp in stamps:
        (project / ".venv" / stamp).touch()


def test_run_installs_only_the_server(project: Path) -> None:
    lines = dry_run(project, "run")
    assert any(line.endswith("-m venv .venv") for line in lines), lines
    assert installs(lines) == [SERVER_ONLY], lines


def test_test_installs_the_server_then_the_extras(project: Path) -> None:
    assert installs(dry_run(project, "test")) == [SERVER_ONLY, WITH_EXTRAS]


def test_test_after_run_adds_only_the_extras(project: Path) -> None:
    done(project, ".installed-run")
    assert installs(dry_run(project, "run")) == []
    lines = dry_run(project, "test")
    assert installs(lines) == [WITH_EXTRAS], lines
    assert not any("-m venv" in line for line in lines)


def test_run_after_test_installs_nothing(project: Path) -> None:
    done(project, ".installed-run", ".installed-test")
    assert installs(dry_run(project, "run")) == []
    assert installs(dry_run(project, "test")) == []


def test_a_changed_pyproject_installs_again(project: Path) -> None:
    done(project, ".installed-run", ".installed-test")
    later = time.time() + 60
    os.utime(project / "pyproject.toml", (later, later))
    assert installs(dry_run(project, "run")) == [SERVER_ONLY]
    assert installs(dry_run(project, "test")) == [SERVER_ONLY, WITH_EXTRAS]


def test_test_browser_adds_the_browser_extra_and_runs_only_the_browser_tests(
        project: Path) -> None:
    done(project, ".installed-run", ".installed-test")
    lines = dry_run(project, "test-browser")
    assert installs(lines) == ["-e '.[test,browser]'"], lines
    assert any("tests/browser/setup.sh" in line for line in lines)
    assert any("pytest -m browser" in line and "tests/browser" in line for line in lines)
    done(project, ".installed-run", ".installed-test", ".installed-browser")
    assert installs(dry_run(project, "test-browser")) == []
    assert "make test-browser" in (ROOT / ".ci" / "run").read_text()


def test_test_builds_the_docs_strictly_and_docs_serves_them(project: Path) -> None:
    lines = dry_run(project, "test")
    assert any("mkdocs build --strict" in line for line in lines), lines
    assert "touch .venv/.installed-test .venv/.installed-docs" in lines  # docs come with it
    lines = dry_run(project, "docs")
    assert installs(lines) == [SERVER_ONLY, DOCS_ONLY], lines  # no test or Spark extras
    assert any(line.endswith("mkdocs serve") for line in lines), lines


def test_docs_after_test_installs_nothing(project: Path) -> None:
    done(project, ".installed-run", ".installed-test", ".installed-docs")
    assert installs(dry_run(project, "docs")) == []
    done(project, ".installed-run")
    (project / ".venv" / ".installed-test").unlink()
    (project / ".venv" / ".installed-docs").unlink()
    assert installs(dry_run(project, "docs")) == [DOCS_ONLY]
