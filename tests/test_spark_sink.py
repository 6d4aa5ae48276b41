"""The Spark sink (`queued.spark.sink`) against a real local SparkSession (local[2], the
same session as tests/test_spark_source.py) and real `queued serve` subprocesses: each queue's
rows come out in partition order, routing by the queue column, null data refused or
skipped, an item over the server's max_item_size, an unreachable server, failover to
a second server when the first is killed between puts, and TLS with a login."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from security_util import Pki, users_toml
from server_util import ServerProcess, drain_queue

from queued.client import Client
from queued.storage.opening import open_data_dir

try:
    import pyarrow as pa
    from pyspark.sql.types import BinaryType, StringType, StructField, StructType

    from queued.spark import QueuedDataSourceError
    from queued.spark.sink import QueuedWriter, WriteCommit
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"pyspark/pyarrow not installed ({exc}); pip install -e '.[spark]'",
                allow_module_level=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the tests that need nothing special (each uses its own queues)."""
    root = tmp_path_factory.mktemp("writer-server")
    proc = ServerProcess(root / "data", root / "server.log").start()
    try:
        yield proc
    finally:
        proc.kill()


def save(df: Any, addr: str, **options: str) -> None:
    df.write.format("queued").mode("append").option("server", addr).options(**options).save()


@pytest.mark.parametrize(("prefix", "options"), [
    ("cnt", {"batch_size": "7"}),  # many small puts
    ("byt", {"batch_bytes": "300"}),  # puts cut by bytes (the per-item path)
])
def test_each_queue_gets_its_rows_in_partition_order(
        spark: Any, server: ServerProcess, prefix: str, options: dict[str, str]) -> None:
    n = 3000
    # Each range partition holds increasing ids; rows go to three queues by id % 3, with
    # sizes 0..49 bytes of padding. Arrow batches of 128 rows make puts span batches.
    df = spark.range(n, numPartitions=3).selectExpr(
        f"concat('{prefix}', cast(id % 3 as string)) as queue",
        "cast(concat(cast(spark_partition_id() as string), ':', cast(id as string), ':',"
        " repeat('x', cast(id % 50 as int))) as binary) as data")
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "128")
    try:
        save(df, server.rpc_address, **options)
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    for k in range(3):
        items = drain_queue(server.rpc_address, f"{prefix}{k}")
        parsed = [tuple(int(x) for x in it.split(b":")[:2]) for it in items]
        assert sorted(i for _, i in parsed) == list(range(k, n, 3))  # each exactly once
        assert all(it.endswith(b":" + b"x" * (i % 50)) for it, (_, i) in zip(
            items, parsed, strict=True))
        for partition in range(3):
            ids = [i for p, i in parsed if p == partition]
            assert ids and ids == sorted(ids), (k, partition)


def test_queue_column_routes_rows_and_null_queues_take_the_option(
        spark: Any, server: ServerProcess) -> None:
    addr = server.rpc_address
    rows = [("route_a", "a0"), (None, "d0"), ("route_b", "b0"), ("route_a", "a1"),
            (None, "d1"), ("route_b", "b1"), ("route_a", "a2")]
    df = spark.createDataFrame(rows, "queue string, data string").coalesce(1)
    save(df, addr, queue="route_default")
    assert drain_queue(addr, "route_a") == [b"a0", b"a1", b"a2"]
    assert drain_queue(addr, "route_b") == [b"b0", b"b1"]
    assert drain_queue(addr, "route_default") == [b"d0", b"d1"]

    with pytest.raises(Exception, match="rows with a null `queue` and there is no"):
        save(df, addr)
    bad = spark.createDataFrame([("no spaces allowed", "x")], "queue string, data string")
    with pytest.raises(Exception, match=re.escape("bad queue name 'no spaces allowed'")):
        save(bad, addr)
    with pytest.raises(Exception, match="column `data` must be binary or string, not int"):
        save(spark.createDataFrame([(1,)], "data int"), addr, queue="route_a")
    assert drain_queue(addr, "route_a") == []  # every refusal came before any put


