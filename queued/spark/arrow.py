"""Journal records to Arrow record batches, all of a chunk's records at once.

Owns the Arrow schema of the source's rows and the vectorised decoding of a
`journal_scan.PutChunk`. Where the chunk is mostly runs of same-sized records (a writer's
batches; the scan hands each run over as one `range`), each run's header fields and item
data are copied out of the chunk's bytes with one strided copy per column (`_by_runs`).
Otherwise numpy gathers every record's header from the chunk's bytes in one indexing
step, and copies the item data as strided blocks where items of one size follow one
another, else Arrow does (`take` over an array whose elements alternate between data and
the bytes in between). The optional flags column places the flags the scan found by
offset, the optional headers column the headers blocks likewise. No per-record Python
(but for items with headers, and the few records of a chunk that are not in a run).
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
#: Where the header fields `_by_runs` reads sit in a record.
_ERRORS_AT, _ID_AT, _ADDED_AT, _EXPIRE_AT = 5, jf.PUT_ID_AT, 17, 25
assert [_HEADER.fields[f][1] for f in ("errors", "id", "added", "expire")] == [  # type: ignore[index]
    _ERRORS_AT, _ID_AT, _ADDED_AT, _EXPIRE_AT]
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
    if len(chunk.spans) * RUN_ROWS <= n:
        runs = _by_runs(queue, chunk, live_at_ms, flags)
        if runs is not None:
            return runs
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


def _by_runs(queue: str, chunk: PutChunk, live_at_ms: int,
             flags: bool) -> pa.RecordBatch | None:
    """chunk_to_arrow's rows, each run of the chunk (a `range` of records of one command
    and size, one stride apart) copied column by column with strided reads, the few
    records between runs gathered; None when those are too many (over one in RUN_ROWS) or
    the data too big for a binary array: then the general path does it."""
    n, buf, base = len(chunk), chunk.buf, chunk.base
    ids, added = np.empty(n, np.int64), np.empty(n, np.int64)
    errors, sizes = np.empty(n, np.int32), np.empty(n, np.int32)
    expire = np.zeros(n, np.int64)
    has_expire = np.zeros(n, bool)
    runs: list[tuple[int, int, int, int, int]] = []  # (row, count, data at, stride, size)
    loose_rows: list[int] = []
    loose_at: list[int] = []
    i = 0
    for span in chunk.spans:
        if isinstance(span, int):
            loose_rows.append(i)
            loose_at.append(span - base)
            i += 1
            continue
        k, at, stride = len(span), span.start - base, span.step
        long = buf[at] == jf.PUT_EXPIRE_BYTE
        hdr = jf.PUT_EXPIRE_HEADER_SIZE if long else jf.PUT_HEADER_SIZE
        for column, kind, field_at in ((ids, "<i8", _ID_AT), (added, "<i8", _ADDED_AT),
                                       (errors, "<i4", _ERRORS_AT)):
            column[i:i + k] = np.ndarray((k,), kind, buf, at + field_at, (stride,))
        if long:
            expire[i:i + k] = np.ndarray((k,), "<i8", buf, at + _EXPIRE_AT, (stride,))
            has_expire[i:i + k] = True
        sizes[i:i + k] = stride - hdr
        runs.append((i, k, at + hdr, stride, stride - hdr))
        i += k
    if len(loose_rows) * RUN_ROWS > n:
        return None
    starts = np.empty(len(loose_rows), np.int64)
    if loose_rows:
        rows, where = np.array(loose_rows), np.array(loose_at, np.int64)
        recs = np.ndarray(shape=(len(buf) - _HEADER.itemsize + 1,), dtype=_HEADER,
                          buffer=buf, strides=(1,))[where]
        long_ones = recs["cmd"] == jf.PUT_EXPIRE_BYTE
        ids[rows], added[rows], errors[rows] = recs["id"], recs["added"], recs["errors"]
        sizes[rows] = recs["size"]
        has_expire[rows] = long_ones
        expire[rows] = np.where(long_ones, recs["expire"], 0)
        starts = where + np.where(long_ones, jf.PUT_EXPIRE_HEADER_SIZE, jf.PUT_HEADER_SIZE)
    total = int(sizes.sum(dtype=np.int64))
    if total >= 2**31:
        return None
    offsets_buffer, values_buffer = pa.allocate_buffer(4 * (n + 1)), pa.allocate_buffer(total)
    offsets = np.frombuffer(offsets_buffer, dtype=np.int32)
    offsets[0] = 0
    np.cumsum(sizes, out=offsets[1:])
    values = np.frombuffer(values_buffer, dtype=np.uint8)
    source = np.frombuffer(buf, dtype=np.uint8)
    for row, k, data_at, stride, size in runs:
        if size:
            to = int(offsets[row])
            values[to:to + k * size].reshape(k, size)[...] = np.lib.stride_tricks.as_strided(
                source[data_at:], shape=(k, size), strides=(stride, 1), writeable=False)
    for row, data_at in zip(loose_rows, starts.tolist(), strict=True):
        to, end = int(offsets[row]), int(offsets[row + 1])
        values[to:end] = source[data_at:data_at + end - to]
    del source, offsets, values
    columns = [
        pa.repeat(pa.scalar(queue, pa.string()), n),
        pa.array(ids),
        pa.array(added, _MS).cast(_US),  # the cast refuses to overflow
        (pa.array(expire, _MS, mask=~has_expire).cast(_US) if has_expire.any()
         else pa.nulls(n, _US)),
        pa.array(errors, pa.int32()),
        pa.Array.from_buffers(pa.binary(), n, [None, offsets_buffer, values_buffer]),
    ]
    if flags:
        flag_values = _flags(chunk, _absolute(chunk, n)) if chunk.flags else None
        columns.append(pa.repeat(_ZERO, n) if flag_values is None else pa.array(flag_values))
    batch = pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA_FLAGS if flags
                                       else ARROW_SCHEMA)
    if live_at_ms and has_expire.any():
        expired = has_expire & (expire <= live_at_ms)
        if expired.any():
            batch = batch.filter(pa.array(~expired))
    return batch


def _absolute(chunk: PutChunk, n: int) -> np.ndarray:
    """The file offset of each record of the chunk, one by one."""
    at = np.empty(n, np.int64)
    i = 0
    for span in chunk.spans:
        if isinstance(span, int):
            at[i] = span
            i += 1
        else:
            at[i:i + len(span)] = np.arange(span.start, span.stop, span.step)
            i += len(span)
    return at


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
