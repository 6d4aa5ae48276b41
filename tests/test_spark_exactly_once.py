"""The sink's exactly-once puts (`queued.spark.exactly_once`), its chunking
(`queued.spark.partition_write`), its per-row `delay` column and `idempotency_key`, and the
faults a streaming sink must ride through, for real:

- a task retried (its first attempt failed after the sink had stored some of its rows),
  a driver SIGKILLed inside a micro-batch and the query restarted from its checkpoint in a
  new process (tests/spark_sink_driver.py, local[2,4], one run for the three), and a
  server SIGKILLed while a micro-batch's puts stream in, restarted on its port (the
  session of tests/conftest.py): each row stored once;
- a re-run that gives other rows (a task whose second attempt gives its rows in reverse
  order): detected, every row stored, the duplicates counted.

Each fault test prints `rows expected / stored / duplicates` (pytest -s shows them).
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from server_util import ServerProcess, drain_queue

from queued.client import Client
from queued.config import JournalConfig
from queued.storage.opening import open_data_dir

try:
    import pyarrow as pa
    from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType

    from queued.spark import QueuedDataSourceError
    from queued.spark.exactly_once import (
        ExactlyOnceSender,
        RunKey,
        arrow_digest,
        chunk_digest,
        content_id,
    )
    from queued.spark.partition_write import Layout, PartitionWrite
    from queued.spark.sink import QueuedWriter
    from queued.spark.task_input import InputEnd
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"pyspark/pyarrow not installed ({exc}); pip install -e '.[spark]'",
                allow_module_level=True)

T0 = 1_700_000_000_000
DRIVER = Path(__file__).with_name("spark_sink_driver.py")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("exactly-once-server")
    proc = ServerProcess(root / "data", root / "server.log").start()
    try:
        yield proc
    finally:
        proc.kill()


def tally(expected: set[bytes], stored: list[bytes], what: str) -> tuple[int, int, int]:
    """(rows expected, stored, duplicates), printed; every expected row is there, no other."""
    counts = Counter(stored)
    assert set(counts) == expected, (what, len(expected - set(counts)), len(set(counts) - expected))
    dups = sum(k - 1 for k in counts.values())
    print(f"{what}: rows expected {len(expected)}, stored {len(stored)}, duplicates {dups}")
    return len(expected), len(stored), dups


async def write_journal(path: Path, rows: list[bytes], per_batch: int) -> None:
    async with open_data_dir(path, queue_config=lambda _: JournalConfig(
            journal_size=64 << 10)) as dd:
        for i in range(0, len(rows), per_batch):
            await dd.queue("src").append(rows[i:i + per_batch], T0)


# -- chunks, producer ids and the senders, without Spark --------------------------------------


class Recorder:
    """A sender that keeps what it was given (for the chunking rules alone)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, bytes, int, list[bytes]]] = []
        self.stored = self.found = self.puts = self.diverged = 0

    def send(self, queue: str, delay_ms: int, group: bytes, number: int,
             items: list[bytes], headers: list[Any] | None = None,
             arrow: list[Any] | None = None) -> None:
        assert arrow is not None and chunk_digest(items, headers) == arrow_digest(arrow, headers)
        self.sent.append((queue, delay_ms, group, number, items))


def chunked(rows: list[tuple[str, int | None, bytes]], cuts: list[int], batch: int,
            batch_bytes: int) -> list[tuple[str, int, bytes, int, list[bytes]]]:
    """What a PartitionWrite sends of `rows` fed as Arrow batches cut at `cuts`."""
    layout = Layout("x:1", "dflt", True, True, 7, batch, batch_bytes, False)
    sender = Recorder()
    write = PartitionWrite(layout, sender, lambda q, d: f"{q}/{d}".encode())
    bounds = [0, *sorted(set(cuts)), len(rows)]
    for lo, hi in itertools.pairwise(bounds):
        part = rows[lo:hi]
        write.add_batch(pa.RecordBatch.from_pydict(
            {"queue": [q for q, _, _ in part], "delay": [d for _, d, _ in part],
             "data": [x for _, _, x in part]},
            schema=pa.schema([("queue", pa.string()), ("delay", pa.int64()),
                              ("data", pa.binary())])))
    write.finish()
    return sender.sent


ROW = st.tuples(st.sampled_from(["a", "b"]), st.sampled_from([None, 0, 5]),
                st.binary(max_size=40))


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(ROW, max_size=60), cuts=st.lists(st.integers(0, 60), max_size=6),
       batch=st.integers(1, 7), batch_bytes=st.integers(1, 200))
