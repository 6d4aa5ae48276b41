#!/usr/bin/env python3
"""Memory per producer (exactly-once puts) or per deduplication key a queue remembers:
prints bytes per entry.

Fills a `ProducerTable` with N producers of a given id length (or, with --keys, a
`DedupTable` with N keys of that length), as the server does (one entry per put of a new
producer or key, its ticket dropped once durable), and reads the heap growth with
tracemalloc. Prints numbers, asserts nothing.

Usage:  .venv/bin/python bench/producer_mem.py [--keys] [N] [ID_BYTES]
"""

from __future__ import annotations

import os
import sys
import tracemalloc

from queued.reader.dedup import DEFAULT_MAX_DEDUP_KEYS, DedupTable
from queued.reader.producers import DEFAULT_MAX_PRODUCERS, ProducerTable


def main() -> None:
    args = sys.argv[1:]
    keys = "--keys" in args
    args = [a for a in args if a != "--keys"]
    n = int(args[0]) if args else 100_000
    id_bytes = int(args[1]) if len(args) > 1 else 16
    ids = [os.urandom(id_bytes) for _ in range(n)]  # (the ids arrive with the requests)
    producers = ProducerTable(max_producers=n)
    dedup = DedupTable(max_keys=n, window_ms=2**62)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i, name in enumerate(ids):
        # (a put's first id, time and sequence: new ints past the small-int cache, as on
        # the wire; counts are small)
        if keys:
            dedup.store(name, 2**40 + i, 1 + i % 3, 1_700_000_000_000 + i)
        else:
            producers.store(name, 1_000_000 + i, 2**40 + i, 100 + i % 3,
                            1_700_000_000_000 + i)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    ids_size = sum(map(sys.getsizeof, ids))
    per = (after - before) / n
    what, cap = ("keys", DEFAULT_MAX_DEDUP_KEYS) if keys else (
        "producers", DEFAULT_MAX_PRODUCERS)
    print(f"{n} {what}, {id_bytes}-byte {'keys' if keys else 'ids'}: {per:.0f} B per entry "
          f"in the table, + {ids_size / n:.0f} B for its name (bytes object): "
          f"{per + ids_size / n:.0f} B; {cap:,} {what} (the default cap): "
          f"{(per + ids_size / n) * cap / 2**20:.2f} MiB")


if __name__ == "__main__":
    from benchlib import recording  # (keeps the output; the bench needs only the tables)

    with recording("producer_mem"):
        main()
