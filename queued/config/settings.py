"""The settings: what a server and each of its queues run with, as frozen dataclasses.

Owns the defaults and the per-queue inheritance default -> [queues.q] ->
[queues."q+reader"], and turns a queue's settings into the storage policies it
needs. Reads nothing: loading.py builds these from the file, environment and flags.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from queued.config.policies import (
    CorruptionPolicy,
    DataDirConfig,
    FsyncPolicy,
    FullPolicy,
    JournalConfig,
    MiB,
)


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """Kestrel's per-queue settings, snake_case. 0 / None mean "no limit" / "off"."""

    max_items: int = 0
    max_size: int = 0  # bytes of item data
    max_item_size: int = 0  # bytes; 0 = only the server-wide protocol cap applies
    max_age: int = 0  # ms; items expire at most this long after being put
    discard_old_when_full: bool = False
    max_memory_size: int = 128 * MiB  # item data kept in memory; the rest is read behind
    journal_size: int = 16 * MiB
    max_journal_size: int = 0
    journal_full_policy: FullPolicy = FullPolicy.REFUSE
    fsync: FsyncPolicy = field(default_factory=FsyncPolicy)
    expire_to_queue: str | None = None
    max_expire_sweep: int = 0  # 0 = unlimited per sweep
    max_queue_age: int = 0  # ms; an empty queue older than this is deleted
    open_transaction_timeout: int = 0  # ms; an open read not closed in time is aborted
    error_queue: str | None = None
    max_errors: int = 0  # aborts before an item moves to error_queue; 0 = never
    max_producers: int = 10_000  # producers (exactly-once puts) remembered, LRU beyond
    producer_expiry: int = 7 * 24 * 3600 * 1000  # ms; a producer unused this long is forgotten
    dedup_window: int = 5 * 60 * 1000  # ms a put's deduplication key is remembered
    max_dedup_keys: int = 100_000  # deduplication keys remembered, oldest first out beyond
    #: ms an aborted or timed-out read waits before it is delivered again: the n-th
    #: return waits step n (the last step for every later one); () = back at once
    retry_backoff: tuple[int, ...] = ()

    def backoff_ms(self, error_count: int) -> int:
        """How long an item returned with `error_count` errors (>= 1) waits first."""
        steps = self.retry_backoff
        if not steps or error_count <= 0:
            return 0
        return steps[min(error_count, len(steps)) - 1]

    def journal_config(self) -> JournalConfig:
        """The storage policies of these settings: one object for equal settings (every
        queue without a section of its own has the same)."""
        return _journal_config(self.journal_size, self.max_journal_size,
                               self.journal_full_policy, self.fsync)


@functools.lru_cache(maxsize=256)
def _journal_config(journal_size: int, max_journal_size: int, full_policy: FullPolicy,
                    fsync: FsyncPolicy) -> JournalConfig:
    return JournalConfig(journal_size=journal_size, max_journal_size=max_journal_size,
                         full_policy=full_policy, fsync=fsync)


_T = TypeVar("_T")


def override(obj: _T, changes: Mapping[str, object]) -> _T:
    """dataclasses.replace with changes whose types the key tables already checked."""
    if not changes:
        return obj  # frozen: shared (a server may hold 10,000 queues of the default)
    typed: dict[str, Any] = dict(changes)
    return dataclasses.replace(obj, **typed)  # type: ignore[type-var]


def no_queue_sections() -> Mapping[str, Mapping[str, object]]:
    """An empty, read-only map of [queues.<name>] overrides."""
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class ServerConfig:
    data_dir: Path = Path("data")
    host: str = "127.0.0.1"
    memcache_port: int = 22133
    text_port: int = 2222
    rpc_port: int = 2229
    http_port: int = 2223
    checkpoint_interval: int = 1000  # ms
    expiration_timer: int = 1000  # ms; the background expiry sweep period
    max_open_reads: int = 1000  # per connection, all queues together
    max_connections: int = 10000
    max_item_size: int = 16 * MiB  # protocol cap: a bigger declared item is refused unread
    max_line: int = 2048
    rpc_max_frame: int = 64 * MiB  # one MessagePack-RPC request or reply, bytes
    rpc_max_batch: int = 100_000  # items of a put, ids of a confirm, max_items of a get
    corruption: CorruptionPolicy = CorruptionPolicy.REFUSE
    archive_dir: Path | None = None
    log_level: str = "INFO"
    log_format: str = "text"  # "json": one JSON object per line
    shutdown_grace: int = 5000  # ms sessions get to finish their batch on shutdown
    metrics_max_queues: int = 1000  # readers with their own /metrics series; 0 = none
    min_free_disk: int = 1 << 30  # bytes; below this the server warns; 0 = never
    #: TLS on every listener when both are set (PEM files; re-read on reload / SIGHUP)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # set: client certificates required and verified
    users_file: Path | None = None  # set: every connection authenticates first
    allow_anonymous: bool = False  # listen beyond loopback without a users file
    request_timeout: int = 30_000  # ms a request that has begun to arrive may take
    auth_timeout: int = 10_000  # ms to finish the TLS handshake and authenticate
    max_queues: int = 10_000  # queues and fanout readers; creating more is refused
    park_after: int = 30_000  # ms unused before a small idle queue is parked; 0 = never
    config_file: Path | None = None
    default: QueueConfig = QueueConfig()
    #: Validated, typed overrides per [queues.<name>] section ("jobs", "jobs+audit").
    queues: Mapping[str, Mapping[str, object]] = field(default_factory=no_queue_sections)
    #: fsync given by QUEUED_FSYNC / --fsync: already in `default`, re-applied on reload.
    fsync_override: FsyncPolicy | None = None

    def queue_config(self, queue: str) -> QueueConfig:
        """`default`, then the [queues.<queue>] overrides; "q+r" means reader_config(q, r)."""
        name, plus, reader = queue.partition("+")
        if plus:
            return self.reader_config(name, reader)
        return override(self.default, self.queues.get(queue, {}))

    def reader_config(self, queue: str, reader: str) -> QueueConfig:
        """queue_config(queue), then the [queues."<queue>+<reader>"] overrides."""
        base = self.queue_config(queue)
        if not reader:
            return base
        return override(base, self.queues.get(f"{queue}+{reader}", {}))

    def data_dir_config(self) -> DataDirConfig:
        return DataDirConfig(corruption=self.corruption, archive_dir=self.archive_dir)
