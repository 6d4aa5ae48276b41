"""Exactly-once puts of the `queued` sink: producer ids a write task derives from what it
writes, so that writing it again (a retried task, a micro-batch run again after a restart,
a batch job run again with the same `idempotency_key`) meets the first run's puts and
stores nothing twice.

Owns the run key (a streaming query's id and micro-batch id, which Spark hands every task as
local properties, or the idempotency key; and the task's partition), the producer ids of a
chunk of rows, the puts each chunk is, and telling a re-run that repeats the first run's
rows from one that does not. Never fails a put over to another server (that server would
store it again): `Client.put_sequenced` sends each producer to the server its id hashes to.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from queued.spark.options import QueuedDataSourceError
from queued.spark.partition_write import RowHeaders

if TYPE_CHECKING:
    from queued.client import Client, PutAnswer

log = logging.getLogger("queued.spark")

#: Bytes of a derived producer id (the server takes 1 to 64).
PRODUCER_BYTES = 16
#: The local properties Spark sets on every task of a streaming query's micro-batch.
QUERY_ID_PROPERTY = "sql.streaming.queryId"
BATCH_ID_PROPERTY = "streaming.sql.batchId"


def _h(*parts: bytes) -> bytes:
    """A producer id from parts (each length-prefixed, so no two lists of parts meet)."""
    h = hashlib.blake2b(digest_size=PRODUCER_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


@dataclass(frozen=True, slots=True)
class RunKey:
    """What names one run of a write, and is the same when it runs again: `name` (a
    streaming query's id and micro-batch id, or a batch job's idempotency key) and the
    task's partition."""

    name: bytes
    partition: int

    @classmethod
    def for_stream(cls, query_id: str, batch_id: str, partition: int) -> RunKey:
        return cls(b"stream\0%s\0%s" % (query_id.encode(), batch_id.encode()), partition)

    @classmethod
    def for_job(cls, idempotency_key: str, partition: int) -> RunKey:
        return cls(b"job\0" + idempotency_key.encode(), partition)

    def group(self, queue: str, delay_ms: int) -> bytes:
        """The seed of the producer ids of one (queue, delay) group of this task's rows."""
        return _h(self.name, b"%d" % self.partition, queue.encode(), b"%d" % delay_ms)


def task_run_key(stream: bool, idempotency_key: str | None) -> RunKey:
    """The run key of the write task this runs in (from PySpark's TaskContext)."""
    from pyspark import TaskContext

    tc = TaskContext.get()
    if tc is None:
        raise QueuedDataSourceError("the queued sink's exactly-once puts run in a Spark task")
    if not stream:
        assert idempotency_key is not None
        return RunKey.for_job(idempotency_key, tc.partitionId())
    query, batch = tc.getLocalProperty(QUERY_ID_PROPERTY), tc.getLocalProperty(BATCH_ID_PROPERTY)
    if not query or batch is None:
        raise QueuedDataSourceError(
            "the queued sink cannot see the micro-batch's query and batch ids (task local "
            f"properties {QUERY_ID_PROPERTY}, {BATCH_ID_PROPERTY}); a continuous trigger? Set "
            '.option("exactly_once", "false") for at-least-once puts')
    return RunKey.for_stream(query, batch, tc.partitionId())


def chunk_digest(items: list[bytes], headers: list[RowHeaders] | None = None) -> bytes:
    """What a chunk's rows are, in order: a SHA-256 of the SHA-256s of their lengths (u32
    each) and of their bytes, then of each row's headers if any row has some. The same as
    `arrow_digest` of the same rows."""
    lengths = hashlib.sha256(
        np.fromiter(map(len, items), dtype="<u4", count=len(items)).tobytes())
    return _digest(lengths, hashlib.sha256(b"".join(items)), headers)


def arrow_digest(parts: list[pa.Array], headers: list[RowHeaders] | None = None) -> bytes:
    """`chunk_digest` of the rows of binary arrays, read from their buffers (no copy)."""
    lengths, values = hashlib.sha256(), hashlib.sha256()
    for part in parts:
        if not len(part):
            continue
        wide = pa.types.is_large_binary(part.type)
        offsets = np.frombuffer(part.buffers()[1], dtype=np.int64 if wide else np.int32)
        offsets = offsets[part.offset:part.offset + len(part) + 1]
        lengths.update(np.diff(offsets).astype("<u4").tobytes())
        data = part.buffers()[2]
        if data is not None and offsets[-1] > offsets[0]:
            with memoryview(data) as view:
                values.update(view[int(offsets[0]):int(offsets[-1])])
    return _digest(lengths, values, headers)


