#!/usr/bin/env python3
"""Memory per producer a queue remembers (exactly-once puts): prints bytes per entry.

Fills a `ProducerTable` with N producers of a given id length, as the server does (one
entry per put of a new producer, its ticket dropped once durable), and reads the heap
growth with tracemalloc. Prints numbers, asserts nothing.

Usage:  .venv/bin/python bench/producer_mem.py [N] [ID_BYTES]
"""

from __future__ import annotations

import os
import sys
import tracemalloc

from queued.reader.producers import ProducerTable


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    id_bytes = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    ids = [os.urandom(id_bytes) for _ in range(n)]  # (the ids arrive with the requests)
    table = ProducerTable(max_producers=n)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i, producer in enumerate(ids):
        # (a put's id and sequence: new ints past the small-int cache, as on the wire)
        table.store(producer, 1_000_000 + i, 2**40 + i, 100 + i % 3, 1_700_000_000_000 + i)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    ids_size = sum(map(sys.getsizeof, ids))
    per = (after - before) / n
    print(f"{n} producers, {id_bytes}-byte ids: {per:.0f} B per entry in the table, "
          f"+ {ids_size / n:.0f} B for its id (bytes object): {per + ids_size / n:.0f} B; "
          f"10,000 producers: {(per + ids_size / n) * 10_000 / 2**20:.2f} MiB")


if __name__ == "__main__":
    from benchlib import recording  # (keeps the output; the bench needs only the tables)

    with recording("producer_mem"):
        main()
