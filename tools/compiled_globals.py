"""Which compiled functions look names up in their module's globals at run time.

mypyc keeps a module-level name marked `Final` (and a class or function compiled in the
same build) as a C static; any other module-level name a compiled function reads (a
constant without `Final`, a function or class imported from a module that is not
compiled, a module imported whole) is a dictionary look-up in the module's globals at
every use, some 130 instructions (callgrind). This reads the C that `make compiled` left
in build/compiled/build and prints, per compiled function, the global names it looks up
that way, so a hot function's look-ups can be found without reading the C.

    .venv/bin/python tools/compiled_globals.py [--build build/compiled/build]
        [--functions _writev_all,begin_all] [--names IOV_MAX]

A name a test replaces on the module (`monkeypatch.setattr(module, "LINGER", ...)`) must
stay a global: the compiled code then reads the replacement.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

FUNCTION = re.compile(r"^\S.*\bCPyDef_(\w+?)\(.*\{$")
GLOBALS = re.compile(r"= CPyStatic_\w+___globals;")
NAME = re.compile(r"/\* '(\w+)' \*/")


def scan(build: Path) -> dict[str, dict[str, list[str]]]:
    """module -> function -> the global names it looks up (sorted, each once)."""
    found: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in sorted(build.glob("__native_*.c")):
        module = path.stem.removeprefix("__native_").replace("___", ".")
        lines = path.read_text(errors="replace").splitlines()
        function = None
        for i, line in enumerate(lines):
            m = FUNCTION.match(line)
            if m:
                function = m.group(1).split("___", 1)[-1]
            elif function and GLOBALS.search(line) and i + 1 < len(lines):
                n = NAME.search(lines[i + 1])
                if n:
                    found[module][function].add(n.group(1))
    return {mod: {fn: sorted(names) for fn, names in fns.items()}
            for mod, fns in found.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", type=Path, default=Path("build/compiled/build"),
                    help="the directory of the generated C (default build/compiled/build)")
    ap.add_argument("--functions", default="",
                    help="comma-separated function names, with their class or without "
                         "(Reactor____read, _writev_all, begin_all); default: every one")
    ap.add_argument("--names", default="", help="comma-separated global names to look for")
    a = ap.parse_args()
    if not a.build.is_dir():
        raise SystemExit(f"{a.build}: no such directory (run `make compiled` first)")
    functions = {f for f in a.functions.split(",") if f}
    names = {n for n in a.names.split(",") if n}
    for module, fns in sorted(scan(a.build).items()):
        for fn, looked_up in sorted(fns.items()):
            short = fn.split("___", 1)[-1]
            shown = [n for n in looked_up if not names or n in names]
            if shown and (not functions or fn in functions or short in functions):
                print(f"{module}  {fn}  {', '.join(shown)}")


if __name__ == "__main__":
    main()
