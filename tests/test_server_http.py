"""The operations port over real HTTP: /livez, /readyz, /stats.json, and how it treats
methods, malformed requests, stalls and crowds (/metrics' content: test_server_metrics.py).

Requests go through the standard library's http.client (in a worker thread) or a
raw socket for malformed input. Each test runs its own server on free 127.0.0.1 ports.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from disk_util import fill_completely
from ops_util import NONE, cfg, get, lab, put, q, raw, samples, scrape
from server_util import HOST, WAIT, Conn, ServerProcess, http_get, make_config, running
from wait_util import wait_for, wait_until, wait_until_blocking

from queued import __version__
from queued.server import http as qhttp
from queued.server.http import Ops, OpsServer, serve_http
from queued.server.metrics import ByteCounters, StatsSource

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
            # refused once the server has taken the three in (a request before that is served)
            await wait_for(lambda: raw(port, b"GET /livez HTTP/1.1\r\nHost: x\r\n"
                                             b"Connection: close\r\n\r\n"),
                           lambda reply: reply == qhttp.TOO_MANY_REPLY)
        finally:
            for s in held:
                await s.aclose()
        await wait_for(lambda: raw(port, b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close"
                                         b"\r\n\r\n"),
                       lambda reply: reply != qhttp.TOO_MANY_REPLY)


# -- refused requests: a HEAD as a GET, without the body ------------------------------------


def parse_replies(data: bytes, methods: list[bytes],
                  ) -> list[tuple[bytes, dict[bytes, bytes], bytes]]:
    """Raw replies, one per request method: (status line, headers, body). A HEAD's
    reply has no body, so any bytes of one are left over and fail the test."""
    out = []
    for method in methods:
        head, sep, data = data.partition(b"\r\n\r\n")
        assert sep, f"an incomplete reply: {head[:200]!r}"
        status, *lines = head.split(b"\r\n")
        headers = {k.strip().lower(): v.strip()
                   for k, _, v in (line.partition(b":") for line in lines)}
        n = 0 if method == b"HEAD" else int(headers[b"content-length"])
        out.append((status, headers, data[:n]))
        data = data[n:]
    assert data == b"", f"bytes after the last reply: {data[:200]!r}"
    return out


_START = b"METHOD /livez HTTP/1.1\r\nHost: x\r\n"
_BIG_HEADER = b"X-Big: " + b"a" * 20_000 + b"\r\n"
_BIG_BODY = b"x" * (qhttp.MAX_BODY_BYTES + 1)
#: id: (request, with METHOD for its method; EOF after it; the reply's status)
REFUSED = {
    "body-cut-short-by-eof": (_START + b"Content-Length: 10\r\n\r\n", True, 400),
    "a-20000-byte-header-line": (_START + _BIG_HEADER + b"\r\n", False, 431),
    "headers-over-the-cap-unfinished": (_START + _BIG_HEADER, False, 431),
    "an-illegal-header-line": (_START + b"Bad Header: 1\r\n\r\n", False, 400),
    "a-body-over-the-cap": (_START + b"Content-Length: %d\r\n\r\n" % len(_BIG_BODY)
                            + _BIG_BODY, False, 413),
}


@pytest.mark.parametrize("after_a_get", [False, True], ids=["first", "pipelined"])
@pytest.mark.parametrize(("request_", "eof", "status"), REFUSED.values(), ids=REFUSED.keys())
async def test_a_refused_head_gets_the_status_of_a_get_without_a_body_then_a_close(
        tmp_path: Path, request_: bytes, eof: bool, status: int, after_a_get: bool) -> None:
    """D2: h11 refuses to send a body after a HEAD, and the reply was lost with it."""
    async with running(cfg(tmp_path)) as server:
        port = server.ports["http"]
        for method in (b"GET", b"HEAD"):
            data, methods = request_.replace(b"METHOD", method), [method]
            if after_a_get:  # the refused request's start arrives with the one before
                data, methods = b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n" + data, [b"GET", method]
            # raw() returns once the server has closed the connection.
            replies = parse_replies(await raw(port, data, eof=eof), methods)
            if after_a_get:
                assert replies[0][0] == b"HTTP/1.1 200 OK" and replies[0][2] == b"ok\n"
            line, headers, body = replies[-1]
            assert line.startswith(b"HTTP/1.1 %d " % status), (method, line)
            assert headers[b"connection"] == b"close"
            assert int(headers[b"content-length"]) > 0  # what a GET's body is
            if method == b"GET":
                assert body.endswith(b"\n")


# -- the server, as the operations port sees it ----------------------------------------------




async def test_a_running_server_has_what_the_ops_port_reads(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        assert isinstance(server, OpsServer) and isinstance(server, StatsSource)
        assert isinstance(server.counters, ByteCounters)


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
            await wait_until(lambda: any(getattr(r, "event", None) == "disk_low"
                                         for r in caplog.records))
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
    wait_until_blocking(lambda: http_get(srv.http, "/readyz")[0] == 200)  # 503 while recovering
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
