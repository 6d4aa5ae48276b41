"""The text protocol's table of commands (queued.wire.text_commands), pure: what its
requests become and how their replies go out. All three tables against the
protocol-neutral commands: test_wire_commands.py."""

from __future__ import annotations

from wire_util import LIMITS, decode_all

from queued.wire import commands as c
from queued.wire import text_commands as tc


def test_text_get_leaves_an_item_with_a_newline_queued() -> None:
    codec = tc.TextCodec(LIMITS)
    (get,) = decode_all(codec, b"get q 10\n")
    assert isinstance(get, c.Request)
    assert get.command == c.Get("q", None, timeout_ms=10, open=True, line_safe=True)
    assert codec.encode(get, c.Failure(c.ErrorKind.NOT_ENCODABLE, "nl")).startswith(b"-Item")
    assert codec.encode(get, c.Items([])) == b"*\n"
