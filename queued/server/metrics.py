"""Prometheus metrics: the server's `statistics()` read at scrape time.

There is no second copy of the server's state. A scrape takes a `Snapshot` on
the event loop (plain numbers copied from the broker, the data dir and the
server's counters: about a millisecond per thousand readers), then builds and
formats the metric families from it in a worker thread with prometheus-client,
so a big exposition never stalls the queues.

Naming follows Prometheus: `queued_` prefix, `_total` counters, `_seconds`,
`_bytes`. Per-reader series carry `queue` and `reader` labels (`reader=""` is
the queue's own reader); at most `metrics_max_queues` readers get them (by name
order, so the set is stable between scrapes) and `queued_metrics_omitted_readers`
says how many did not. A scrape for a user who may not see everything (`scope`) holds
only the series of the queues it may see: no server-wide ones, which count every queue.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import platform
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from queued import __version__, build_kind
from queued.broker.broker import Broker
from queued.reader.dedup import DedupCounters
from queued.reader.producers import ProducerCounters
from queued.stats import HistogramSnapshot, ProtocolStats
from queued.storage.journal import JournalStats

if TYPE_CHECKING:  # (the listeners own the reactor; this module only reads it)
    from queued.server.reactor import Reactor

#: Bodies at least this big are gzipped when the scraper accepts it.
GZIP_MIN_BYTES = 1024


@dataclass(frozen=True, slots=True)
class DiskUsage:
    free: int  # bytes an unprivileged writer may still use
    total: int


def disk_usage(path: str | os.PathLike[str]) -> DiskUsage | None:
    """The file system under `path`; None if it cannot be read."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return DiskUsage(free=st.f_bavail * st.f_frsize, total=st.f_blocks * st.f_frsize)


@runtime_checkable
class ByteCounters(Protocol):
    @property
    def bytes_read(self) -> int: ...
    @property
    def bytes_written(self) -> int: ...


@runtime_checkable
class StatsSource(Protocol):
    """What a scrape reads from the running server, and nothing more.

    `queued.server.listeners.Server` satisfies it structurally: this module never
    imports the listeners (they import it), so the arrows point one way.
    """

    @property
    def broker(self) -> Broker: ...
    @property
    def protocols(self) -> Mapping[str, ProtocolStats]: ...
    @property
    def counters(self) -> ByteCounters: ...
    @property
    def reactor(self) -> Reactor | None: ...


