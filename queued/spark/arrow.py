"""Journal records to Arrow record batches, all of a chunk's records at once.

Owns the Arrow schema of the source's rows and the vectorised decoding of a
`journal_scan.PutChunk`: numpy gathers every record's header from the chunk's bytes in
one indexing step, and copies the item data out of the same bytes as strided blocks where
items of one size follow one another (a writer's batch), else Arrow does (`take` over an
array whose elements alternate between data and the bytes in between); the optional flags
column places the flags the scan found by offset, the optional headers column the headers
blocks likewise. No per-record Python (but for items with headers).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from queued.journal import format as jf
from queued.journal.headers import header_pairs
from queued.storage.journal_scan import PutChunk

ARROW_SCHEMA = pa.schema([
    ("queue", pa.string()), ("id", pa.int64()), ("add_time", pa.timestamp("us", tz="UTC")),
    ("expire_time", pa.timestamp("us", tz="UTC")), ("error_count", pa.int32()),
    ("data", pa.binary()),
])
#: With the `include_flags` option: each item's memcache flags (u32) as one more column.
ARROW_SCHEMA_FLAGS = ARROW_SCHEMA.append(pa.field("flags", pa.int64()))
#: With `includeHeaders`: each item's headers, as the Kafka source's column (null for none).
HEADERS_TYPE = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))


def arrow_schema(flags: bool = False, headers: bool = False) -> pa.Schema:
    """The rows' schema: ARROW_SCHEMA, then flags and headers columns as asked."""
    schema = ARROW_SCHEMA_FLAGS if flags else ARROW_SCHEMA
    return schema.append(pa.field("headers", HEADERS_TYPE)) if headers else schema

#: A PUT_EXPIRE header (a PUT's is the same without `expire`), little-endian, packed.
_HEADER = np.dtype([("cmd", "u1"), ("size", "<i4"), ("errors", "<i4"), ("id", "<i8"),
                    ("added", "<i8"), ("expire", "<i8")])
assert _HEADER.itemsize == jf.PUT_EXPIRE_HEADER_SIZE == jf.PUT_EXPIRE_STRUCT.size
_EMPTY = pa.RecordBatch.from_pylist([], schema=ARROW_SCHEMA)
_EMPTY_FLAGS = pa.RecordBatch.from_pylist([], schema=ARROW_SCHEMA_FLAGS)
_MS = pa.timestamp("ms", tz="UTC")
_US = pa.timestamp("us", tz="UTC")
_ZERO = pa.scalar(0, pa.int64())
#: Items per run, on average, for a chunk's data to be copied run by run (`_data_by_runs`).
RUN_ROWS = 64


def chunk_to_arrow(queue: str, chunk: PutChunk, live_at_ms: int = 0,
                   flags: bool = False, include_headers: bool = False) -> pa.RecordBatch:
    """The chunk's records as rows of ARROW_SCHEMA (ARROW_SCHEMA_FLAGS with `flags`, and a
    headers column with `include_headers`); with `live_at_ms`, only the items not expired
    at that time (an item expires when its expire time is <= now)."""
    if include_headers:
        return _with_headers(queue, chunk, live_at_ms, flags)
    n = len(chunk)
    empty = _EMPTY_FLAGS if flags else _EMPTY
    if n == 0:
        return empty
    # Element i of `headers` is the header-sized bytes from chunk.buf[i] on: indexing it
    # with the record offsets gathers every header, whole.
    headers = np.ndarray(shape=(len(chunk.buf) - _HEADER.itemsize + 1,), dtype=_HEADER,
                         buffer=chunk.buf, strides=(1,))
    at = np.array(chunk.offsets, dtype=np.int64)
    flag_values = _flags(chunk, at) if flags else None
    at -= chunk.base
    recs = headers[at]  # every header, in one gather (one pass over the records)
    del headers  # (the chunk's bytes are a view of the scan's: let them go)
    has_expire = recs["cmd"] == jf.PUT_EXPIRE_BYTE
    if live_at_ms and has_expire.any():
        expired = has_expire & (recs["expire"] <= live_at_ms)
        if expired.any():
            live = ~expired
            at, has_expire, recs = at[live], has_expire[live], recs[live]
            flag_values = None if flag_values is None else flag_values[live]
            n = len(at)
            if n == 0:
                return empty
    sizes = recs["size"]
    starts = at + np.where(has_expire, jf.PUT_EXPIRE_HEADER_SIZE, jf.PUT_HEADER_SIZE)

    data = _data_by_runs(chunk.buf, starts, sizes)
    if data is None:
        # Elements 0, 2, 4, ... are the items' data; 1, 3, ... the bytes between two items.
        bounds = np.empty(2 * n, dtype=np.int64)
        bounds[0::2] = starts
        bounds[1::2] = starts + sizes
        spans = pa.Array.from_buffers(pa.large_binary(), 2 * n - 1,
                                      [None, pa.py_buffer(bounds), pa.py_buffer(chunk.buf)])
        data = spans.take(pa.array(np.arange(0, 2 * n - 1, 2))).cast(pa.binary())

    columns = [
        pa.repeat(pa.scalar(queue, pa.string()), n),
        pa.array(recs["id"]),
        pa.array(recs["added"], _MS).cast(_US),  # the cast refuses to overflow
        pa.array(recs["expire"], _MS, mask=~has_expire).cast(_US),
        pa.array(recs["errors"], pa.int32()),
        data,
    ]
    if not flags:
        return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)
    columns.append(pa.repeat(_ZERO, n) if flag_values is None else pa.array(flag_values))
    return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA_FLAGS)


