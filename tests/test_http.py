"""The operations port over real HTTP: /metrics, /livez, /readyz, /stats.json.

Requests go through the standard library's http.client (in a worker thread) or a
raw socket for malformed input; the metrics are read back with prometheus-client's
own parsers, text and OpenMetrics, so the exposition is checked as Prometheus
would read it. Each test runs its own server on free 127.0.0.1 ports.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import platform
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
from disk_util import fill_completely
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text
from server_util import HOST, WAIT, Conn, ServerProcess, http_get, make_config, running

from queued import __version__
from queued.config import ServerConfig
from queued.server import http as qhttp
from queued.server.http import Ops, serve_http
from queued.server.listeners import Server

Labels = frozenset[tuple[str, str]]


def cfg(tmp_path: Path, toml: str | None = None, **settings: object) -> ServerConfig:
    return make_config(tmp_path / "data", toml, **settings)


async def get(port: int, path: str, headers: dict[str, str] | None = None, *,
              method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    return await trio.to_thread.run_sync(
        lambda: http_get(port, path, headers, method=method))


def samples(text: str) -> dict[tuple[str, Labels], float]:
    """{(sample name, labels): value} of a text exposition."""
    out: dict[tuple[str, Labels], float] = {}
    for family in parse_text(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


async def scrape(server: Server) -> dict[tuple[str, Labels], float]:
    status, headers, body = await get(server.ports["http"], "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    return samples(body.decode())


def q(queue: str, reader: str = "") -> Labels:
    return frozenset({("queue", queue), ("reader", reader)})


def lab(**labels: str) -> Labels:
    return frozenset(labels.items())


NONE: Labels = frozenset()


async def mc(server: Server, *lines: bytes) -> list[bytes]:
    """Send memcache commands on a fresh connection; the (single) reply line of each."""
    conn = await Conn.open(server.ports["memcache"])
    try:
        out = []
        for line in lines:
            out.append(await conn.cmd(line))
        return out
    finally:
        await conn.aclose()


async def put(server: Server, queue: str, *values: bytes) -> None:
    conn = await Conn.open(server.ports["memcache"])
    try:
        for v in values:
            assert await conn.set(queue, v) == b"STORED"
    finally:
        await conn.aclose()


# -- health --------------------------------------------------------------------------------


async def test_livez_readyz_and_index(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        port = server.ports["http"]
        status, headers, body = await get(port, "/livez")
        assert (status, body) == (200, b"ok\n")
        assert headers["content-type"] == "text/plain; charset=utf-8"
        assert headers["cache-control"] == "no-store"
        status, _, body = await get(port, "/readyz")
        assert (status, body) == (200, b"ready\n")
        status, _, body = await get(port, "/readyz?verbose=1")  # the query is ignored
        assert status == 200
        status, _, body = await get(port, "/")
        assert status == 200 and b"/metrics" in body and __version__.encode() in body


async def test_stats_json_has_the_stats_figures(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        await put(server, "jobs", b"a", b"bcd")
        status, headers, body = await get(server.ports["http"], "/stats.json")
        assert status == 200 and headers["content-type"] == "application/json"
        doc = json.loads(body)
        assert doc["queues"]["jobs"]["items"] == 2
        assert doc["queues"]["jobs"]["bytes"] == 4
        assert doc["server"]["version"] == __version__
        assert doc["server"]["cmd_set"] == 2
        # The same figures as the memcache `stats` command.
        conn = await Conn.open(server.ports["memcache"])
        try:
            mstats = await conn.stats()
        finally:
            await conn.aclose()
        assert mstats["queue_jobs_items"] == "2"
        assert mstats["cmd_set"] == str(doc["server"]["cmd_set"])
        assert set(doc["server"]) <= set(mstats)


async def test_methods_and_paths(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        port = server.ports["http"]
        status, headers, body = await get(port, "/metrics", method="POST")
        assert status == 405 and headers["allow"] == "GET, HEAD"
        status, _, body = await get(port, "/nope")
        assert status == 404 and b"/readyz" in body
        status, headers, body = await get(port, "/metrics", method="HEAD")
        assert status == 200 and body == b"" and int(headers["content-length"]) > 1000


def raw_http(port: int, data: bytes, timeout: float = WAIT) -> bytes:
    """Blocking: send raw bytes, read until the server closes."""
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


async def raw(port: int, data: bytes) -> bytes:
    return await trio.to_thread.run_sync(raw_http, port, data)


async def test_malformed_requests_get_4xx_and_a_closed_connection(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        port = server.ports["http"]
        reply = await raw(port, b"NONSENSE\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 400 ")
        huge = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n"
        reply = await raw(port, huge)
        assert reply.split(b"\r\n")[0] in (b"HTTP/1.1 431 Request Header Fields Too Large",
                                           b"HTTP/1.1 400 Bad Request")
        body = b"x" * (qhttp.MAX_BODY_BYTES + 1)
        reply = await raw(port, b"GET /livez HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                          % (len(body), body))
        assert reply.startswith(b"HTTP/1.1 413 ")
        # A small body is read and ignored; the connection stays usable (keep-alive).
        reply = await raw(port, b"GET /livez HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
                          b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert reply.count(b"HTTP/1.1 200 OK") == 2 and reply.endswith(b"ready\n")
        # The server still answers afterwards.
        status, _, _ = await get(port, "/livez")
        assert status == 200


async def test_a_stalled_request_times_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           ) -> None:
    monkeypatch.setattr(qhttp, "REQUEST_TIMEOUT", 0.3)
    async with running(cfg(tmp_path)) as server:
        reply = await raw(server.ports["http"], b"GET /livez HTTP/1.1\r\nHo")
        assert reply.startswith(b"HTTP/1.1 408 ")
        # An idle keep-alive connection is closed quietly.
        assert await raw(server.ports["http"], b"") == b""


async def test_too_many_http_connections_are_closed(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qhttp, "MAX_CONNECTIONS", 3)
    async with running(cfg(tmp_path)) as server:
        port = server.ports["http"]
        held = [await trio.open_tcp_stream(HOST, port) for _ in range(3)]
        try:
            await trio.sleep(0.1)  # let the server accept them
            assert await raw(port, b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n") == (
                qhttp.TOO_MANY_REPLY)
        finally:
            for s in held:
                await s.aclose()
        with trio.fail_after(WAIT):
            while (await raw(port, b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close"
                             b"\r\n\r\n")) == qhttp.TOO_MANY_REPLY:
                await trio.sleep(0.05)


# -- metrics ---------------------------------------------------------------------------------


async def test_metrics_per_queue_and_reader(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        await put(server, "jobs", b"one", b"two", b"three", b"four")
        conn = await Conn.open(server.ports["memcache"])
        try:
            assert await conn.get("jobs") == b"one"
            assert await conn.get("jobs/open") == b"two"  # stays an open read
            m = await scrape(server)
            assert m[("queued_queue_items", q("jobs"))] == 2
            assert m[("queued_queue_bytes", q("jobs"))] == len(b"threefour")
            assert m[("queued_queue_memory_bytes", q("jobs"))] == len(b"threefour")
            assert m[("queued_queue_open_reads", q("jobs"))] == 1
            assert m[("queued_queue_waiters", q("jobs"))] == 0
            assert m[("queued_queue_puts_total", q("jobs"))] == 4
            assert m[("queued_queue_gets_total", q("jobs"))] == 2
            assert m[("queued_queue_aborted_total", q("jobs"))] == 0
            assert await conn.cmd(b"get jobs/abort") == b"END"
        finally:
            await conn.aclose()
        m = await scrape(server)
        assert m[("queued_queue_aborted_total", q("jobs"))] == 1
        assert m[("queued_queue_items", q("jobs"))] == 3
        assert m[("queued_queue_open_reads", q("jobs"))] == 0
        assert m[("queued_queue_expired_total", q("jobs"))] == 0
        assert m[("queued_queue_flushes_total", q("jobs"))] == 0
        assert m[("queued_queue_discarded_total", q("jobs"))] == 0
        # Journal series per queue.
        assert m[("queued_journal_segments", lab(queue="jobs"))] == 1
        assert m[("queued_journal_bytes", lab(queue="jobs"))] > len(b"onetwothreefour")
        assert m[("queued_journal_failed", lab(queue="jobs"))] == 0
        assert m[("queued_journal_fsyncs_total", lab(queue="jobs"))] >= 1
        assert m[("queued_journal_write_errors_total", lab(queue="jobs"))] == 0
        assert m[("queued_queues", NONE)] == 1
        assert m[("queued_ready", NONE)] == 1
        assert m[("queued_recovering", NONE)] == 0
        assert m[("queued_build_info", lab(version=__version__,
                                           python=platform.python_version()))
                 ] == 1
        assert m[("process_resident_memory_bytes", NONE)] > 0


async def test_fanout_readers_have_their_own_series(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        assert await mc(server, b"get jobs+audit") == [b"END"]  # creates the reader
        await put(server, "jobs", b"a", b"b")
        conn = await Conn.open(server.ports["memcache"])
        try:
            assert await conn.get("jobs+audit") == b"a"
        finally:
            await conn.aclose()
        m = await scrape(server)
        assert m[("queued_queue_items", q("jobs", "audit"))] == 1
        assert m[("queued_queue_gets_total", q("jobs", "audit"))] == 1
        assert m[("queued_queue_puts_total", q("jobs", "audit"))] == 2
        assert m[("queued_journal_segments", lab(queue="jobs"))] == 1


async def test_oldest_item_age(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        m = await scrape(server)
        await put(server, "jobs", b"a", b"b")
        real = server.broker.clock
        server.broker.clock = lambda: real() + 90_000  # 90 s later
        try:
            m = await scrape(server)
        finally:
            server.broker.clock = real
        assert 89 <= m[("queued_queue_oldest_item_age_seconds", q("jobs"))] <= 95
        conn = await Conn.open(server.ports["memcache"])
        try:
            assert [await conn.get("jobs"), await conn.get("jobs")] == [b"a", b"b"]
        finally:
            await conn.aclose()
        m = await scrape(server)
        assert m[("queued_queue_oldest_item_age_seconds", q("jobs"))] == 0


async def test_commands_errors_connections_and_latency(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        await put(server, "jobs", b"a", b"b", b"c")
        conn = await Conn.open(server.ports["memcache"])
        try:
            assert await conn.get("jobs") == b"a"
            assert await conn.cmd(b"bogus command") == b"ERROR"
            assert await conn.cmd(b"version") == b"VERSION " + __version__.encode()
        finally:
            await conn.aclose()
        text = await trio.open_tcp_stream(HOST, server.ports["text"])
        rpc = await trio.open_tcp_stream(HOST, server.ports["rpc"])
        try:
            await text.send_all(b"PUT jobs:\nd\n\nGET jobs\n")
            await rpc.send_all(msgpack.packb([0, 1, "no_such_method", []])
                               + msgpack.packb([0, 2, "put", ["jobs", [b"e", b"f"]]]))
            unpacker = msgpack.Unpacker(raw=False)
            got: list[Any] = []
            replies = b""
            with trio.fail_after(WAIT):
                while len(got) < 2:
                    unpacker.feed(await rpc.receive_some(4096))
                    got.extend(unpacker)
                while replies.count(b"\n") < 2:
                    replies += await text.receive_some(4096)
            assert got[0][:2] == [1, 1] and got[0][2] is not None  # an error reply
            assert got[1] == [1, 2, None, 2]
            m = await scrape(server)
            assert m[("queued_open_connections", lab(protocol="text"))] == 1
            assert m[("queued_open_connections", lab(protocol="rpc"))] == 1
        finally:
            await text.aclose()
            await rpc.aclose()
        with trio.fail_after(WAIT):
            while (await scrape(server))[("queued_open_connections", lab(protocol="rpc"))]:
                await trio.sleep(0.02)
        m = await scrape(server)
        cmd = "queued_commands_total"
        assert m[(cmd, lab(protocol="memcache", command="set"))] == 3
        assert m[(cmd, lab(protocol="memcache", command="get"))] == 1
        assert m[(cmd, lab(protocol="memcache", command="version"))] == 1
        assert m[(cmd, lab(protocol="rpc", command="put"))] == 1
        assert ("queued_commands_total", lab(protocol="rpc", command="no_such_method")) not in m
        assert m[("queued_protocol_errors_total", lab(protocol="memcache"))] == 1
        assert m[("queued_protocol_errors_total", lab(protocol="rpc"))] == 1
        assert m[("queued_connections_total", lab(protocol="memcache"))] == 2
        assert m[("queued_connections_total", lab(protocol="rpc"))] == 1
        assert m[("queued_connections_refused_total", lab(protocol="memcache"))] == 0
        assert m[("queued_bytes_read_total", NONE)] > 0
        assert m[("queued_bytes_written_total", NONE)] > 0
        assert m[(cmd, lab(protocol="text", command="put"))] == 1
        assert m[(cmd, lab(protocol="text", command="get"))] == 1
        # 3 memcache sets sent one by one, 1 text put, 1 rpc put of two items.
        puts = m[("queued_put_latency_seconds_count", NONE)]
        assert puts == 5
        assert m[("queued_put_latency_seconds_bucket", lab(le="+Inf"))] == puts
        assert m[("queued_put_latency_seconds_sum", NONE)] > 0
        assert m[("queued_get_latency_seconds_count", NONE)] >= 1
        fsyncs = m[("queued_fsync_duration_seconds_count", NONE)]
        assert fsyncs >= 1  # fsync "always" by default
        buckets = [v for (name, labels), v in m.items()
                   if name == "queued_fsync_duration_seconds_bucket"]
        assert max(buckets) == fsyncs and min(buckets) >= 0
        assert m[("queued_recovery_duration_seconds", NONE)] >= 0
        assert m[("queued_recovery_truncated_bytes", NONE)] == 0
        assert m[("queued_disk_total_bytes", NONE)] > m[("queued_disk_free_bytes", NONE)] > 0


async def test_openmetrics_and_gzip(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        await put(server, "jobs", b"a")
        port = server.ports["http"]
        status, headers, body = await get(port, "/metrics", {
            "Accept": "application/openmetrics-text; version=1.0.0; charset=utf-8",
            "Accept-Encoding": "gzip"})
        assert status == 200
        assert headers["content-type"].startswith("application/openmetrics-text")
        assert headers["content-encoding"] == "gzip"
        text = gzip.decompress(body).decode()
        assert text.endswith("# EOF\n")
        # The strict OpenMetrics parser refuses duplicate family names, among others.
        families = {f.name: f for f in parse_openmetrics(text)}
        assert families["queued_connections"].type == "counter"
        assert families["queued_open_connections"].type == "gauge"
        assert families["queued_put_latency_seconds"].type == "histogram"
        items = [s for s in families["queued_queue_items"].samples if s.labels["queue"] == "jobs"]
        assert [s.value for s in items] == [1]
        # gzip refused (q=0): plain text.
        status, headers, body = await get(port, "/metrics", {"Accept-Encoding": "gzip;q=0"})
        assert "content-encoding" not in headers and body.startswith(b"# HELP")


async def test_per_queue_series_are_capped(tmp_path: Path) -> None:
    async with running(cfg(tmp_path, metrics_max_queues=2)) as server:
        for name in ("c", "a", "b"):
            await put(server, name, b"x")
        m = await scrape(server)
        exported = sorted(dict(labels)["queue"] for name, labels in m
                          if name == "queued_queue_items")
        assert exported == ["a", "b"]  # by name: the same set on every scrape
        journals = sorted(dict(labels)["queue"] for name, labels in m
                          if name == "queued_journal_bytes")
        assert journals == ["a", "b"]
        assert m[("queued_metrics_omitted_readers", NONE)] == 1
        assert m[("queued_queues", NONE)] == 3
    async with running(cfg(tmp_path, metrics_max_queues=0)) as server:
        m = await scrape(server)
        assert not [k for k in m if k[0] == "queued_queue_items"]
        assert m[("queued_metrics_omitted_readers", NONE)] == 3


# -- readiness -------------------------------------------------------------------------------


async def test_before_recovery_has_finished(tmp_path: Path) -> None:
    """The operations port answers before the journals are recovered (server None)."""
    config = cfg(tmp_path)
    ops = Ops(config)
    listeners = await trio.open_tcp_listeners(0, host=HOST)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_http, ops, listeners)
        status, _, body = await get(port, "/livez")
        assert status == 200
        status, _, body = await get(port, "/readyz")
        assert (status, body) == (503, b"not ready: recovering the journals\n")
        status, _, body = await get(port, "/stats.json")
        assert status == 503 and json.loads(body) == {"error": "recovering the journals"}
        status, _, body = await get(port, "/metrics")
        m = samples(body.decode())
        assert m[("queued_recovering", NONE)] == 1 and m[("queued_ready", NONE)] == 0
        assert ("queued_queue_items", q("jobs")) not in m
        nursery.cancel_scope.cancel()


async def test_not_ready_while_shutting_down_or_when_a_journal_failed(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        await put(server, "jobs", b"a")
        ops = Ops(server.config)
        ops.server = server
        assert ops.problems() == []
        journal = server.broker.queues["jobs"].journal
        journal.file.set_failed("fsync failed: [Errno 5] Input/output error")  # as the writer does
        problems = ops.problems()
        assert len(problems) == 1 and problems[0].startswith("queue jobs: ")
        assert "Input/output error" in problems[0]
        status, _, body = await get(server.ports["http"], "/readyz")
        assert status == 503 and b"queue jobs" in body
        m = await scrape(server)
        assert m[("queued_journal_failed", lab(queue="jobs"))] == 1
        assert m[("queued_ready", NONE)] == 0
        server.request_shutdown("test")
        assert ops.problems() == ["shutting down"]


async def test_full_disk_is_not_ready_and_warned(tmpfs: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    data = tmpfs / "data"
    config = make_config(data, min_free_disk="1MiB")
    async with running(config) as server:
        await put(server, "jobs", b"a")
        status, _, _ = await get(server.ports["http"], "/readyz")
        assert status == 200
        filler = tmpfs / "filler"
        fill_completely(filler)
        with caplog.at_level(logging.WARNING, logger="queued.server"):
            server.check_disk()
        warned = [r for r in caplog.records if getattr(r, "event", None) == "disk_low"]
        assert len(warned) == 1 and "disk nearly full" in warned[0].getMessage()
        assert warned[0].free_bytes == 0  # type: ignore[attr-defined]
        server.check_disk()  # not repeated at once
        assert len([r for r in caplog.records if getattr(r, "event", None) == "disk_low"]) == 1
        status, _, body = await get(server.ports["http"], "/readyz")
        assert status == 503 and b"disk full" in body
        m = await scrape(server)
        assert m[("queued_disk_free_bytes", NONE)] == 0
        assert m[("queued_disk_total_bytes", NONE)] == 2 * 1024 * 1024
        filler.unlink()
        with caplog.at_level(logging.INFO, logger="queued.server"):
            server.check_disk()
        assert [r for r in caplog.records if getattr(r, "event", None) == "disk_ok"]
        status, _, _ = await get(server.ports["http"], "/readyz")
        assert status == 200


async def test_low_disk_warning_and_recovery(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """min_free_disk above what the disk has: one warning at start, "back" when lowered."""
    huge = "1000TiB"
    with caplog.at_level(logging.INFO, logger="queued.server"):
        async with running(cfg(tmp_path, min_free_disk=huge)) as server:
            with trio.fail_after(WAIT):
                while not [r for r in caplog.records if getattr(r, "event", None) == "disk_low"]:
                    await trio.sleep(0.01)
            server.config = dataclasses.replace(server.config, min_free_disk=1)
            server.check_disk()
            assert [r for r in caplog.records if getattr(r, "event", None) == "disk_ok"]
            status, _, _ = await get(server.ports["http"], "/readyz")
            assert status == 200  # low space warns; only a full disk makes it unready
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="queued.server"):
        async with running(cfg(tmp_path, min_free_disk=0)) as server:
            server.check_disk()
    assert not [r for r in caplog.records if getattr(r, "event", None) == "disk_low"]


# -- logs -------------------------------------------------------------------------------------


def json_lines(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


@pytest.fixture
def proc_cleanup() -> Iterator[list[ServerProcess]]:
    procs: list[ServerProcess] = []
    yield procs
    for p in procs:
        p.kill()


def test_json_logs_with_recovery_events(tmp_path: Path,
                                        proc_cleanup: list[ServerProcess]) -> None:
    conf = tmp_path / "queued.toml"
    conf.write_text('[server]\nlog_format = "json"\n')
    log_path = tmp_path / "server.log"
    srv = ServerProcess(tmp_path / "data", log_path, config=conf)
    proc_cleanup.append(srv)
    srv.start()
    with socket.create_connection((HOST, srv.memcache), timeout=WAIT) as s:
        s.sendall(b"set jobs 0 0 5\r\nhello\r\n")
        assert s.recv(100) == b"STORED\r\n"
    srv.signal(9)  # SIGKILL: no clean close
    srv.wait()
    segment = next(p for p in (tmp_path / "data").iterdir() if p.name.startswith("jobs."))
    with segment.open("ab") as f:
        f.write(b"\x02\x00\x00garbage")  # a torn record at the tail
    srv.start()
    deadline = time.monotonic() + WAIT
    while (status := http_get(srv.http, "/readyz")[0]) != 200 and time.monotonic() < deadline:
        time.sleep(0.02)  # 503 while recovering
    srv.signal(15)
    assert srv.wait() == 0
    records = json_lines(srv.log())
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    events = {r.get("event"): r for r in records if "event" in r}
    cut = events["recovery_truncate"]
    assert cut["level"] == "WARNING" and cut["segment"] == segment.name
    assert cut["cut_bytes"] == len(b"\x02\x00\x00garbage")
    assert events["recovered"]["truncated_bytes"] == cut["cut_bytes"]
    assert events["ready"]["ports"]["http"] == srv.http
    assert events["starting"]["version"] == __version__
    assert status == 200
    assert records[-1]["message"] == "stopped cleanly"


def test_text_logs_and_a_sigterm_at_once(tmp_path: Path,
                                        proc_cleanup: list[ServerProcess]) -> None:
    """SIGTERM as soon as the listeners are up (recovery may still run): a clean stop."""
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log")
    proc_cleanup.append(srv)
    srv.start()
    srv.signal(15)
    assert srv.wait() == 0
    lines = srv.log().decode().splitlines()
    assert any(" INFO queued.server: ready: " in line for line in lines)
    assert lines[-1].endswith(" INFO queued.server: stopped cleanly")
