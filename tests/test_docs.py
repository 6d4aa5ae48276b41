"""The README's and the documentation pages' examples run, so they cannot rot.

Every ```python block of README.md and of docs/*.md is run as its own program (`python
-c`, as a reader would paste it) against a real server subprocess on free ports: the
default ports the pages show (memcache 22133, text 2222, RPC 2229, HTTP 2223) are
swapped for the server's. A block that cannot run here starts with a visible `# not run
by the tests: <why>` line; they stay few. Shell blocks may only use tools the pages
themselves install (`make`, the `queued` CLI, `python`, the Docker tools of the Docker
section) and the shell's own builtins: no netcat.

`make test` also builds the site (`mkdocs build --strict`), which fails on a broken
link or anchor, on the README's too (tools/mkdocs_hooks.py serves it as the front page).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from server_util import WAIT, ServerProcess

from tools.mkdocs_hooks import front_page

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
#: Every file whose blocks the tests run: the front page, then the pages.
FILES = [README, *PAGES]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
NOT_RUN = "# not run by the tests:"
#: Most blocks that may be marked not run (README and pages together).
MAX_NOT_RUN = 1
#: What a shell example may call: what `make run` / `make test` / `make test-docker`
#: install, and the shell's builtins.
SHELL_TOOLS = {"make", "queued", "python", "python3", "docker", "printf", "echo", ".", "cd",
               "export"}
#: The ports the pages show -> the name ServerProcess gives the server's real port.
PORTS = {"22133": "memcache", "2222": "text", "2229": "rpc", "2223": "http"}


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def blocks(lang: str, files: list[Path] = FILES) -> list[tuple[str, str]]:
    """(file:line, text) of every fenced block of `lang` at the start of a line."""
    found = []
    for path in files:
        text = path.read_text()
        found += [(where(path, text.count("\n", 0, m.start()) + 1), m.group(2))
                  for m in FENCE.finditer(text) if m.group(1) == lang]
    return found


PYTHON = blocks("python")


def substitute_ports(code: str, ports: dict[str, int]) -> str:
    return re.sub(r"\b(22133|2222|2229|2223)\b", lambda m: str(ports[PORTS[m.group(1)]]),
                  code)


@pytest.mark.parametrize(("at", "code"), PYTHON, ids=[at for at, _ in PYTHON])
def test_python_block_runs_against_a_real_server(at: str, code: str, tmp_path: Path) -> None:
    if code.startswith(NOT_RUN):
        reason = code.splitlines()[0].removeprefix(NOT_RUN).strip()
        assert reason, f"{at}: say why the block is not run"
        pytest.skip(f"{at}: {reason}")
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log")
    try:
        server.start()
        program = substitute_ports(code, server.ports)
        env = {k: v for k, v in os.environ.items() if not k.startswith("QUEUED_")}
        r = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=WAIT * 6, check=False)
    finally:
        server.kill()
    assert r.returncode == 0, f"{at} failed:\n{r.stderr}\n--- as run:\n{program}"


def test_blocks_are_found_and_few_are_not_run() -> None:
    # the extraction sees them (a test that found none proves nothing)
    assert len(blocks("python", [README])) >= 3
    assert len(PYTHON) >= 8
    assert {at.partition(":")[0] for at, _ in PYTHON} >= {
        "README.md", "docs/getting-started.md", "docs/protocols.md", "docs/client.md",
        "docs/fleet.md"}
    not_run = [at for at, code in PYTHON if code.startswith(NOT_RUN)]
    assert len(not_run) <= MAX_NOT_RUN, f"blocks not run: {not_run}"
    ports = {"memcache": 1, "text": 2, "rpc": 3, "http": 4}
    assert substitute_ports('("127.0.0.1", 22133) "127.0.0.1:2229" 22290 :2223/ 2222',
                            ports) == '("127.0.0.1", 1) "127.0.0.1:3" 22290 :4/ 2'


def shell_commands(block: str) -> list[str]:
    """The commands of a shell block: the `$ ` lines when it shows a session (the other
    lines are output), else every line; continuation lines joined, comments dropped."""
    lines = block.replace("\\\n", " ").splitlines()
    if any(line.startswith("$ ") for line in lines):
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def tools(command: str) -> list[str]:
    """The program each part of a pipeline or command list calls."""
    words = shlex.split(command, comments=True)
    found, start = [], True
    for word in words:
        if start:
            found.append(word)
        start = word in {"|", "||", "&&", ";"}
    return found


def test_shell_examples_use_only_tools_the_pages_install() -> None:
    found = [b for lang in ("sh", "bash", "console", "shell") for b in blocks(lang)]
    assert len(found) >= 3
    for at, block in found:
        for command in shell_commands(block):
            for tool in tools(command):
                assert tool in SHELL_TOOLS, f"{at}: {tool!r} in {command!r}"


def test_the_tool_check_sees_a_pipeline() -> None:
    assert tools("printf 'x' | nc -q1 127.0.0.1 22133") == ["printf", "nc"]
    assert shell_commands("$ seq 3 | queued put q\nstored 3 items\n") == ["seq 3 | queued put q"]


# -- the site's shape ---------------------------------------------------------------------

def nav_pages(nav: list[object]) -> list[str]:
    """Every page named in mkdocs.yml's nav, sections flattened."""
    found: list[str] = []
    for entry in nav:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            found += nav_pages(value) if isinstance(value, list) else [str(value)]
    return found


def test_every_page_is_in_the_nav_and_linked_from_the_front_page() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = nav_pages(config["nav"])
    assert sorted(nav) == sorted(["index.md", *(p.name for p in PAGES)])
    readme = README.read_text()
    for page in PAGES:
        assert f"](docs/{page.name})" in readme, f"the README does not link {page.name}"
    assert "console.png" in readme  # the screenshot `make test-browser` writes


def test_the_front_page_links_resolve_from_docs() -> None:
    assert front_page("[a](docs/queues.md#x) ![b](docs/console.png) docs/x.md") == \
        "[a](queues.md#x) ![b](console.png) docs/x.md"
    for target in re.findall(r"\]\(docs/([^)#]+)", README.read_text()):
        assert (DOCS / target).is_file(), target


#: A tracker's issue number or a status box has no place in the pages: they describe the
#: software, not the history of its making.
TRACKER = re.compile(r"\bissues?\b|(?<![\w&/])#\d+\b|^> \*\*Status", re.IGNORECASE | re.MULTILINE)


def test_no_issue_numbers_and_no_status_box() -> None:
    for path in FILES:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not TRACKER.search(line), f"{where(path, n)}: {line.strip()}"
    assert TRACKER.search("(issue 17's target)") and TRACKER.search("see #34")
    assert not TRACKER.search("`#delayed-delivery` &#8594; `c1#2`")