def test_chunks_depend_on_the_rows_alone(rows: list[tuple[str, int | None, bytes]],
                                         cuts: list[int], batch: int,
                                         batch_bytes: int) -> None:
    # However Spark cuts a partition into Arrow batches, each (queue, delay) group's chunks
    # are the same (a re-run meets the first run's producer ids) and keep the rows' order.
    def by_group(sent: list[Any]) -> list[Any]:
        return sorted(sent, key=lambda c: (c[0], c[1], c[3]))

    one = chunked(rows, [], batch, batch_bytes)
    cut = chunked(rows, [c for c in cuts if c <= len(rows)], batch, batch_bytes)
    assert by_group(cut) == by_group(one)
    for (queue, delay) in {(q, 7 if d is None else d) for q, d, _ in rows}:
        mine = [c for c in one if c[:2] == (queue, delay)]
        assert [n for *_, n, _ in mine] == list(range(1, len(mine) + 1))
        assert [x for *_, items in mine for x in items] == [
            x for q, d, x in rows if (q, 7 if d is None else d) == (queue, delay)]
        for *_, items in mine[:-1]:  # every chunk but a group's last is full
            assert len(items) == batch or sum(map(len, items)) >= batch_bytes
            assert sum(map(len, items[:-1])) < batch_bytes


def test_a_rerun_meets_the_first_runs_puts_and_one_with_other_rows_is_detected(
        server: ServerProcess) -> None:
    addr = server.rpc_address
    run = RunKey.for_job("unit", 3)
    rows = [b"r%d" % i for i in range(10)]
    with Client(addr) as c:
        def send(queue: str, chunks: list[list[bytes]], run: RunKey = run) -> ExactlyOnceSender:
            sender = ExactlyOnceSender(c, run, 0)
            group = run.group(queue, 0)
            for number, items in enumerate(chunks, 1):
                sender.send(queue, 0, group, number, items)
            return sender

        first = send("eo_same", [rows[:4], rows[4:8], rows[8:]])
        # (the first chunk is two puts: its rows, then its last row under its position)
        assert (first.stored, first.found, first.puts, first.diverged) == (10, 0, 4, 0)
        again = send("eo_same", [rows[:4], rows[4:8], rows[8:]])
        assert (again.stored, again.found, again.diverged) == (0, 10, 0)
        other_run = send("eo_same", [rows[:4]], RunKey.for_job("unit", 4))  # partition 4
        assert other_run.stored == 4
        assert Counter(drain_queue(addr, "eo_same")) == Counter(rows + rows[:4])

        # A run that stopped between the first chunk's two puts, then its re-run: once.
        group = run.group("eo_half", 0)
        half = [rows[:3], rows[3:]]
        c.put_sequenced("eo_half", half[0][:-1], content_id(group, 1, half[0]), 1)
        rerun = send("eo_half", half)
        assert (rerun.stored, rerun.found, rerun.diverged) == (8, 2, 0)
        assert drain_queue(addr, "eo_half") == rows

        # A re-run whose chunks hold the rows in another order: every row stored, and the
        # first chunk, which an earlier run completed with other rows, counted.
        send("eo_diverge", [rows[:5], rows[5:]])
        flipped = send("eo_diverge", [rows[::-1][:5], rows[::-1][5:]])
        assert flipped.diverged == 1 and flipped.found == 0 and flipped.stored == 10
        assert Counter(drain_queue(addr, "eo_diverge")) == Counter(rows + rows)