@dataclass(frozen=True, slots=True)
class ReaderSample:
    queue: str
    reader: str
    fields: dict[str, int]  # Broker.reader_stats


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one scrape exports, copied on the event loop. `server_wide`: False for a
    scrape of some queues' series only (then the server's own figures are left out)."""

    ready: bool
    recovering: bool
    readers: tuple[ReaderSample, ...] = ()
    journals: tuple[JournalStats, ...] = ()
    omitted_readers: int = 0
    queues: int = 0
    parked: int = 0
    protocols: tuple[tuple[str, ProtocolStats], ...] = ()
    bytes_read: int = 0
    bytes_written: int = 0
    fsync: HistogramSnapshot | None = None
    put_latency: HistogramSnapshot | None = None
    get_latency: HistogramSnapshot | None = None
    pass_seconds: HistogramSnapshot | None = None  # the reactor's passes
    recovery_seconds: float = 0.0
    truncated_bytes: int = 0
    intent_appends: int = 0
    intent_settles: int = 0
    intents_replayed: int = 0
    disk: DiskUsage | None = None
    server_wide: bool = True
    #: exactly-once puts: producers remembered now (loaded queues), and what the tables did
    producers: int = 0
    producer_counters: ProducerCounters | None = None
    #: deduplication keys remembered now (loaded queues), and what the tables did
    dedup_keys: int = 0
    dedup_counters: DedupCounters | None = None


def take_snapshot(server: StatsSource | None, *, ready: bool, max_readers: int,
                  more: tuple[tuple[str, ProtocolStats], ...] = (),
                  scope: Callable[[str], bool] | None = None) -> Snapshot:
    """Copy the figures of `server` (None while the journals are being recovered);
    `more`: listeners the server does not own (the operations port's); `scope`: only the
    queues it accepts, and none of the server's own figures (None: everything)."""
    if scope is not None:
        if server is None:
            return Snapshot(ready=ready, recovering=True, server_wide=False)
        readers, journals, omitted = _queues(server.broker, max_readers, scope)
        return Snapshot(ready=ready, recovering=False, readers=readers, journals=journals,
                        omitted_readers=omitted, server_wide=False)
    extra = tuple((proto, dataclasses.replace(p, commands=dict(p.commands)))
                  for proto, p in more)
    if server is None:
        return Snapshot(ready=ready, recovering=True, protocols=extra)
    broker = server.broker
    readers, journals, omitted = _queues(broker, max_readers, None)
    dd = broker.datadir.statistics()
    return Snapshot(
        ready=ready,
        recovering=False,
        readers=readers,
        journals=journals,
        omitted_readers=omitted,
        queues=len(broker.queues) + len(broker.registry.parked),
        parked=len(broker.registry.parked),
        protocols=tuple(
            (proto, dataclasses.replace(p, commands=dict(p.commands)))
            for proto, p in server.protocols.items()
        ) + extra,
        bytes_read=server.counters.bytes_read,
        bytes_written=server.counters.bytes_written,
        fsync=dd.fsync,
        put_latency=broker.put_latency.snapshot(),
        get_latency=broker.get_latency.snapshot(),
        pass_seconds=None if server.reactor is None else server.reactor.pass_seconds.snapshot(),
        recovery_seconds=dd.recovery_seconds,
        truncated_bytes=dd.truncated_bytes,
        intent_appends=dd.intent_appends,
        intent_settles=dd.intent_settles,
        intents_replayed=dd.intents_replayed,
        disk=disk_usage(broker.datadir.path),
        producers=sum(len(qs.producers) for qs in broker.queues.values()
                      if qs.producers is not None),
        producer_counters=dataclasses.replace(broker.registry.producer_counters),
        dedup_keys=sum(len(qs.dedup) for qs in broker.queues.values() if qs.dedup is not None),
        dedup_counters=dataclasses.replace(broker.registry.dedup_counters),
    )


def _queues(broker: Broker, max_readers: int, scope: Callable[[str], bool] | None,
            ) -> tuple[tuple[ReaderSample, ...], tuple[JournalStats, ...], int]:
    """(readers, journals, readers omitted by the cap) of the queues `scope` accepts."""
    readers: list[ReaderSample] = []
    journals: list[JournalStats] = []
    omitted = 0
    for name in broker.queue_names():  # parked ones too, from their summaries
        if scope is not None and not scope(name):
            continue
        if len(readers) >= max_readers:
            omitted += broker.reader_count(name)
            continue
        fields, journal = broker.queue_view(name)
        for rname, f in fields:
            if len(readers) >= max_readers:
                omitted += 1
                continue
            readers.append(ReaderSample(name, rname, f))
        journals.append(journal)
    return tuple(readers), tuple(journals), omitted


# -- families ----------------------------------------------------------------------------

#: (metric, help, reader_stats field, scale) of the per-reader gauges and counters.
_READER_GAUGES = (
    ("queued_queue_items", "Items waiting (not open, not yet taken; delayed ones too).",
     "items", 1),
    ("queued_delayed_items", "Items put or aborted with a delay that are not due yet.",
     "delayed", 1),
    ("queued_queue_bytes", "Bytes of item data waiting.", "bytes", 1),
    ("queued_queue_memory_bytes", "Bytes of waiting item data held in memory.", "mem_bytes", 1),
    ("queued_queue_open_reads", "Reliable reads open (taken, not confirmed or aborted).",
     "open_transactions", 1),
    ("queued_queue_waiters", "Gets waiting for an item.", "waiters", 1),
    ("queued_queue_paused", "1 while the queue is paused (pause/resume): its gets wait.",
     "paused", 1),
    ("queued_queue_oldest_item_age_seconds",
     "Age of the oldest item waiting in memory (0 when none is).", "oldest_item_age_msec",
     0.001),
)
_READER_COUNTERS = (
    ("queued_queue_puts", "Items added to the queue since the server started.", "total_items"),
    ("queued_queue_gets", "Items handed to clients (plain gets and open reads).", "gets"),
    ("queued_queue_expired", "Items that expired before anyone took them.", "expired_items"),
    ("queued_queue_discarded", "Items dropped to make room (discard_old_when_full, "
     "max_journal_size).", "discarded"),
    ("queued_queue_aborted", "Open reads returned to the queue (abort, timeout, disconnect).",
     "canceled_transactions"),
    ("queued_queue_flushes", "Flushes of the queue.", "total_flushes"),
    ("queued_queue_rejected", "Open reads given up on (reject): sent to error_queue, or "
     "dropped.", "rejected"),
)


def _histogram(name: str, doc: str, h: HistogramSnapshot) -> HistogramMetricFamily:
    buckets = [(repr(float(b)), c) for b, c in zip(h.bounds, h.cumulative, strict=True)]
    buckets.append(("+Inf", h.count))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h.sum)


