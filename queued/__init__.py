"""queued: a durable message queue server speaking Kestrel's protocols and journal format."""

from __future__ import annotations

import sys

__version__ = "0.1.0"


def compiled_modules() -> list[str]:
    """The modules of this package imported so far that are compiled extension modules
    (`make compiled` builds them with mypyc), not .py source: empty under pure Python."""
    return sorted(name for name, module in list(sys.modules.items())
                  if name.startswith("queued.")
                  and not str(getattr(module, "__file__", None) or ".py").endswith(".py"))


def build_kind() -> str:
    """"mypyc" when compiled modules are imported, else "pure" (the `build` label of the
    queued_build_info metric)."""
    return "mypyc" if compiled_modules() else "pure"


def build() -> str:
    """Which build runs, for the start-up log line and `queued --version`: "pure Python",
    or how many of the imported modules are compiled and from where."""
    compiled = compiled_modules()
    if not compiled:
        return "pure Python"
    where = str(sys.modules[compiled[0]].__file__).rpartition("/queued/")[0]
    return f"compiled with mypyc: {len(compiled)} modules, {where}"
