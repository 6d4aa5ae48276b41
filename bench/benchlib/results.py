"""Where a benchmark's output goes: outside git. What a run prints is kept, as it is printed,
in the results directory, `$QUEUED_BENCH_RESULTS` (default bench/results/, which git
ignores; `off` keeps nothing), as `<bench>-<yyyymmdd-hhmmss>-<commit>.txt`, with any JSON
the bench writes beside it under the same stem. The README's Benchmarks section holds the
current tables; these files are the runs behind them, on the machine that ran them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

BENCH = Path(__file__).resolve().parent.parent
REPO = BENCH.parent


def measured_tree() -> Path:
    """The source tree of the `queued` this Python imports (the one its venv's `queued serve`
    runs), else this checkout."""
    spec = importlib.util.find_spec("queued")
    if spec is not None and spec.origin:
        return Path(spec.origin).resolve().parent.parent
    return REPO


def tree_commit(path: Path | None = None) -> str:
    """The short commit of a tree, `-dirty` if its queued/ has uncommitted changes."""
    path = path or measured_tree()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--",
                                "queued"], capture_output=True, text=True, timeout=10).stdout
        if commit:
            return commit + ("-dirty" if dirty.strip() else "")
    return "unknown"


def results_dir() -> Path | None:
    """The results directory, or None when `$QUEUED_BENCH_RESULTS` is `off`."""
    where = os.environ.get("QUEUED_BENCH_RESULTS") or str(BENCH / "results")
    return None if where == "off" else Path(where)


def result_stem(bench: str, started: float | None = None) -> Path | None:
    """`<results dir>/<bench>-<date>-<time>-<commit>` (add the suffix), or None."""
    where = results_dir()
    if where is None:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started or time.time()))
    stem = where / f"{bench}-{stamp}-{tree_commit()}"
    n = 1
    while list(where.glob(f"{stem.name}{'' if n == 1 else f'-{n}'}.*")):
        n += 1  # another run of it in the same second
    return stem if n == 1 else where / f"{stem.name}-{n}"


_current: Path | None = None  # the stem of the recording under way


def result_file(suffix: str) -> Path | None:
    """`<stem><suffix>` beside the output being recorded (e.g. ".json"), or None when
    nothing is being kept."""
    return None if _current is None else Path(f"{_current}{suffix}")


class _Tee:
    """sys.stdout that also writes into a file, opened at the first write (a run that
    prints nothing, or replaces itself with exec first, leaves no file)."""

    def __init__(self, out: TextIO, path: Path) -> None:
        self.out, self.path = out, path
        self.copy: TextIO | None = None

    def write(self, text: str) -> int:
        if self.copy is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.copy = open(self.path, "w")  # noqa: SIM115 (closed by recording())
        self.copy.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        if self.copy is not None:
            self.copy.flush()
        self.out.flush()

    def __getattr__(self, name: str) -> object:
        return getattr(self.out, name)


@contextlib.contextmanager
def recording(bench: str) -> Iterator[Path | None]:
    """Keeps what the block prints in `<stem>.txt` (see result_stem); yields the stem."""
    global _current
    stem = result_stem(bench)
    if stem is None:
        yield None
        return
    saved = sys.stdout
    tee = _Tee(saved, Path(f"{stem}.txt"))
    sys.stdout = tee  # type: ignore[assignment]
    _current = stem
    try:
        yield stem
    finally:
        sys.stdout = saved
        _current = None
        if tee.copy is not None:
            tee.copy.close()
            print(f"(this output is kept in {tee.path})", flush=True)
