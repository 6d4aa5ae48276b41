"""Generates the blocking client (sync.py) from the trio client (aio.py) by token replacement.

Owns the replacement rules and the generated file's docstring. Run it as a file, `python
tools/unasync.py` (importing queued.client needs a whole sync.py); `--check` and
tests/test_client_unasync.py fail when sync.py has drifted. Its output must never need a
hand edit: what differs beyond tokens belongs in io_trio / io_sync (httpcore's idea).
"""

from __future__ import annotations

import ast
import difflib
import re
import sys
import tokenize
from pathlib import Path
from typing import Final

CLIENT: Final = Path(__file__).resolve().parent.parent / "queued" / "client"
SOURCE: Final = CLIENT / "aio.py"
TARGET: Final = CLIENT / "sync.py"

#: (pattern, replacement) per line, in this order (a rule sees the earlier rules' output);
#: every rule must be used somewhere, so none outlives its purpose.
RULES: Final = tuple((re.compile(pattern), replacement) for pattern, replacement in (
    (r"\bqueued\.client\.io_trio\b", "queued.client.io_sync"),
    (r"\bAsyncGenerator\[([^\]]*), None\]", r"Generator[\1, None, None]"),
    (r"\bAsyncGenerator\b", "Generator"),
    (r"\basynccontextmanager\b", "contextmanager"),
    (r"\bAsyncClient\b", "Client"),
    (r"\bAsyncConsumer\b", "Consumer"),
    (r"\basync (def|with|for)\b", r"\1"),
    (r"\bawait ", ""),
    (r"\b__a(enter|exit|iter)__\b", r"__\1__"),
    (r"\b__anext__\b", "__next__"),
    (r"\baclose\b", "close"),
    (r"\banext\(", "next("),
))

#: Replaces aio.py's module docstring, which describes the source, not this copy.
DOCSTRING: Final = '''"""GENERATED from aio.py by tools/unasync.py: do not edit, regenerate.

The blocking `Client`: `AsyncClient`'s code with its I/O (io_trio) swapped for blocking
sockets (io_sync) and async/await removed, so both clients behave alike by construction.
Every behaviour and its documentation live in aio.py; import from queued.client.
"""
'''


def generate(source: str) -> str:
    """The blocking twin of `source` (aio.py's text); ValueError when a rule went unused
    or async code is left."""
    first = ast.parse(source).body[0]
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str) and first.end_lineno is not None):
        raise ValueError("the source must open with its module docstring")
    body = source.splitlines(keepends=True)[first.end_lineno:]
    dedents = _dedents(body)
    used: set[int] = set()
    out = DOCSTRING + "".join(_replace(line, used)[dedents.get(row, 0):]
                              for row, line in enumerate(body))
    unused = [RULES[i][0].pattern for i in range(len(RULES)) if i not in used]
    if unused:
        raise ValueError(f"replacement rules never used: {unused}")
    left = [f"line {node.lineno}: {type(node).__name__}" for node in ast.walk(ast.parse(out))
            if isinstance(node, ast.AsyncFunctionDef | ast.AsyncWith | ast.AsyncFor | ast.Await)]
    if left:
        raise ValueError(f"async code left after the replacements: {left}")
    return out


def _replace(line: str, used: set[int]) -> str:
    for index, (pattern, replacement) in enumerate(RULES):
        line, n = pattern.subn(replacement, line)
        if n:
            used.add(index)
    return line


def _dedents(lines: list[str]) -> dict[int, int]:
    """Columns to take off each continuation line aligned one past an open bracket, so it
    stays aligned when the replacements shorten the text before that bracket."""
    dedents: dict[int, int] = {}
    brackets: list[tuple[int, int]] = []  # (row, column) of each bracket still open
    last_row = -1
    for token in tokenize.generate_tokens(iter(lines).__next__):
        row, col = token.start[0] - 1, token.start[1]
        if token.type == tokenize.NL:
            continue
        if brackets and row > last_row and col == brackets[-1][1] + 1:
            bracket_row, bracket_col = brackets[-1]
            moved_to = (len(_replace(lines[bracket_row][:bracket_col], set()))
                        - dedents.get(bracket_row, 0))
            dedents[row] = bracket_col - moved_to
        last_row = token.end[0] - 1
        if token.type == tokenize.OP and token.string in "([{":
            brackets.append((row, col))
        elif token.type == tokenize.OP and token.string in ")]}":
            brackets.pop()
    return dedents


def drift(source: str, generated: str) -> list[str]:
    """A unified diff from the committed `generated` to what `source` generates; [] if equal."""
    return list(difflib.unified_diff(generated.splitlines(keepends=True),
                                     generate(source).splitlines(keepends=True),
                                     TARGET.name, f"{TARGET.name} (generated now)"))


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        diff = drift(SOURCE.read_text(), TARGET.read_text())
        sys.stdout.writelines(diff)
        return 1 if diff else 0
    if argv:
        print("usage: python tools/unasync.py [--check]", file=sys.stderr)
        return 2
    TARGET.write_text(generate(SOURCE.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
