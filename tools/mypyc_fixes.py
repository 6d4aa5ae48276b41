"""A fix to mypyc's code generation, applied by tools/build_compiled.py before it compiles.

mypyc (1.18 and later, 2.4.1 included) keeps one freed instance of each generator,
closure and environment class for reuse. Its deallocator publishes the object in that
one-slot free list *first* and clears the object's attributes *after*:

    if (X_free_instance == NULL) {
        X_free_instance = self;
        Py_CLEAR(self->f); ...        /* may run any code */
        return;
    }

Clearing an attribute runs arbitrary code: a file's close releases the GIL (another
thread runs), a finalizer runs Python. Whatever then makes an X takes `self` out of the
slot and starts using it, and the rest of the clearing wipes the new owner's attributes.
It crashed the compiled build: storage/files.py's `_records` generator, one thread
reading a segment while another's `_records` closed its file, called a `with` block's
`__exit__` that the other thread's dealloc had cleared (NULL: a segfault). The slot is
global in a GIL build (mypyc_util.h: CPyThreadLocal is empty there).

`fix_generated_c` rewrites each such deallocator in the generated C (mypycify writes
it before setuptools compiles it; mypy's own wheels are compiled, so its code generator
cannot be patched from Python) to clear first and take the slot only if it is still free
once the clearing is done; if it is not, the dealloc goes on to mypyc's ordinary free
(clearing again is harmless: every attribute is in its fresh, undefined state).
`check_generated_c` then fails the build if any deallocator still drops a reference
after publishing (a mypyc whose code the rewrite did not recognise), rather than let it
pass unmended.
"""

from __future__ import annotations

import re
from pathlib import Path

#: A line that publishes an object in its class's free slot.
PUBLISH = re.compile(r"^\s*(\w+)_free_instance = self;\s*$")
#: A line that can run code: it drops a reference.
DROPS = re.compile(r"Py_CLEAR|Py_XDECREF|Py_DECREF|CPy_DECREF|CPy_XDECREF|CPy_DecRef")


def fix_source(c_source: str) -> tuple[str, int]:
    """`c_source` with every publish-then-clear deallocator rewritten to clear first;
    the number rewritten."""
    lines = c_source.splitlines(keepends=True)
    out: list[str] = []
    fixed = 0
    i = 0
    while i < len(lines):
        m = PUBLISH.match(lines[i])
        if (m is None or i == 0 or i + 1 == len(lines)
                or f"if ({m.group(1)}_free_instance == NULL)" not in lines[i - 1]
                or lines[i + 1].strip() == "return;"):  # (nothing to clear, or mended)
            out.append(lines[i])
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != "return;":
            end += 1
        if end == len(lines):
            raise SystemExit(f"mypyc_fixes: no return after {lines[i].strip()!r}")
        indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
        out.extend(lines[i + 1:end])  # the clearing, first
        out.append(f"{indent}if ({m.group(1)}_free_instance == NULL) {{\n")
        out.append(lines[i])
        out.append(lines[end])
        out.append(f"{indent}}}\n")
        fixed += 1
        i = end + 1
    return "".join(out), fixed


def fix_generated_c(build_dir: Path) -> int:
    """Rewrite the deallocators of every generated C file under `build_dir` in place;
    the number rewritten."""
    fixed = 0
    for path in sorted(build_dir.rglob("*.c")):
        text = path.read_text()
        new, n = fix_source(text)
        if n:
            path.write_text(new)
            fixed += n
    return fixed


def unsafe_deallocs(c_source: str) -> list[str]:
    """The classes whose deallocator, in this generated C, drops a reference after
    publishing the object in the free slot (before its `return`)."""
    bad: list[str] = []
    lines = c_source.splitlines()
    for i, line in enumerate(lines):
        m = PUBLISH.match(line)
        if not m:
            continue
        for after in lines[i + 1:]:
            if after.strip().startswith("return"):
                break
            if DROPS.search(after):
                bad.append(m.group(1))
                break
    return bad


def check_generated_c(build_dir: Path) -> int:
    """Raise if any generated C file under `build_dir` has an unsafe deallocator;
    the number of deallocators with a free slot that were checked."""
    published = 0
    bad: list[str] = []
    for path in sorted(build_dir.rglob("*.c")):
        text = path.read_text(errors="replace")
        published += sum(1 for line in text.splitlines() if PUBLISH.match(line))
        bad += [f"{path.name}: {name}" for name in unsafe_deallocs(text)]
    if bad:
        raise SystemExit("mypyc_fixes: deallocators that clear after freeing into the "
                         f"free slot (the fix did not take): {bad[:5]}")
    return published
