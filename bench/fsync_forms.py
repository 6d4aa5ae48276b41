"""What one durable write costs here, in the forms a log can take: the wall time and the
CPU time (user + system of this process) per sync.

- append + fsync: a write at the file's end, then fsync (the size changes each time);
- append + fdatasync: the same with fdatasync (which must still write the new size);
- overwrite zeros + fdatasync: a pwrite over zeros the file already has (written and
  fsynced beforehand), then fdatasync: the size does not change, so only the data is
  written. The intent log (queued/storage/intent_log.py) takes this form.

Each form writes --syncs records of --size bytes in a fresh file of --dir, --rounds
times in turn (forms alternating); the table gives the medians over the rounds.

    python bench/fsync_forms.py [--dir /tmp] [--syncs 2000] [--size 4000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchlib import recording


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one_form(path: Path, syncs: int, record: bytes,
             form: str) -> tuple[float, float]:
    """(wall s, CPU s) per sync of `form`, on a fresh file at `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (
        os.O_APPEND if form.startswith("append") else 0), 0o644)
    try:
        if form == "overwrite":
            zeros = bytes(1 << 20)
            for at in range(0, syncs * len(record) + len(zeros), len(zeros)):
                os.pwrite(fd, zeros, at)
            os.fsync(fd)
        step: Callable[[int], None]
        if form == "append-fsync":
            def step(_i: int) -> None:
                os.write(fd, record)
                os.fsync(fd)
        elif form == "append-fdatasync":
            def step(_i: int) -> None:
                os.write(fd, record)
                os.fdatasync(fd)
        else:
            def step(i: int) -> None:
                os.pwrite(fd, record, i * len(record))
                os.fdatasync(fd)
        c0, t0 = cpu_seconds(), time.perf_counter()
        for i in range(syncs):
            step(i)
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    finally:
        os.close(fd)
        path.unlink()
    return wall / syncs, cpu / syncs


FORMS = {"append-fsync": "append + fsync", "append-fdatasync": "append + fdatasync",
         "overwrite": "overwrite zeros + fdatasync"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--syncs", type=int, default=2000)
    ap.add_argument("--size", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with recording("fsync_forms"):
        run(args)


def run(args: argparse.Namespace) -> None:
    record = os.urandom(args.size)
    results: dict[str, list[tuple[float, float]]] = {form: [] for form in FORMS}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="fsync-forms-") as tmp:
        for _ in range(args.rounds):
            for form in FORMS:
                results[form].append(one_form(Path(tmp) / form, args.syncs, record, form))
    print(f"{args.syncs} syncs of {args.size} B each in {args.dir}, medians of "
          f"{args.rounds} round(s)\n")
    print("| form | wall us per sync | CPU us per sync |")
    print("|---|---:|---:|")
    for form, label in FORMS.items():
        wall = statistics.median(w for w, _ in results[form]) * 1e6
        cpu = statistics.median(c for _, c in results[form]) * 1e6
        print(f"| {label} | {wall:.1f} | {cpu:.1f} |")


if __name__ == "__main__":
    main()