class SnapshotCollector(Collector):
    """The queued_* families of one Snapshot."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if not s.server_wide:
            yield from self._readers()
            yield from self._journals()
            return
        info = GaugeMetricFamily("queued_build_info",
                                 "Version and build (pure or mypyc) of the running server "
                                 "(always 1).", labels=["version", "python", "build"])
        info.add_metric([__version__, platform.python_version(), build_kind()], 1)
        yield info
        yield GaugeMetricFamily("queued_ready", "1 when /readyz answers 200.", value=int(s.ready))
        yield GaugeMetricFamily("queued_recovering", "1 while the journals are being recovered.",
                                value=int(s.recovering))
        if s.recovering:
            return
        yield from self._readers()
        yield from self._journals()
        yield from self._server()

    def _readers(self) -> Iterator[Metric]:
        s = self.snapshot
        labels = ["queue", "reader"]
        for name, doc, key, scale in _READER_GAUGES:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for r in s.readers:
                g.add_metric([r.queue, r.reader], r.fields[key] * scale)
            yield g
        for name, doc, key in _READER_COUNTERS:
            c = CounterMetricFamily(name, doc, labels=labels)
            for r in s.readers:
                c.add_metric([r.queue, r.reader], r.fields[key])
            yield c
        if not s.server_wide:
            return
        yield GaugeMetricFamily("queued_queues", "Queues (fanout readers not counted).",
                                value=s.queues)
        yield GaugeMetricFamily("queued_parked_queues",
                                "Queues parked on disk (idle for park_after; counted in "
                                "queued_queues).", value=s.parked)
        yield GaugeMetricFamily(
            "queued_metrics_omitted_readers",
            "Readers without per-queue series (over metrics_max_queues).",
            value=s.omitted_readers)

    def _journals(self) -> Iterator[Metric]:
        js = self.snapshot.journals
        per_queue: list[tuple[GaugeMetricFamily | CounterMetricFamily, str]] = [
            (GaugeMetricFamily("queued_journal_bytes", "Bytes of the queue's journal segments.",
                               labels=["queue"]), "bytes"),
            (GaugeMetricFamily("queued_journal_segments", "Journal segment files of the queue.",
                               labels=["queue"]), "segments"),
            (GaugeMetricFamily("queued_journal_failed",
                               "1 when the journal refuses writes after an I/O error.",
                               labels=["queue"]), "failed"),
            (CounterMetricFamily("queued_journal_fsyncs", "fsyncs of the queue's journal.",
                                 labels=["queue"]), "fsyncs"),
            (CounterMetricFamily("queued_journal_write_errors",
                                 "Failed journal writes (ENOSPC, EIO, ...).", labels=["queue"]),
             "write_errors"),
        ]
        for family, field in per_queue:
            for j in js:
                family.add_metric([j.queue], int(getattr(j, field)))
            yield family

    def _producers(self) -> Iterator[Metric]:
        s = self.snapshot
        yield GaugeMetricFamily("queued_producers", "Producers (exactly-once puts) the loaded "
                                "queues remember.", value=s.producers)
        pc = s.producer_counters or ProducerCounters()
        for name, doc, value in (
                ("queued_producer_evictions", "Producers forgotten for max_producers (least "
                 "recently used first); their puts fall back to at-least-once.", pc.evicted),
                ("queued_producer_expiries", "Producers forgotten after producer_expiry "
                 "without a put.", pc.expired),
                ("queued_producer_duplicates", "Puts answered as repeats of a stored put "
                 "(nothing stored).", pc.duplicates),
                ("queued_producer_gaps", "Puts refused because their sequence skipped "
                 "ahead (PRODUCER_GAP).", pc.gaps)):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("queued_dedup_keys", "Deduplication keys the loaded queues "
                                "remember (within dedup_window).", value=s.dedup_keys)
        dc = s.dedup_counters or DedupCounters()
        for name, doc, value in (
                ("queued_dedup_evictions", "Deduplication keys forgotten within their window "
                 "for max_dedup_keys (oldest first); a re-send is then stored again.",
                 dc.evicted),
                ("queued_dedup_expiries", "Deduplication keys forgotten once dedup_window "
                 "passed.", dc.expired),
                ("queued_dedup_duplicates", "Puts whose key was seen within the window "
                 "(answered as stored, nothing stored).", dc.duplicates)):
            yield CounterMetricFamily(name, doc, value=value)

    def _server(self) -> Iterator[Metric]:
        s = self.snapshot
        yield from self._producers()
        proto = ["protocol"]
        # Not "queued_connections": that is the counter's family name (OpenMetrics).
        conns = GaugeMetricFamily("queued_open_connections", "Open client connections.",
                                  labels=proto)
        total = CounterMetricFamily("queued_connections", "Client connections accepted.",
                                    labels=proto)
        refused = CounterMetricFamily("queued_connections_refused",
                                      "Connections refused at max_connections.", labels=proto)
        errors = CounterMetricFamily("queued_protocol_errors",
                                     "Malformed or refused requests.", labels=proto)
        commands = CounterMetricFamily("queued_commands", "Commands run.",
                                       labels=["protocol", "command"])
        auth = CounterMetricFamily(
            "queued_auth_failures", "Failed authentications: wrong credentials, a command "
            "before authenticating, or none in time (auth_timeout).", labels=proto)
        denied = CounterMetricFamily("queued_permission_denied",
                                     "Commands refused for a missing permission.", labels=proto)
        timeouts = CounterMetricFamily(
            "queued_request_timeouts", "Connections closed because a request that had begun "
            "to arrive was not complete within request_timeout.", labels=proto)
        handshakes = CounterMetricFamily("queued_tls_handshake_failures",
                                         "TLS handshakes that failed or stalled.", labels=proto)
        for name, p in s.protocols:
            conns.add_metric([name], p.connections)
            total.add_metric([name], p.total_connections)
            refused.add_metric([name], p.refused_connections)
            errors.add_metric([name], p.protocol_errors)
            for command, n in sorted(p.commands.items()):
                commands.add_metric([name, command], n)
            auth.add_metric([name], p.auth_failures)
            denied.add_metric([name], p.permission_denied)
            timeouts.add_metric([name], p.request_timeouts)
            handshakes.add_metric([name], p.tls_handshake_failures)
        yield from (conns, total, refused, errors, commands, auth, denied, timeouts, handshakes)
        yield CounterMetricFamily("queued_bytes_read", "Bytes received from clients.",
                                  value=s.bytes_read)
        yield CounterMetricFamily("queued_bytes_written", "Bytes sent to clients.",
                                  value=s.bytes_written)
        if s.fsync is not None:
            yield _histogram("queued_fsync_duration_seconds",
                             "Time of each journal fsync.", s.fsync)
        if s.put_latency is not None:
            yield _histogram("queued_put_latency_seconds",
                             "From a put's arrival to its items being durable, per put "
                             "request (a batch counts once).", s.put_latency)
        if s.get_latency is not None:
            yield _histogram("queued_get_latency_seconds",
                             "From a get's arrival to its answer, for gets that did not wait "
                             "for an item to arrive (long polls are not counted).",
                             s.get_latency)
        if s.pass_seconds is not None:
            yield _histogram("queued_reactor_pass_seconds",
                             "Time each pass of the reactor that ran requests took, from its "
                             "reads to its sends: the connections it did not serve waited "
                             "that long.", s.pass_seconds)
        yield GaugeMetricFamily("queued_recovery_duration_seconds",
                                "Time the startup recovery took.", value=s.recovery_seconds)
        yield GaugeMetricFamily("queued_recovery_truncated_bytes",
                                "Bytes the startup recovery cut from torn journal tails.",
                                value=s.truncated_bytes)
        yield GaugeMetricFamily("queued_recovery_intents_replayed",
                                "Intent log records the startup wrote back into their "
                                "segments (after a crash).", value=s.intents_replayed)
        yield CounterMetricFamily("queued_intent_log_appends",
                                  "Passes under fsync always (over many queues, or small) "
                                  "made durable by one fdatasync of the intent log.",
                                  value=s.intent_appends)
        yield CounterMetricFamily("queued_intent_log_settles",
                                  "Times the intent log was emptied (a syncfs) before a "
                                  "segment was removed or replaced, or once it was large.",
                                  value=s.intent_settles)
        if s.disk is not None:
            yield GaugeMetricFamily("queued_disk_free_bytes",
                                    "Free bytes on the data directory's file system.",
                                    value=s.disk.free)
            yield GaugeMetricFamily("queued_disk_total_bytes",
                                    "Size of the data directory's file system.",
                                    value=s.disk.total)


_PROCESS = ProcessCollector(registry=None)
_PLATFORM = PlatformCollector(registry=None)


def render(snapshot: Snapshot, accept: str = "", accept_encoding: str = "",
           ) -> tuple[bytes, list[tuple[str, str]]]:
    """The exposition of `snapshot` plus the process metrics: (body, headers).

    Content negotiation as prometheus-client does it (OpenMetrics when asked for);
    gzip when the scraper accepts it. Safe in a worker thread: it only reads the
    snapshot and /proc. The process metrics are the server's: only in a server-wide one.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    if snapshot.server_wide:
        registry.register(_PROCESS)
        registry.register(_PLATFORM)
    encoder, content_type = choose_encoder(accept)
    body: bytes = encoder(registry)
    headers = [("Content-Type", content_type)]
    if len(body) >= GZIP_MIN_BYTES and _accepts_gzip(accept_encoding):
        body = gzip.compress(body, compresslevel=1)
        headers.append(("Content-Encoding", "gzip"))
    headers.append(("Vary", "Accept, Accept-Encoding"))
    return body, headers


def _accepts_gzip(accept_encoding: str) -> bool:
    """Whether an Accept-Encoding header admits gzip (a q of 0 refuses it)."""
    for part in accept_encoding.split(","):
        coding, *params = (p.strip() for p in part.split(";"))
        if coding.lower() != "gzip":
            continue
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    return float(value) > 0
                except ValueError:
                    return False
        return True
    return False
