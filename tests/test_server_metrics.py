"""queued.server.metrics: snapshots of a real server, their exposition, the reader cap.

`take_snapshot` reads a real in-process server (free 127.0.0.1 ports) after real puts
and gets over memcache; `render`'s output is read back with prometheus-client's own
parsers, text and the strict OpenMetrics one, as Prometheus would read it. The scrape
tests further down go through /metrics, with all three protocols feeding the figures.
"""

from __future__ import annotations

import gzip
import math
import platform
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
from ops_util import NONE, Samples, cfg, get, lab, put, q, samples, scrape
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text
from server_util import HOST, WAIT, Conn, running
from wait_util import wait_for

from queued import __version__, build_kind
from queued.server import metrics as qmetrics
from queued.server.listeners import Server
from queued.server.metrics import Snapshot, disk_usage, render, take_snapshot
from queued.stats import FSYNC_BUCKETS, LATENCY_BUCKETS, Histogram

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


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


def rendered(snapshot: Snapshot) -> Samples:
    body, _ = render(snapshot)
    return samples(body.decode())


def queued_only(m: Samples) -> Samples:
    return {k: v for k, v in m.items() if k[0].startswith("queued_")}


# -- take_snapshot and render ------------------------------------------------------------------


async def test_a_snapshot_copies_the_servers_figures(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        await put(server, "jobs", b"a", b"bc", b"def")
        conn = await Conn.open(server.ports["memcache"])
        try:
            assert await conn.get("jobs") == b"a"
            assert await conn.get("jobs/open") == b"bc"  # stays an open read
            snap = take_snapshot(server, ready=True, max_readers=10)
        finally:
            await conn.aclose()
        assert (snap.ready, snap.recovering, snap.queues, snap.omitted_readers) == (
            True, False, 1, 0)
        [reader] = snap.readers
        assert (reader.queue, reader.reader) == ("jobs", "")
        fields = reader.fields
        assert (fields["items"], fields["bytes"], fields["open_transactions"],
                fields["total_items"], fields["gets"]) == (1, 3, 1, 3, 2)
        [journal] = snap.journals
        assert (journal.queue, journal.segments, journal.failed) == ("jobs", 1, False)
        protocols = dict(snap.protocols)
        assert set(protocols) == {"memcache", "text", "rpc"}
        assert protocols["memcache"].commands == {"set": 3, "get": 2}
        assert protocols["memcache"].total_connections == 2
        assert snap.bytes_read == server.counters.bytes_read > 0
        assert snap.bytes_written == server.counters.bytes_written > 0
        assert snap.put_latency is not None and snap.put_latency.count == 3
        assert snap.get_latency is not None and snap.get_latency.count == 2
        assert snap.fsync is not None and snap.fsync.count >= 1
        assert snap.pass_seconds is not None and snap.pass_seconds.count >= 2  # the gets'
        assert snap.disk is not None and snap.disk.total > 0
        # A copy: what the server does afterwards does not reach it.
        await put(server, "jobs", b"later")
        assert fields["items"] == 1 and snap.put_latency.count == 3
        assert protocols["memcache"].commands["set"] == 3
        assert rendered(snap)[("queued_queue_items", q("jobs"))] == 1
        # The open read went back when its connection closed: 1 + 1 + "later".
        assert take_snapshot(server, ready=True, max_readers=10).readers[0].fields["items"] == 3


async def test_a_snapshot_renders_its_figures_in_both_formats(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        await put(server, "jobs", b"one", b"two")
        assert await mc(server, b"get jobs") == [b"VALUE jobs 0 3"]
        snap = take_snapshot(server, ready=False, max_readers=10)
    text_body, text_headers = render(snap)
    assert dict(text_headers)["Content-Type"].startswith("text/plain; version=0.0.4")
    m = samples(text_body.decode())
    assert m[("queued_queue_items", q("jobs"))] == 1
    assert m[("queued_queue_bytes", q("jobs"))] == 3
    assert m[("queued_queue_puts_total", q("jobs"))] == 2
    assert m[("queued_queue_gets_total", q("jobs"))] == 1
    assert m[("queued_ready", NONE)] == 0  # as take_snapshot was told
    assert m[("queued_recovering", NONE)] == 0
    assert m[("queued_commands_total", lab(protocol="memcache", command="set"))] == 2
    assert m[("queued_put_latency_seconds_count", NONE)] == 2
    assert m[("queued_build_info", lab(version=__version__, python=platform.python_version(),
                                       build=build_kind()))] == 1
    types = {f.name: f.type for f in parse_text(text_body.decode())}
    assert types["queued_queue_items"] == "gauge"
    assert types["queued_queue_puts"] == "counter"
    assert types["queued_journal_fsyncs"] == "counter"
    assert types["queued_fsync_duration_seconds"] == "histogram"
    assert types["queued_reactor_pass_seconds"] == "histogram"
    assert m[("queued_reactor_pass_seconds_count", NONE)] >= 1  # the get's pass
    # OpenMetrics, read by the strict parser: the same queued_* samples.
    om_body, om_headers = render(snap, OPENMETRICS)
    assert dict(om_headers)["Content-Type"].startswith("application/openmetrics-text")
    om: Samples = {}
    for family in parse_openmetrics(om_body.decode()):
        assert family.documentation, family.name
        for s in family.samples:
            om[(s.name, frozenset(s.labels.items()))] = s.value
    assert queued_only(om) == queued_only(m)


async def test_the_reader_cap_keeps_the_first_readers_by_name(tmp_path: Path) -> None:
    """Stable between scrapes: by (queue, reader) name, whatever the creation order;
    a queue with any exported reader keeps its journal series."""
    async with running(cfg(tmp_path)) as server:
        assert await mc(server, b"get b+y", b"get b+x") == [b"END", b"END"]  # fanout only
        for name in ("c", "b", "a"):
            await put(server, name, b"item")
        everyone = [("a", ""), ("b", "x"), ("b", "y"), ("c", "")]
        for cap in (0, 1, 2, 3, 4, 100):
            snap = take_snapshot(server, ready=True, max_readers=cap)
            kept = [(r.queue, r.reader) for r in snap.readers]
            assert kept == everyone[:cap], cap
            assert [j.queue for j in snap.journals] == sorted({name for name, _ in kept})
            assert snap.omitted_readers == len(everyone) - len(kept)
            assert snap.queues == 3
            m = rendered(snap)
            assert {dict(labels)["queue"] for name, labels in m
                    if name == "queued_queue_items"} == {name for name, _ in kept}
            assert m[("queued_metrics_omitted_readers", NONE)] == snap.omitted_readers


def test_histogram_buckets_are_cumulative_up_to_inf() -> None:
    h = Histogram((0.001, 0.01, 0.1))
    for seconds in (0.0005, 0.001, 0.05, 5.0):  # a bound itself counts in its bucket
        h.observe(seconds)
    snap = Snapshot(ready=True, recovering=False, put_latency=h.snapshot())
    for body in (render(snap)[0], render(snap, OPENMETRICS)[0]):
        parse = parse_openmetrics if body.endswith(b"# EOF\n") else parse_text
        [family] = [f for f in parse(body.decode()) if f.name == "queued_put_latency_seconds"]
        assert family.type == "histogram"
        got = {(s.name, s.labels.get("le")): s.value for s in family.samples}
        assert got == {
            ("queued_put_latency_seconds_bucket", "0.001"): 2,
            ("queued_put_latency_seconds_bucket", "0.01"): 2,
            ("queued_put_latency_seconds_bucket", "0.1"): 3,
            ("queued_put_latency_seconds_bucket", "+Inf"): 4,
            ("queued_put_latency_seconds_count", None): 4,
            ("queued_put_latency_seconds_sum", None): pytest.approx(5.0515),
        }
    # A histogram the snapshot does not have is not exported at all.
    assert not [name for name, _ in rendered(snap) if name.startswith(
        ("queued_get_latency", "queued_fsync_duration"))]


async def test_the_servers_histograms_have_their_bounds(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        await put(server, "jobs", b"a", b"b")
        assert await mc(server, b"get jobs") == [b"VALUE jobs 0 1"]
        m = rendered(take_snapshot(server, ready=True, max_readers=10))
    for family, bounds in (("queued_put_latency_seconds", LATENCY_BUCKETS),
                           ("queued_get_latency_seconds", LATENCY_BUCKETS),
                           ("queued_fsync_duration_seconds", FSYNC_BUCKETS)):
        buckets = sorted((float(dict(labels)["le"]), v) for (name, labels), v in m.items()
                         if name == family + "_bucket")
        assert [le for le, _ in buckets] == [*bounds, math.inf]
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and counts[-1] == m[(family + "_count", NONE)] > 0


def test_while_recovering_only_the_state_is_exported() -> None:
    snap = take_snapshot(None, ready=False, max_readers=100)
    assert snap == Snapshot(ready=False, recovering=True)
    m = rendered(snap)
    assert {name for name, _ in queued_only(m)} == {
        "queued_build_info", "queued_ready", "queued_recovering"}
    assert (m[("queued_recovering", NONE)], m[("queued_ready", NONE)]) == (1, 0)
    assert m[("process_resident_memory_bytes", NONE)] > 0


@pytest.mark.parametrize(("accept_encoding", "gzipped"), [
    ("gzip", True),
    ("GZip", True),
    ("deflate, gzip;q=0.5", True),
    ("br;q=1.0, gzip ; q=1", True),
    ("gzip;q=0", False),
    ("gzip; q=0.000", False),
    ("gzip;q=nonsense", False),
    ("x-gzip", False),
    ("deflate", False),
    ("", False),
])
def test_gzip_only_when_the_scraper_accepts_it(accept_encoding: str, gzipped: bool) -> None:
    body, headers = render(Snapshot(ready=True, recovering=True), "", accept_encoding)
    assert (("Content-Encoding", "gzip") in headers) is gzipped
    assert ("Vary", "Accept, Accept-Encoding") in headers
    text = gzip.decompress(body) if gzipped else body
    assert len(text) >= qmetrics.GZIP_MIN_BYTES
    assert text.startswith(b"# HELP queued_build_info ")


def test_a_small_exposition_is_not_gzipped(monkeypatch: pytest.MonkeyPatch) -> None:
    snap = Snapshot(ready=True, recovering=True)
    size = len(render(snap)[0])
    monkeypatch.setattr(qmetrics, "GZIP_MIN_BYTES", size * 2)
    body, headers = render(snap, "", "gzip")
    assert ("Content-Encoding", "gzip") not in headers
    assert body.startswith(b"# HELP queued_build_info ")


def test_disk_usage_of_a_directory_and_of_a_missing_one(tmp_path: Path) -> None:
    usage = disk_usage(tmp_path)
    assert usage is not None and 0 <= usage.free <= usage.total and usage.total > 0
    assert disk_usage(tmp_path / "missing") is None


def test_disk_usage_of_a_known_file_system(tmpfs: Path) -> None:
    usage = disk_usage(tmpfs)
    assert usage is not None and usage.total == 2 * 1024 * 1024
    assert usage.free == usage.total  # nothing written yet


# -- scraped over /metrics -------------------------------------------------------------------


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
        # (a server of `make test-compiled` runs the compiled build, as this process does)
        assert m[("queued_build_info", lab(version=__version__,
                                           python=platform.python_version(),
                                           build=build_kind()))] == 1
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
        await wait_for(lambda: scrape(server),
                       lambda m: not m[("queued_open_connections", lab(protocol="rpc"))])
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
        assert m[("queued_recovery_intents_replayed", NONE)] == 0
        # (one queue per pass here, each pass small: the log makes each durable)
        assert m[("queued_intent_log_appends_total", NONE)] >= 1
        assert m[("queued_intent_log_settles_total", NONE)] == 0
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