def test_null_data_is_an_error_unless_skip_null_data(
        spark: Any, server: ServerProcess) -> None:
    addr = server.rpc_address
    rows = [(b"n0",), (None,), (b"n1",), (None,), (b"n2",)]
    df = spark.createDataFrame(rows, "data binary").coalesce(1)
    with pytest.raises(Exception, match=re.escape(
            'got 2 rows with a null `data` in a batch of 5 (the first is row 1 of this '
            'partition; rows before it may already be stored): filter them out, or set '
            '.option("skip_null_data", "true") to skip them')):
        save(df, addr, queue="nulls")
    assert drain_queue(addr, "nulls") == []  # the null came in the first batch: nothing sent
    save(df, addr, queue="nulls", skip_null_data="true")
    assert drain_queue(addr, "nulls") == [b"n0", b"n1", b"n2"]
    with pytest.raises(Exception, match="option skip_null_data must be true or false"):
        save(df, addr, queue="nulls", skip_null_data="maybe")
    with pytest.raises(Exception, match="option expiration_ms must be a whole number"):
        save(df, addr, queue="nulls", expiration_ms="soon")


def test_commit_message_counts_rows_puts_and_skipped_rows(server: ServerProcess) -> None:
    # The writer's write() called directly (as a Spark task does) on Arrow batches.
    schema = StructType([StructField("queue", StringType()), StructField("data", BinaryType())])
    writer = QueuedWriter({"server": server.rpc_address, "batch_size": "2", "queue": "cm_d",
                           "skip_null_data": "true"}, schema)
    batches = [
        pa.RecordBatch.from_pydict({"queue": ["cm_a", None, "cm_a", "cm_b"],
                                    "data": [b"1", b"2", None, b"3"]}),
        pa.RecordBatch.from_pydict({"queue": ["cm_a", "cm_a"], "data": [None, b"4"]}),
    ]
    commit = writer.write(iter(batches))
    # cm_a gets 1 and 4 (one put), cm_d 2, cm_b 3: three puts, two null rows skipped.
    assert commit == WriteCommit(rows=4, puts=3, skipped=2)
    assert drain_queue(server.rpc_address, "cm_a") == [b"1", b"4"]
    assert drain_queue(server.rpc_address, "cm_d") == [b"2"]
    assert drain_queue(server.rpc_address, "cm_b") == [b"3"]


def test_an_item_over_the_servers_max_item_size_fails_the_write(
        spark: Any, tmp_path: Path) -> None:
    config = tmp_path / "queued.toml"
    config.write_text("[server]\nmax_item_size = 4096\n\n[queues.tiny]\nmax_items = 2\n")
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log", config).start()
    try:
        addr = server.rpc_address
        df = spark.createDataFrame([(b"small",), (b"y" * 5000,), (b"after",)],
                                   "data binary").coalesce(1)
        with pytest.raises(Exception, match=re.escape(
                f"a put of 3 items into queue 'big' on {addr} was refused: ITEM_TOO_LARGE: "
                "item over the server's max_item_size (4096 bytes)")) as info:
            save(df, addr, queue="big")
        assert "its largest item has 5000 bytes" in str(info.value)
        assert drain_queue(addr, "big") == []  # the put was refused whole
        # A full queue: the third one-item put is refused, the first two are stored.
        writer = QueuedWriter({"server": addr, "queue": "tiny", "batch_size": "1"},
                              StructType([StructField("data", BinaryType())]))
        with pytest.raises(QueuedDataSourceError, match=re.escape(
                f"a put of 1 items into queue 'tiny' on {addr} was refused: QUEUE_FULL")
                + ".*consume it or raise the limit"):
            writer.write(iter([pa.RecordBatch.from_pydict({"data": [b"1", b"2", b"3"]})]))
        assert drain_queue(addr, "tiny") == [b"1", b"2"]
    finally:
        server.kill()


def test_an_unreachable_server_fails_the_write_naming_it(spark: Any) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    df = spark.createDataFrame([(b"x",)], "data binary")
    with pytest.raises(Exception, match=re.escape(
            f"the queued sink cannot reach option server '127.0.0.1:{port}' (a put of 1 "
            "items into queue 'nowhere'):")):
        save(df, f"127.0.0.1:{port}", queue="nowhere", connect_timeout="2")
    with pytest.raises(Exception, match="option server 'nohost:notaport'"):
        save(df, "nohost:notaport", queue="nowhere")


