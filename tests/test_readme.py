"""The README's examples run, so they cannot rot.

Every ```python block is run as its own program (`python -c`, as a reader would paste it)
against a real server subprocess on free ports: the default ports the README shows
(memcache 22133, RPC 2229) are swapped for the server's. A block that cannot run here
starts with a visible `# not run by the tests: <why>` line; they stay few. Shell blocks
may only use tools the README itself installs (`make`, the `queued` CLI, `python`, the
Docker tools of the Docker section) and the shell's own builtins: no netcat.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from server_util import WAIT, ServerProcess

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
NOT_RUN = "# not run by the tests:"
#: Most blocks that may be marked not run.
MAX_NOT_RUN = 1
#: What a shell example may call: what `make run` / `make test` / `make test-docker`
#: install, and the shell's builtins.
SHELL_TOOLS = {"make", "queued", "python", "python3", "docker", "printf", "echo", ".", "cd",
               "export"}


def blocks(lang: str) -> list[tuple[int, str]]:
    """(line number, text) of every fenced block of `lang` in the README."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(2))
            for m in FENCE.finditer(text) if m.group(1) == lang]


PYTHON = blocks("python")


def substitute_ports(code: str, ports: dict[str, int]) -> str:
    code = re.sub(r"\b22133\b", str(ports["memcache"]), code)
    return re.sub(r"\b2229\b", str(ports["rpc"]), code)


@pytest.mark.parametrize(("line", "code"), PYTHON, ids=[f"README.md:{n}" for n, _ in PYTHON])
def test_python_block_runs_against_a_real_server(line: int, code: str, tmp_path: Path) -> None:
    if code.startswith(NOT_RUN):
        reason = code.splitlines()[0].removeprefix(NOT_RUN).strip()
        assert reason, f"README.md:{line}: say why the block is not run"
        pytest.skip(f"README.md:{line}: {reason}")
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log")
    try:
        server.start()
        program = substitute_ports(code, server.ports)
        env = {k: v for k, v in os.environ.items() if not k.startswith("QUEUED_")}
        r = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=WAIT * 6, check=False)
    finally:
        server.kill()
    assert r.returncode == 0, f"README.md:{line} failed:\n{r.stderr}\n--- as run:\n{program}"


def test_readme_blocks_are_found_and_few_are_not_run() -> None:
    assert len(PYTHON) >= 4  # the extraction sees them (a test that found none proves nothing)
    not_run = [line for line, code in PYTHON if code.startswith(NOT_RUN)]
    assert len(not_run) <= MAX_NOT_RUN, f"blocks not run: README.md lines {not_run}"
    assert substitute_ports('("127.0.0.1", 22133) "127.0.0.1:2229" 22290',
                            {"memcache": 1, "rpc": 2}) == '("127.0.0.1", 1) "127.0.0.1:2" 22290'


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


def test_shell_examples_use_only_tools_the_readme_installs() -> None:
    found = [b for lang in ("sh", "bash", "console", "shell") for b in blocks(lang)]
    assert len(found) >= 3
    for line, block in found:
        for command in shell_commands(block):
            for tool in tools(command):
                assert tool in SHELL_TOOLS, f"README.md:{line}: {tool!r} in {command!r}"


def test_the_tool_check_sees_a_pipeline() -> None:
    assert tools("printf 'x' | nc -q1 127.0.0.1 22133") == ["printf", "nc"]
    assert shell_commands("$ seq 3 | queued put q\nstored 3 items\n") == ["seq 3 | queued put q"]
