"""tools/mypyc_fixes.py: mypyc's free-list deallocators, mended to clear before they
publish (the bug and the fix: that module's docstring).

The probe is a real mypyc compile of a small generator, the mended C and mypyc's own
side by side, each run in a subprocess (the unmended one may segfault): a finalizer run
while a generator's attributes are cleared makes another generator of the same type and
keeps it, as another thread did in the crash the fix is for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from compiled_util import BUILD

from tools import mypyc_fixes

PROBE = textwrap.dedent('''\
    from collections.abc import Iterator
    from typing import Any


    def numbers(holder: object, cm: Any, n: int) -> Iterator[int]:
        """Counts to n inside `cm`; `holder` is only held (dropped first on dealloc)."""
        with cm:
            for i in range(n):
                yield i
    ''')

RUN = textwrap.dedent('''\
    import probe

    log = []
    kept = []


    class Cm:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            log.append("enter " + self.name)

        def __exit__(self, *exc):
            log.append("exit " + self.name)
            return False


    class Holder:
        def __del__(self):
            # runs while the first generator is being freed: a second one is made
            g = probe.numbers(None, Cm("second"), 3)
            log.append(next(g))
            kept.append(g)


    first = probe.numbers(Holder(), Cm("first"), 5)
    assert next(first) == 0
    del first  # suspended inside its `with`: freed, Holder's finalizer runs
    second = kept.pop()
    rest = list(second)  # the second runs to its end and leaves its `with`
    print(log, rest)
    assert rest == [1, 2], rest
    assert log.count("enter second") == 1 and log.count("exit second") == 1, log
    print("ok")
    ''')


def _compile(where: Path, mend: bool) -> int:
    """Compile probe.py in `where` with mypyc (mended or not); the deallocators mended."""
    env = {**os.environ, "MYPY_CACHE_DIR": str(where / ".mypy_cache")}
    script = (
        "import sys\nfrom pathlib import Path\n"
        f"sys.path.insert(0, {str(Path(mypyc_fixes.__file__).parent)!r})\n"
        "import mypyc_fixes\n"
        "from mypyc.build import mypycify\n"
        "from setuptools import setup\n"
        "exts = mypycify(['probe.py'], opt_level='0')\n"
        f"n = mypyc_fixes.fix_generated_c(Path('build')) if {mend!r} else 0\n"
        "print('mended', n)\n"
        "setup(name='probe', ext_modules=exts)\n")
    (where / "setup_probe.py").write_text(script)
    done = subprocess.run(
        [sys.executable, "setup_probe.py", "--quiet", "build_ext", "--inplace"],
        cwd=where, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(where.glob("probe.cpython-*.so")), "no extension module"
    return int(done.stdout.split("mended", 1)[1].split()[0])


def _run(where: Path) -> subprocess.CompletedProcess[str]:
    (where / "run_probe.py").write_text(RUN)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-X", "faulthandler", "run_probe.py"], cwd=where,
                          env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_a_generator_freed_while_another_is_made_keeps_the_new_ones_state(
        tmp_path: Path) -> None:
    pytest.importorskip("mypyc")
    mended_dir, raw_dir = tmp_path / "mended", tmp_path / "raw"
    for d in (mended_dir, raw_dir):
        d.mkdir()
        (d / "probe.py").write_text(PROBE)
    mended = _compile(mended_dir, mend=True)
    mended_c = "".join(p.read_text() for p in (mended_dir / "build").rglob("*.c"))
    assert not mypyc_fixes.unsafe_deallocs(mended_c)
    done = _run(mended_dir)
    assert done.returncode == 0 and done.stdout.endswith("ok\n"), (done.stdout, done.stderr)

    assert _compile(raw_dir, mend=False) == 0
    unmended_c = "".join(p.read_text() for p in (raw_dir / "build").rglob("*.c"))
    unsafe = mypyc_fixes.unsafe_deallocs(unmended_c)
    if not unsafe:
        assert mended == 0  # nothing to mend: this mypyc clears before it publishes
        pytest.skip("this mypyc's deallocators clear before they publish: nothing to mend")
    assert mended == len(unsafe) and "numbers_gen" in unsafe
    # mypyc's own: the second generator's attributes are cleared under it
    broken = _run(raw_dir)
    assert broken.returncode != 0, broken.stdout


DEALLOC = """\
static void
x_gen_dealloc(x_genObject *self)
{
    PyObject_GC_UnTrack(self);
    if (x_gen_free_instance == NULL) {
        x_gen_free_instance = self;
        Py_CLEAR(self->a);
        self->b = 2;
        Py_CLEAR(self->c);
        return;
    }
    CPy_TRASHCAN_BEGIN(self, x_gen_dealloc)
}
"""


def test_fix_source_moves_the_publish_after_the_clearing() -> None:
    assert mypyc_fixes.unsafe_deallocs(DEALLOC) == ["x_gen"]
    fixed, n = mypyc_fixes.fix_source(DEALLOC)
    assert n == 1 and mypyc_fixes.unsafe_deallocs(fixed) == []
    body = fixed.splitlines()
    first, clear_c = body.index("    if (x_gen_free_instance == NULL) {"), body.index(
        "        Py_CLEAR(self->c);")
    assert body[first + 1] == "        Py_CLEAR(self->a);"
    assert body[clear_c + 1:clear_c + 5] == [
        "        if (x_gen_free_instance == NULL) {",
        "        x_gen_free_instance = self;",
        "        return;",
        "        }",
    ]
    assert mypyc_fixes.fix_source(fixed) == (fixed, 0)  # mended once only


def test_check_generated_c_fails_a_build_left_unmended(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.c").write_text(DEALLOC)
    with pytest.raises(SystemExit, match="x_gen"):
        mypyc_fixes.check_generated_c(tmp_path)
    assert mypyc_fixes.fix_generated_c(tmp_path) == 1
    assert mypyc_fixes.check_generated_c(tmp_path) == 1


@pytest.mark.skipif(BUILD is None, reason="make test-compiled only: reads the build's C")
def test_the_compiled_build_has_only_mended_deallocators() -> None:
    assert BUILD is not None  # (up to date with queued/: conftest checked)
    assert mypyc_fixes.check_generated_c(BUILD / "build") > 0
