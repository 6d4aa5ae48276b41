"""Crash-test driver: works a data directory until it is killed with SIGKILL.

    python tests/crash_driver.py MODE DATADIR [--seconds S] [--max-items N] ...

MODE is one of:

- ``append``: ``--tasks`` concurrent appenders append small batches; after each
  append returns, one line ``A <id> <id> ...`` (the acknowledged ids).
- ``checkpoint``: appends ``--max-items`` items, then one task per reader
  (``""`` and ``r1``) writes checkpoints with increasing heads while an
  appender keeps appending. Before a write: ``c <reader> <head>``; after it
  returned: ``C <reader> <head>``. The done ids are `checkpoint_done(head)`.
- ``compact``: an appender (``A`` lines) and a maintenance task that writes
  checkpoints leaving stragglers (reader ``""``: head ``h`` and done =
  `straggler_done(h, upto)`; reader ``r1``: head ``upto``, no done), then
  compacts. Lines: ``c <h> <upto>`` before, ``C <h> <upto>`` after the two
  checkpoints, ``K <removed> <rewritten>`` after each compaction.

Item data is `data_for(id)`, so a reader of the journal can check every byte.
Every line is flushed as soon as it is written (the test reads stdout from a
file, so a SIGKILL loses no line that was written). ``END`` is printed after a
clean stop (time or item bound reached). Exit status 3 = the journal assigned
ids the driver did not predict (a bug in the driver's assumptions or the journal).

Standalone: imports only ``queued`` and trio, never pytest.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
from pathlib import Path

import trio

from queued.config import DataDirConfig, FsyncPolicy, JournalConfig
from queued.storage.journal import QueueJournal, wait_durable
from queued.storage.opening import open_data_dir

QUEUE = "jobs"
STRAGGLER_EVERY = 37
#: ids this close to the newest acknowledged one stay unconsumed in compact mode
RECENT_TAIL = 40
#: how far behind the newest the straggler reader's head trails in compact mode
HEAD_LAG = 2500


def data_for(item_id: int) -> bytes:
    """The data of item `item_id`: variable length, derivable from the id alone."""
    digest = hashlib.sha256(b"item-%d" % item_id).digest()
    return b"#%d:" % item_id + (digest * 4)[: item_id % 97]


def checkpoint_done(head: int) -> tuple[int, ...]:
    """Done ids of the checkpoint mode's checkpoint at `head` (all above head)."""
    return tuple(head + 2 * k for k in range(1, head % 23 + 1))


def straggler_done(head: int, upto: int) -> tuple[int, ...]:
    """Done ids of the compact mode's straggler checkpoint: all but every 37th id."""
    return tuple(i for i in range(head + 1, upto + 1) if i % STRAGGLER_EVERY)


class Out:
    def __init__(self) -> None:
        self.stream = sys.stdout

    def line(self, *parts: object) -> None:
        self.stream.write(" ".join(str(p) for p in parts) + "\n")
        self.stream.flush()


def now_ms() -> int:
    return int(time.time() * 1000)


async def append_batch(q: QueueJournal, n: int, use_nowait: bool) -> list[int]:
    """Append n items whose data is derived from the ids the journal will assign."""
    # Ids are assigned synchronously, in order, by append_nowait (append calls it
    # without yielding to other tasks first when max_journal_size is 0).
    first = q.last_id + 1
    datas = [data_for(first + k) for k in range(n)]
    if use_nowait:
        puts, ticket = q.append_nowait(datas, now_ms())
        await wait_durable(ticket)
    else:
        puts = await q.append(datas, now_ms())
    ids = [p.id for p in puts]
    if ids != list(range(first, first + n)) or [p.data for p in puts] != datas:
        sys.stderr.write(f"driver: predicted ids {first}..{first + n - 1}, journal gave {ids}\n")
        sys.stderr.flush()
        sys.exit(3)
    return ids


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.deadline = time.monotonic() + args.seconds
        self.items = 0
        self.acked_last = 0
        self.out = Out()

    def running(self) -> bool:
        return time.monotonic() < self.deadline and self.items < self.args.max_items


async def appender(st: State, q: QueueJournal, task_no: int, max_batch: int) -> None:
    rng = random.Random(task_no * 7919 + st.args.seed)
    while st.running():
        n = rng.randint(1, max_batch)
        ids = await append_batch(q, n, use_nowait=bool(task_no % 2))
        st.items += n
        st.acked_last = max(st.acked_last, ids[-1])
        st.out.line("A", *ids)
        if rng.random() < 0.3:
            await trio.sleep(rng.random() * 0.002)


async def mode_append(st: State, q: QueueJournal) -> None:
    async with trio.open_nursery() as nursery:
        for t in range(st.args.tasks):
            nursery.start_soon(appender, st, q, t, 6)


async def checkpointer(st: State, q: QueueJournal, reader: str, limit: int) -> None:
    rng = random.Random(len(reader) * 104729 + st.args.seed)
    head = 0
    while st.running() and head < limit:
        head = min(limit, head + rng.randint(1, 5))
        st.out.line("c", reader or "-", head)
        await q.write_checkpoint(reader, head, checkpoint_done(head))
        st.out.line("C", reader or "-", head)


async def mode_checkpoint(st: State, q: QueueJournal) -> None:
    preload = st.args.max_items
    while st.items < preload:
        ids = await append_batch(q, min(500, preload - st.items), use_nowait=False)
        st.items += len(ids)
        st.acked_last = ids[-1]
        st.out.line("A", *ids)
    limit = st.acked_last
    st.args.max_items = preload * 10  # the appender below keeps going until the deadline
    async with trio.open_nursery() as nursery:
        nursery.start_soon(appender, st, q, 0, 4)
        async with trio.open_nursery() as readers:
            readers.start_soon(checkpointer, st, q, "", limit)
            readers.start_soon(checkpointer, st, q, "r1", limit)
        nursery.cancel_scope.cancel()


async def maintenance(st: State, q: QueueJournal) -> None:
    rng = random.Random(st.args.seed)
    while st.running():
        await trio.sleep(rng.random() * 0.004)
        upto = st.acked_last - RECENT_TAIL
        if upto <= 0:
            continue
        h = max(0, upto - HEAD_LAG)
        st.out.line("c", h, upto)
        await q.write_checkpoint("r1", upto)
        await q.write_checkpoint("", h, straggler_done(h, upto))
        st.out.line("C", h, upto)
        result = await q.compact()
        st.out.line("K", result.removed, result.rewritten)


async def mode_compact(st: State, q: QueueJournal) -> None:
    async with trio.open_nursery() as nursery:
        for t in range(st.args.tasks):
            nursery.start_soon(appender, st, q, t, 12)
        nursery.start_soon(maintenance, st, q)


MODES = {"append": mode_append, "checkpoint": mode_checkpoint, "compact": mode_compact}


async def amain(args: argparse.Namespace) -> None:
    st = State(args)
    jcfg = JournalConfig(journal_size=args.journal_size, fsync=FsyncPolicy.parse(args.fsync))
    async with open_data_dir(Path(args.datadir), DataDirConfig(), lambda _name: jcfg) as dd:
        q = dd.queue(QUEUE)
        await MODES[args.mode](st, q)
    st.out.line("END", st.items)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=sorted(MODES))
    p.add_argument("datadir")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--max-items", type=int, default=200_000)
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--journal-size", type=int, default=8192)
    p.add_argument("--fsync", default="always")
    p.add_argument("--seed", type=int, default=0)
    trio.run(amain, p.parse_args(argv))


if __name__ == "__main__":
    main()