def test_a_task_whose_input_ended_early_is_told_apart_from_a_complete_one() -> None:
    # As PySpark's worker feeds a writer: an Arrow stream on a socket, then END_OF_STREAM
    # (-4) after a complete input, or end of file when the task failed upstream.
    table = pa.table({"data": [b"a", b"b", b"c"]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        for batch in table.to_batches(1):
            w.write_batch(batch)
    whole = sink.getvalue().to_pybytes()

    def read(payload: bytes, end: bytes | None) -> tuple[int, bool | None]:
        a, b = socket.socketpair()
        with a, b, b.makefile("rb") as stream:
            def load(s: Any) -> Iterator[pa.RecordBatch]:  # PySpark's load_stream
                yield from pa.ipc.open_stream(s)

            batches = map(lambda x: x, load(stream))
            probe = InputEnd(batches)
            a.sendall(payload + (end or b""))
            if end is None:
                a.shutdown(socket.SHUT_WR)
            rows = sum(x.num_rows for x in batches)
            return rows, probe.truncated()

    assert read(whole, struct.pack(">i", -4)) == (3, False)
    eos = len(whole) - 8  # the Arrow end-of-stream marker: 0xFFFFFFFF, 0
    assert read(whole[:eos], None) == (3, True)  # the JVM half-closed before the marker
    assert InputEnd(iter([])).truncated() is None  # no stream found: unknown


# -- the writer's columns and options, a task's write() called directly -------------------


def test_a_delay_column_delays_each_row_by_its_own_ms(server: ServerProcess) -> None:
    addr = server.rpc_address
    schema = StructType([StructField("delay", LongType()), StructField("data", BinaryType())])
    writer = QueuedWriter({"server": addr, "queue": "dly", "delay_ms": "0"}, schema)
    batch = pa.RecordBatch.from_pydict(
        {"delay": [None, 1500, 0, 1500, None], "data": [b"d0", b"late1", b"d1", b"late2",
                                                        b"d2"]})
    started = time.monotonic()
    commit = writer.write(iter([batch]))
    assert (commit.rows, commit.puts) == (5, 2)  # one put per (queue, delay)
    with Client(addr) as c:
        assert [it.data for it in c.get("dly", 10)] == [b"d0", b"d1", b"d2"]
        late = c.get("dly", 10, timeout_ms=5000)
        late += c.get("dly", 10, timeout_ms=1000) if len(late) < 2 else []
    assert [it.data for it in late] == [b"late1", b"late2"]
    assert time.monotonic() - started >= 1.4

    with pytest.raises(QueuedDataSourceError, match="column `delay` must be an integer"):
        QueuedWriter({"server": addr, "queue": "dly"},
                     StructType([StructField("delay", StringType()),
                                 StructField("data", BinaryType())]))
    bad = pa.RecordBatch.from_pydict({"delay": [5, -1], "data": [b"x", b"y"]})
    with pytest.raises(QueuedDataSourceError, match="column `delay` holds -1"):
        writer.write(iter([bad]))
    assert drain_queue(addr, "dly") == []  # refused before any put


def test_exactly_once_options_are_checked() -> None:
    schema = StructType([StructField("data", BinaryType())])
    with pytest.raises(QueuedDataSourceError, match="unknown option exactly_once"):
        QueuedWriter({"server": "h:1", "queue": "q", "exactly_once": "true"}, schema)
    with pytest.raises(QueuedDataSourceError, match="option delivery_timeout must be positive"):
        QueuedWriter({"server": "h:1", "queue": "q", "delivery_timeout": "0"}, schema)
    assert QueuedWriter({"server": "h:1", "queue": "q", "idempotency_key": "k"},
                        schema).exactly_once
    assert not QueuedWriter({"server": "h:1", "queue": "q"}, schema).exactly_once


# -- with Spark ------------------------------------------------------------------------------


def test_idempotency_key_makes_a_batch_write_run_again_store_nothing_twice(
        spark: Any, server: ServerProcess) -> None:
    addr = server.rpc_address
    df = spark.range(1000, numPartitions=2).selectExpr(
        "cast(concat('k-', cast(id as string)) as binary) as data",
        "if(id % 2 = 0, array(named_struct('key', 'n', 'value', cast(cast(id as string) "
        "as binary))), null) as headers")  # (the chunks' digests count them)

    def save(key: str) -> None:
        (df.write.format("queued").mode("append").option("server", addr)
         .option("queue", "idem").option("batch_size", 150)
         .option("idempotency_key", key).save())

    save("nightly-2026-11-28")
    save("nightly-2026-11-28")  # the same job again: nothing stored
    expected = {b"k-%d" % i for i in range(1000)}
    with Client(addr) as c:
        items = c.get("idem", 5000, with_headers=True)
    assert all(it.headers == ({"n": str(int(it.data[2:])).encode()}
                              if int(it.data[2:]) % 2 == 0 else {}) for it in items)
    assert tally(expected, [it.data for it in items] + drain_queue(addr, "idem"),
                 "idempotency_key, job run twice")[2] == 0
    save("nightly-2026-11-29")  # another key: stored again
    assert Counter(drain_queue(addr, "idem")) == Counter(expected)


def test_a_server_killed_mid_batch_and_restarted_stores_each_row_once(
        spark: Any, tmp_path: Path) -> None:
    rows = [b"row-%06d-" % i + b"x" * 90 for i in range(8000)]
    trio.run(write_journal, tmp_path / "journal", rows, 500)
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log").start()
    addr = server.rpc_address
    try:
        q = (spark.readStream.format("queued").option("maxOffsetsPerTrigger", 2000)
             .load(str(tmp_path / "journal")).select("data")
             .writeStream.format("queued").option("server", addr).option("queue", "sk")
             .option("batch_size", 100).option("delivery_timeout", "60")
             .option("checkpointLocation", str(tmp_path / "ck"))
             .trigger(availableNow=True).start())
        held = 0
        with Client(addr) as c:
            for _ in range(3000):  # bounded: until micro-batch 1's puts are streaming in
                held = c.peek("sk").items
                if held >= 2500 or not q.isActive:
                    break
                time.sleep(0.02)
        assert 2500 <= held < len(rows), held  # inside micro-batch 1 of 4
        server.kill()  # SIGKILL
        server.start(rpc_port=server.rpc)
        assert q.awaitTermination(240)
        assert q.exception() is None
        stored = drain_queue(addr, "sk")
    finally:
        server.kill()
    assert tally(set(rows), stored, "server SIGKILLed mid-batch")[2] == 0


@pytest.fixture(scope="module")
def faults(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run of tests/spark_sink_driver.py (its docstring says what it does) killed with
    SIGKILL inside micro-batch 2, then its query restarted in a new process: WORKDIR."""
    root = tmp_path_factory.mktemp("sink-faults")
    trio.run(write_journal, root / "journal", [b"row-%05d" % i for i in range(1500)], 100)
    work = root / "work"
    work.mkdir()
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    cmd = [sys.executable, str(DRIVER), str(root / "journal"), server.rpc_address, str(work)]
    with (root / "first.log").open("wb") as log:
        first = subprocess.Popen([*cmd, "--pause"], stdout=log, stderr=log, env=env,
                                 start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (work / "killed.paused").exists():
            assert first.poll() is None, (root / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the driver never reached micro-batch 2"
            time.sleep(0.1)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the driver, its JVM and Python workers
        first.wait(30)
    with (root / "again.log").open("wb") as log:
        again = subprocess.run(cmd, stdout=log, stderr=log, env=env, timeout=300, check=False)
    assert again.returncode == 0, (root / "again.log").read_text()[-3000:]
    return work


def expected_rows(work: Path, queue: str) -> set[bytes]:
    """The rows each partition of the queue's micro-batches gave (in its final run)."""
    found = set()
    for path in work.glob(f"{queue}.*.rows"):
        found |= set(path.read_bytes().split(b"\n"))
    return found


def test_a_task_retried_after_the_sink_stored_some_rows_stores_each_row_once(
        faults: Path, server: ServerProcess) -> None:
    assert (faults / "retry.failed-once").exists()  # the first attempt did fail
    expected = expected_rows(faults, "retry")
    assert tally(expected, drain_queue(server.rpc_address, "retry"), "task retry")[2] == 0


def test_a_driver_killed_mid_batch_and_restarted_from_its_checkpoint_stores_each_row_once(
        faults: Path, server: ServerProcess) -> None:
    assert (faults / "killed.paused").exists()  # killed inside micro-batch 2
    log = (faults.parent / "again.log").read_text()
    assert "micro-batch 2: " in log and "were stored before" in log  # the restart re-ran it
    expected = expected_rows(faults, "killed")
    assert tally(expected, drain_queue(server.rpc_address, "killed"), "driver SIGKILL")[2] == 0
    steady = expected_rows(faults, "steady")
    assert tally(steady, drain_queue(server.rpc_address, "steady"), "micro-batch 0")[2] == 0


def test_a_rerun_with_other_rows_is_detected_and_loses_no_row(
        faults: Path, server: ServerProcess) -> None:
    assert (faults / "diverge.failed-once").exists()
    expected = expected_rows(faults, "diverge")
    stored = drain_queue(server.rpc_address, "diverge")
    _, _, dups = tally(expected, stored, "re-run with other rows")
    log = (faults.parent / "first.log").read_text()
    assert "micro-batch 1 had run before with other rows in 1 chunks" in log  # detected
    # The first attempt stored whole chunks; the reversed re-run stored every row again
    # (its chunks all differ), so those rows are the duplicates.
    assert 0 < dups < len(expected)
