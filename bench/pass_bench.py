#!/usr/bin/env python3
"""The broker's side of a reactor pass, in process: CPU per put, with no socket, codec or
scheduler around it (the share of a pass that per-item Python costs most, measured with
little noise: an A/B of two builds shows changes of a few per cent).

Each pass does what `Reactor._run_pass` does with the puts its connections parsed: every
put joined (`JoinedPuts.can_join`, `add`), the joined appends begun (`begin_all`), one
commit for the pass (`Broker.commit_now`: the writes, and the fsync policy), the puts
ended (`end_all`: the readers get the items). Shapes:

- `--queues 100 --per-pass 32` (the default): fan-in, each put to the next of 100 queues,
  one item each: one append, one write and one commit's bookkeeping per put;
- `--queues 1`: every put of a pass to one queue, joined into one append.

Prints CPU µs per put (process time, all threads; the best of `--rounds` rounds, and the
median) and the build that ran (`PYTHONPATH=build/compiled` runs the compiled one). The
process is tuned as the server tunes itself (its GC thresholds). The data directory is a
temp dir under `--dir` (default: /dev/shm when it exists, so the file system's write cost
stays out of the figure; give a disk path to keep it in).

    python bench/pass_bench.py [--queues 100] [--per-pass 32] [--passes 6000] [--fsync never]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import trio
from benchlib import recording

from queued import build
from queued.broker.broker import Broker, JoinedPuts
from queued.broker.puts import JoinedPut
from queued.broker.upkeep import open_broker
from queued.config import load_config
from queued.server.tuning import tune_process

DATA = b"x" * 64


def one_pass(broker: Broker, joined: JoinedPuts, names: list[str], start: int,
             per_pass: int) -> None:
    broker.defer_writes(True)
    parts: list[JoinedPut] = []
    for k in range(start, start + per_pass):
        queue = names[k % len(names)]
        if not joined.can_join(queue):
            raise SystemExit(f"queue {queue} cannot be joined (limits configured?)")
        part = joined.add(queue, [DATA], None, 0, 0)
        assert isinstance(part, JoinedPut)
        parts.append(part)
    joined.begin_all()
    broker.defer_writes(False)
    if not broker.commit_now():
        raise SystemExit("the commit had to wait for a writer's round")
    joined.end_all()
    for part in parts:
        if not part.ended or part.error is not None:
            raise SystemExit(f"a put failed: {part.error!r}")


async def run(a: argparse.Namespace, data_dir: Path) -> list[float]:
    config = load_config({"data_dir": str(data_dir), "fsync": a.fsync}, env={})
    async with open_broker(config) as broker:
        joined = JoinedPuts(broker)
        names = [f"q{i}" for i in range(a.queues)]
        for name in names:  # (each queue's segment is open before the measured passes)
            await broker.put(name, [DATA])
        k = 0
        for _ in range(min(200, a.passes)):  # warm up
            one_pass(broker, joined, names, k, a.per_pass)
            k += a.per_pass
        per_round = max(1, a.passes // a.rounds)
        took = []
        for _ in range(a.rounds):
            t0 = time.process_time()
            for _ in range(per_round):
                one_pass(broker, joined, names, k, a.per_pass)
                k += a.per_pass
            took.append((time.process_time() - t0) * 1e6 / (per_round * a.per_pass))
        return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queues", type=int, default=100)
    ap.add_argument("--per-pass", type=int, default=32, help="puts in each pass")
    ap.add_argument("--passes", type=int, default=6000, help="measured passes, in all")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fsync", default="never")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="where the temp data directory goes")
    a = ap.parse_args()
    tune_process()
    with tempfile.TemporaryDirectory(prefix="pass-bench-", dir=a.dir) as tmp:
        took = trio.run(run, a, Path(tmp) / "data")
    print(f"# pass_bench: {a.per_pass} single-item puts per pass over {a.queues} queue(s), "
          f"fsync {a.fsync}, {build()}")
    print(f"CPU per put: best {min(took):.2f} us, median {statistics.median(took):.2f} us "
          f"({a.rounds} rounds of {max(1, a.passes // a.rounds) * a.per_pass:,} puts)")


if __name__ == "__main__":
    with recording("pass_bench"):
        main()