def _digest(lengths: Any, values: Any, headers: list[RowHeaders] | None) -> bytes:
    h = hashlib.sha256(lengths.digest() + values.digest())
    if headers:
        for row in headers:
            h.update(b"%d;" % len(row or {}))
            for key, value in sorted((row or {}).items()):
                raw = value if isinstance(value, bytes) else value.encode()
                h.update(b"%d:%s%c%d:" % (len(key.encode()), key.encode(),
                                          98 if isinstance(value, bytes) else 115, len(raw)))
                h.update(raw)
    return h.digest()


def content_id(group: bytes, number: int, items: list[bytes],
               headers: list[RowHeaders] | None = None, digest: bytes | None = None) -> bytes:
    """The producer id of chunk `number` of a group, holding `items` (with `headers`;
    `digest`: their `chunk_digest`, when known)."""
    return _h(b"rows", group, b"%d" % number, digest or chunk_digest(items, headers))


def position_id(group: bytes, number: int) -> bytes:
    """The producer id of the last row of chunk `number` of a group, whatever it holds."""
    return _h(b"last", group, b"%d" % number)


class ExactlyOnceSender:
    """Puts chunks of one task's rows so that each is stored once however often the task
    runs. Chunk `number` of a (queue, delay) group is put under a producer id of (run key,
    group, number, the chunk's digest), with sequence 1 (a producer the server does not
    know starts at 1): a run that repeats these rows meets the first run's put (a repeat:
    nothing stored); one with other rows here gets another id, and its rows are stored
    (never lost).

    The first chunk of a group is two puts, to tell a re-run that differs: its rows but
    the last under that id, then its last row under an id of (run key, group, number)
    alone. A repeat of the second while the first was new means an earlier run completed
    this chunk with other rows (a shuffle's other order, say): the last row is put once
    more under an id of its own (it was not stored), and `diverged` counts the chunk. (A
    first run that stopped between the two puts is not counted: nothing is stored twice.)
    Only the first chunk: a second put of its own per chunk costs the server a write and
    an fsync each (0.8x the rows/s measured), and a re-run in another order differs in its
    first chunk already. Later chunks that differ are stored again, not counted.

    A one-row first chunk is one put, under the content id."""

    def __init__(self, client: Client, run: RunKey, expiration_ms: int) -> None:
        self.client = client
        self.run = run
        self.expiration_ms = expiration_ms
        self.stored = 0  # rows stored by this run
        self.found = 0  # rows an earlier run had stored (answered as repeats)
        self.puts = 0
        self.diverged = 0  # chunks an earlier run stored with other rows

    def _put(self, queue: str, items: list[bytes], producer: bytes, delay_ms: int,
             headers: list[RowHeaders] | None) -> PutAnswer:
        answer = self.client.put_sequenced(queue, items, producer, 1, self.expiration_ms,
                                           delay_ms=delay_ms, headers=headers)
        self.puts += 1
        if answer.duplicate:
            self.found += len(items)
        else:
            self.stored += answer.count
        return answer

    def send(self, queue: str, delay_ms: int, group: bytes, number: int,
             items: list[bytes], headers: list[RowHeaders] | None = None,
             arrow: list[pa.Array] | None = None) -> None:
        """`arrow`: the same rows as binary arrays (their digest is read from there)."""
        digest = None if arrow is None else arrow_digest(arrow, headers)
        content = content_id(group, number, items, headers, digest)
        if number > 1 or len(items) == 1:
            self._put(queue, items, content, delay_ms, headers)
            return
        first, tail = (None, None) if headers is None else (headers[:-1], headers[-1:])
        rows = self._put(queue, items[:-1], content, delay_ms, first)
        last = self._put(queue, items[-1:], position_id(group, number), delay_ms, tail)
        if last.duplicate and not rows.duplicate:
            self.diverged += 1
            self.found -= 1  # (that row was not the one found: it is put now)
            log.warning("queued sink: chunk %d of queue %r in partition %d was stored by an "
                        "earlier run of this write with other rows: this run's are stored "
                        "now (rows of the earlier run may be there twice)", number, queue,
                        self.run.partition)
            self._put(queue, items[-1:], _h(b"again", content), delay_ms, tail)