def _data_by_runs(buf: bytes | memoryview, starts: np.ndarray,
                  sizes: np.ndarray) -> pa.Array | None:
    """The items' data as a binary array, copied run by run: a run is items of one size
    one stride apart (a writer's batch of same-sized items), copied as one strided block
    (`take` copies item by item). None when the items make too many runs for that to pay
    (items of many sizes): then `take` does it."""
    n = len(starts)
    if n < RUN_ROWS:
        return None
    step = np.diff(starts)
    new = np.empty(n, dtype=bool)  # where a run starts
    new[0] = True
    new[1:] = sizes[1:] != sizes[:-1]
    new[2:] |= step[1:] != step[:-1]
    first = np.flatnonzero(new)
    total = int(sizes.sum(dtype=np.int64))
    if len(first) * RUN_ROWS > n or total >= 2**31:
        return None
    # Arrow's memory pool, not numpy's malloc: it reuses what earlier batches freed, where
    # a fresh allocation of that size costs a page fault every 4 KiB.
    offsets_buffer, values_buffer = pa.allocate_buffer(4 * (n + 1)), pa.allocate_buffer(total)
    offsets = np.frombuffer(offsets_buffer, dtype=np.int32)
    offsets[0] = 0
    np.cumsum(sizes, out=offsets[1:])
    values = np.frombuffer(values_buffer, dtype=np.uint8)
    source = np.frombuffer(buf, dtype=np.uint8)
    for a, b in zip(first.tolist(), [*first[1:].tolist(), n], strict=True):
        size, at, out = int(sizes[a]), int(starts[a]), int(offsets[a])
        if b - a == 1 or size == 0:
            values[out:out + size] = source[at:at + size]  # (size 0: nothing)
            continue
        rows = np.lib.stride_tricks.as_strided(source[at:], shape=(b - a, size),
                                               strides=(int(step[a]), 1), writeable=False)
        values[out:int(offsets[b])].reshape(b - a, size)[...] = rows
    del source, offsets, values
    return pa.Array.from_buffers(pa.binary(), n, [None, offsets_buffer, values_buffer])


def _flags(chunk: PutChunk, offsets: np.ndarray) -> np.ndarray | None:
    """Each record's flags, by its (ascending) file offset; None when all are 0."""
    if not chunk.flags:
        return None
    keys = np.fromiter(chunk.flags.keys(), dtype=np.int64, count=len(chunk.flags))
    values = np.fromiter(chunk.flags.values(), dtype=np.int64, count=len(chunk.flags))
    where = np.searchsorted(offsets, keys)
    hit = where < len(offsets)
    hit[hit] = offsets[where[hit]] == keys[hit]  # (flags of records not asked for: left out)
    out = np.zeros(len(offsets), dtype=np.int64)
    out[where[hit]] = values[hit]
    return out


def _with_headers(queue: str, chunk: PutChunk, live_at_ms: int, flags: bool,
                  ) -> pa.RecordBatch:
    """chunk_to_arrow's rows with the headers column: the headers blocks placed by file
    offset, as the flags are (the rows' ids tell which survived the expiry filter)."""
    rows = chunk_to_arrow(queue, chunk, live_at_ms, flags)
    schema = arrow_schema(flags, True)
    if not chunk.headers:
        column = pa.nulls(rows.num_rows, HEADERS_TYPE)
    else:
        ids = _ids_by_offset(chunk)
        blocks = {ids[off]: block for off, block in chunk.headers.items() if off in ids}
        column = pa.array([[{"key": k, "value": v} for k, v in header_pairs(blocks[i])]
                           if i in blocks else None
                           for i in rows.column(1).to_pylist()], HEADERS_TYPE)
    return pa.RecordBatch.from_arrays([*rows.columns, column], schema=schema)


def _ids_by_offset(chunk: PutChunk) -> dict[int, int]:
    """The id of each record, by its file offset."""
    at = np.fromiter(chunk.offsets, dtype=np.int64, count=len(chunk)) - chunk.base
    ids = np.ndarray(shape=(len(chunk.buf) - _HEADER.itemsize + 1,), dtype=_HEADER,
                     buffer=chunk.buf, strides=(1,))["id"][at]
    return dict(zip(chunk.offsets, ids.tolist(), strict=True))
