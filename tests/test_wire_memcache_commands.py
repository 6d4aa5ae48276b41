"""The memcache protocol's table of commands (queued.wire.memcache_commands), pure: what a
set whose data is a configured user's credential pair means (a login), and nothing else.
The tables of all three protocols against the protocol-neutral commands: test_wire_commands.py."""

from __future__ import annotations

from queued.wire import commands as c
from queued.wire.access import MAX_PASSWORD
from queued.wire.memcache_commands import login_of


def test_login_of_takes_only_the_shape_of_a_configured_users_credentials() -> None:
    known = {"alice", "bob"}.__contains__
    assert login_of(b"alice alice pw", known) == c.Auth("alice", "alice pw")
    assert login_of(b"bob x\r\n", known) == c.Auth("bob", "x")
    assert login_of(b"bob " + b"p" * MAX_PASSWORD, known) is not None
    for data in (b"mallory pw", b"alice", b"alicepw", b"\xff\xfe pw", b"",
                 b"bob " + b"p" * (MAX_PASSWORD + 1), b"bob \xff\xfe"):
        assert login_of(data, known) is None, data