def test_puts_fail_over_to_the_next_server(tmp_path: Path) -> None:
    a = ServerProcess(tmp_path / "a", tmp_path / "a.log").start()
    b = ServerProcess(tmp_path / "b", tmp_path / "b.log").start()
    try:
        schema = StructType([StructField("data", BinaryType())])
        writer = QueuedWriter({"server": f"{a.rpc_address},{b.rpc_address}", "queue": "fo",
                               "batch_size": "10"}, schema)

        def batches() -> Iterator[pa.RecordBatch]:
            yield pa.RecordBatch.from_pydict({"data": [b"first-%d" % i for i in range(40)]})
            a.kill()  # between two batches: the next puts meant for a go to b
            yield pa.RecordBatch.from_pydict({"data": [b"second-%d" % i for i in range(40)]})

        commit = writer.write(batches())
        assert (commit.rows, commit.puts) == (80, 8)
        on_b = drain_queue(b.rpc_address, "fo")
        a.start()
        on_a = drain_queue(a.rpc_address, "fo")  # acknowledged before the kill: still there
        assert sorted(on_a + on_b) == sorted([b"first-%d" % i for i in range(40)]
                                             + [b"second-%d" % i for i in range(40)])
        assert on_a and all(x.startswith(b"first-") for x in on_a)
        assert [x for x in on_b if x.startswith(b"second-")] == [
            b"second-%d" % i for i in range(40)]  # in order
    finally:
        a.kill()
        b.kill()


async def _journal(path: Path, items: list[bytes]) -> None:
    async with open_data_dir(path) as dd:
        await dd.queue("in").append(items, 1_700_000_000_000)


def test_tls_and_login_options(spark: Any, tmp_path: Path) -> None:
    """One Spark job against a server with TLS and users; the option checks and a wrong
    password through the writer alone (no job: Spark tests are slow)."""
    pki = Pki(tmp_path)
    users = tmp_path / "users.toml"
    users.write_text(users_toml(writer={"password": "w pw", "put": ["sec*"], "get": ["*"]}))
    config = tmp_path / "queued.toml"
    config.write_text(f'[server]\ntls_cert = "{pki.cert}"\ntls_key = "{pki.key}"\n'
                      f'users_file = "{users}"\n')
    proc = ServerProcess(tmp_path / "data", tmp_path / "server.log", config).start()
    try:
        addr = proc.rpc_address
        login = {"user": "writer", "password": "w pw"}
        df = spark.createDataFrame([(b"s1",), (b"s2",)], "data binary").coalesce(1)
        save(df, addr, queue="sec", tls_ca=str(pki.ca_file), **login)
        with Client(addr, tls=pki.client(), **login) as c:
            assert [i.data for i in c.get("sec", 10)] == [b"s1", b"s2"]

        # The streaming sink takes the same options; the password shows nowhere.
        journal = tmp_path / "journal"
        trio.run(_journal, journal, [b"t1", b"t2", b"t3"])

        def stream(password: str, ckpt: str) -> Any:
            return (spark.readStream.format("queued").load(str(journal)).select("data")
                    .writeStream.format("queued").option("server", addr)
                    .option("queue", "sec").option("tls_ca", str(pki.ca_file))
                    .option("user", "writer").option("password", password)
                    .option("checkpointLocation", str(tmp_path / ckpt))
                    .trigger(availableNow=True).start())

        q = stream("w pw", "ck1")
        assert q.awaitTermination(120)
        shown = json.dumps(q.recentProgress, default=str) + q._jsq.explainInternal(True)
        assert "w pw" not in shown and "numInputRows" in shown
        with Client(addr, tls=pki.client(), **login) as c:
            assert [i.data for i in c.get("sec", 10)] == [b"t1", b"t2", b"t3"]
        bad = stream("secret wrong pw", "ck2")
        with pytest.raises(Exception, match="check options user and password") as failed:
            bad.awaitTermination(120)
        assert "secret wrong pw" not in str(failed.value)
        assert "w pw" not in (tmp_path / "server.log").read_text()

        schema = StructType([StructField("data", BinaryType())])
        rows = pa.RecordBatch.from_pydict({"data": [b"x"]})

        def write(**options: str) -> WriteCommit:
            return QueuedWriter({"server": addr, "queue": "sec", **options},
                                schema).write(iter([rows]))

        with pytest.raises(QueuedDataSourceError, match="check options user and password"):
            write(tls="true", tls_ca=str(pki.ca_file), user="writer", password="nope")
        with pytest.raises(QueuedDataSourceError, match="give options user and password"):
            write(tls_ca=str(pki.ca_file))
        with pytest.raises(QueuedDataSourceError, match=r"cannot reach.*not trusted"):
            write(tls="true", **login)  # the system's CAs do not know trustme's
        with pytest.raises(QueuedDataSourceError, match=r"missing\.pem: cannot load"):
            write(tls_ca=str(tmp_path / "missing.pem"), **login)
        with pytest.raises(QueuedDataSourceError, match="give both"):
            QueuedWriter({"server": addr, "queue": "sec", "user": "writer"}, schema)
        with pytest.raises(QueuedDataSourceError, match="tls_key needs option tls_cert"):
            QueuedWriter({"server": addr, "queue": "sec", "tls_key": "k.pem"}, schema)
    finally:
        proc.kill()
