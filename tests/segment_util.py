"""What the writer's tests share: a chunk of puts as the journal plans one, and the puts a
segment file holds."""

from __future__ import annotations

from pathlib import Path

from queued.journal import format as jf
from queued.storage.write_plans import Chunk

#: the add time of every put these chunks hold
T0 = 1_700_000_000_000


def chunk(first_id: int, datas: list[bytes], *, rotate: bool = False) -> Chunk:
    """A chunk of puts of `datas`, ids from `first_id` on."""
    pack = jf.put_header_packer(T0)
    c = Chunk(rotate=rotate, count=len(datas), first_id=first_id,
              last_id=first_id + len(datas) - 1)
    for i, data in enumerate(datas):
        c.add(pack(len(data), first_id + i), data)
    return c


def puts_in(path: Path) -> list[tuple[int, bytes]]:
    """(id, data) of every put in segment file `path`, in order."""
    return [(d.record.id, d.record.data) for d in jf.decode_all(path.read_bytes())
            if isinstance(d.record, jf.Put)]
