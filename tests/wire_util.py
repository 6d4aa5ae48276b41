"""Helpers for the tests of the protocols' command tables (queued.wire.*_commands): the
limits a session gives its codec, and every request a codec decodes from some bytes."""

from __future__ import annotations

from queued.errors import ProtocolError
from queued.wire import commands as c
from queued.wire.parsing import NEED_DATA

LIMITS = c.Limits(max_line=2048, max_item_size=1 << 20, max_frame=1 << 20, max_batch=1000)


def decode_all(codec: c.Codec, data: bytes) -> list[object]:
    codec.receive_data(data)
    out: list[object] = []
    while True:
        try:
            r = codec.next_request()
        except ProtocolError as e:
            out.append(e)
            if e.close:  # sticky: the parser only repeats it
                return out
            continue
        if r is NEED_DATA:
            return out
        out.append(r)
