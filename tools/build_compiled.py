"""Build the mypyc-compiled twin of the package: `make compiled` runs this.

Copies queued/ into OUT (default build/compiled, gitignored) and compiles the modules of
COMPILED there with mypyc, so the .so files live only beside their copies: nothing in the
source tree is ever shadowed by a stale build. Run the result with OUT first on sys.path
(`PYTHONPATH=build/compiled .venv/bin/queued serve ...`, or `make run-compiled`); every
module not listed stays interpreted, from its copy. OUT/.fingerprint records what the
build was made from (the sources, this file and mypyc_fixes.py, mypy's and Python's
versions): an unchanged tree is not rebuilt, a changed one is rebuilt from scratch, and
`--check` says whether OUT is up to date with queued/ (tests/conftest.py refuses a stale
build). mypyc_fixes.py mends a mypyc bug in the generated code (its docstring says which).

    python tools/build_compiled.py [--out build/compiled] [-j 2] [--check] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

if __package__:  # imported as tools.build_compiled (tests/compiled_util.py)
    from tools import mypyc_fixes
else:  # run as a script: tools/ is sys.path[0]
    import mypyc_fixes

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "queued"

#: The compiled modules, chosen by measurement (docs/benchmarks.md "Compiled with mypyc"):
#: the synchronous request path from the codecs down to the journal's append (what stays
#: Python, and why: docs/development.md "Compiled with mypyc").
COMPILED = [
    "queued/errors.py",
    "queued/sansio.py",
    "queued/stats.py",
    "queued/config/policies.py",
    "queued/config/settings.py",
    "queued/journal/records.py",
    "queued/journal/decoder.py",
    "queued/journal/headers.py",
    "queued/journal/names.py",
    "queued/wire/parsing.py",
    "queued/wire/commands.py",
    "queued/wire/access.py",
    "queued/wire/memcache_protocol.py",
    "queued/wire/memcache_commands.py",
    "queued/wire/text_protocol.py",
    "queued/wire/text_commands.py",
    "queued/wire/rpc_protocol.py",
    "queued/wire/rpc_commands.py",
    "queued/wire/tls_records.py",
    "queued/reader/counters.py",
    "queued/reader/state.py",
    "queued/reader/delays.py",
    "queued/reader/packed_items.py",
    "queued/reader/open_reads.py",
    "queued/reader/producers.py",
    "queued/reader/dedup.py",
    "queued/storage/write_plans.py",
    "queued/storage/files.py",
    "queued/storage/intent_log.py",
    "queued/storage/synced_files.py",
    "queued/storage/journal.py",
    "queued/storage/writer.py",
    "queued/storage/datadir.py",
    "queued/broker/base.py",
    "queued/broker/puts.py",
    "queued/broker/gets.py",
    "queued/broker/admin.py",
    "queued/broker/broker.py",
    "queued/broker/registry.py",
    "queued/broker/queues.py",
    "queued/broker/reliable.py",
    "queued/broker/live_readers.py",
    "queued/server/session.py",
    "queued/server/pass_gets.py",
    "queued/server/task_base.py",
    "queued/server/task_gets.py",
    "queued/server/task_path.py",
    "queued/server/connections.py",
    "queued/server/reactor.py",
    "queued/server/handlers.py",
    "queued/server/transport.py",
    "queued/server/replies.py",
    "queued/server/tls.py",
]

#: The mypy settings of pyproject.toml that the compile needs (mypyc type-checks first).
MYPY_INI = """\
[mypy]
python_version = 3.11
strict = True

[mypy-msgpack.*,pymemcache.*,prometheus_client.*,pyspark.*,pyarrow.*,isal.*]
ignore_missing_imports = True
"""


def fingerprint(modules: list[str]) -> str:
    """What a build is made of: every file under queued/, the module list, this script,
    and the compiler's and interpreter's versions."""
    import mypy.version

    h = hashlib.sha256()
    h.update(f"{sys.version}\n{mypy.version.__version__}\n".encode())
    h.update("\n".join(modules).encode())
    h.update(Path(__file__).read_bytes())
    h.update(Path(mypyc_fixes.__file__).read_bytes())
    for path in sorted((ROOT / PACKAGE).rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".so":
            h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def up_to_date(out: Path, modules: list[str]) -> bool:
    stamp = out / ".fingerprint"
    return stamp.exists() and stamp.read_text().strip() == fingerprint(modules)


def build(out: Path, modules: list[str], jobs: int) -> None:
    """A fresh copy of queued/ in `out`, the listed modules compiled in place."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shutil.copytree(ROOT / PACKAGE, out / PACKAGE,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    (out / "mypy.ini").write_text(MYPY_INI)
    setup = out / "setup_compiled.py"
    # mypycify writes the C (into out/build) and setuptools compiles it; in between,
    # tools/mypyc_fixes.py mends the deallocators mypyc wrote.
    setup.write_text(
        "import sys\n"
        "from pathlib import Path\n"
        f"sys.path.insert(0, {str(ROOT / 'tools')!r})\n"
        "import mypyc_fixes\n"
        "from setuptools import setup\n"
        "from mypyc.build import mypycify\n"
        f"exts = mypycify({modules!r}, opt_level='3', debug_level='0', multi_file=True)\n"
        "print('mypyc_fixes:', mypyc_fixes.fix_generated_c(Path('build')),"
        " 'deallocators mended')\n"
        "setup(name='queued-compiled', ext_modules=exts)\n")
    # The compile runs in `out`: mypy resolves `queued` to the copy, and setuptools puts
    # the extension modules beside it (build_ext --inplace), its temp files in out/build.
    env = {**os.environ, "PYTHONPATH": str(out), "MYPY_CACHE_DIR": str(out / ".mypy_cache")}
    subprocess.run([sys.executable, setup.name, "--quiet", "build_ext", "--inplace",
                    f"--parallel={jobs}"], cwd=out, env=env, check=True)
    for mod in modules:
        stem = out / mod[:-3]
        if not list(stem.parent.glob(stem.name + ".cpython-*.so")):
            raise SystemExit(f"build_compiled: no extension module for {mod} in {out}")
    mypyc_fixes.check_generated_c(out / "build")
    (out / ".fingerprint").write_text(fingerprint(modules) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "compiled")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                    help="C compilers run at once")
    ap.add_argument("--check", action="store_true",
                    help="only say whether OUT is up to date (exit 1 if not)")
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    ap.add_argument("--modules", nargs="*", default=None,
                    help="compile these files (paths under queued/) instead of COMPILED")
    a = ap.parse_args()
    out = a.out.resolve()
    modules = a.modules if a.modules is not None else COMPILED
    if a.check:
        fresh = up_to_date(out, modules)
        print(f"{out}: {'up to date' if fresh else 'stale or missing: make compiled'}")
        return 0 if fresh else 1
    if not a.force and up_to_date(out, modules):
        print(f"{out}: up to date ({len(modules)} modules compiled)")
        return 0
    t0 = time.monotonic()
    build(out, modules, a.jobs)
    print(f"{out}: {len(modules)} modules compiled with mypyc in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
