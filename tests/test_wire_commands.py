"""The protocol-neutral commands (queued.wire.commands) against each protocol's table
(queued.wire.{memcache,text,rpc}_commands): every parser event has a command and a
reply, every error kind a reply in every protocol, and failures mapped to their kinds.
Each table's own rules: test_wire_memcache_commands.py, test_wire_text_commands.py,
test_wire_rpc_commands.py."""

from __future__ import annotations

import dataclasses
import errno
import typing

import pytest
from wire_util import LIMITS

from queued.errors import (
    BadNameError,
    ItemTooLargeError,
    JournalClosedError,
    JournalFullError,
    JournalWriteError,
    QueueClosedError,
    QueueFullError,
    ReadStateError,
)
from queued.wire import commands as c
from queued.wire import memcache_commands as mcc
from queued.wire import memcache_protocol as mc
from queued.wire import rpc_commands as rpcc
from queued.wire import rpc_protocol as rp
from queued.wire import text_commands as tc
from queued.wire import text_protocol as tp


def test_every_parser_event_has_a_command_and_a_reply() -> None:
    for table, events in ((mcc, mc.Command), (tc, tp.Command)):
        kinds = set(typing.get_args(events))
        assert set(table.COMMANDS) == kinds
        assert set(table.REPLIES) == kinds
    calls = set(typing.get_args(rp.Call))
    assert set(rpcc.COMMANDS) == calls - {rp.Get}  # get takes the connection's max_bytes


def test_every_error_kind_has_a_reply_in_every_protocol() -> None:
    assert set(mcc.FAILURES) == set(c.ErrorKind)
    assert set(rpcc.CODES) == set(c.ErrorKind)
    codec = tc.TextCodec(LIMITS)
    req = c.Request(c.Put("q", (b"x",)), tp.Put("q", (b"x",)), "put")
    for kind in c.ErrorKind:
        assert codec.encode(req, c.Failure(kind, "why")).startswith(b"-")


@pytest.mark.parametrize(("exc", "kind"), [
    (BadNameError("bad"), c.ErrorKind.BAD_NAME),
    (QueueFullError("full"), c.ErrorKind.QUEUE_FULL),
    (ItemTooLargeError("big"), c.ErrorKind.ITEM_TOO_LARGE),
    (JournalFullError("full"), c.ErrorKind.JOURNAL_FULL),
    (ReadStateError("open"), c.ErrorKind.TOO_MANY_OPEN_READS),
    (QueueClosedError("gone"), c.ErrorKind.SHUTTING_DOWN),
    (JournalClosedError("closed"), c.ErrorKind.SHUTTING_DOWN),
    (ValueError("bad value"), c.ErrorKind.BAD_PARAMS),
    (JournalWriteError("disk"), c.ErrorKind.SERVER_ERROR),
])
def test_failure_of_maps_each_error_to_its_kind(exc: Exception, kind: c.ErrorKind) -> None:
    assert c.failure_of(exc) == c.Failure(kind, str(exc))


def test_failure_of_an_os_error_says_its_strerror_and_a_bug_is_none() -> None:
    assert c.failure_of(OSError(errno.ENOSPC, "No space left on device")) == c.Failure(
        c.ErrorKind.SERVER_ERROR, "No space left on device")
    assert c.failure_of(KeyError("bug")) is None


def test_a_get_copy_has_every_field_and_is_its_own() -> None:
    """Get.copy (what a pass changes, as a parser's cached Get is shared) names every
    field: one set to a value other than its default in each is copied."""
    changed: dict[str, object] = {}
    for f in dataclasses.fields(c.Get):
        if f.name == "queue":
            changed[f.name] = "q"
        elif f.type in ("bool", bool):
            changed[f.name] = not f.default
        elif f.name == "reader":
            changed[f.name] = "r"
        else:
            changed[f.name] = 7 if f.default != 7 else 8
    get = c.Get(**changed)  # type: ignore[arg-type]
    copy = get.copy()
    assert copy is not get and type(copy) is c.Get
    assert {f.name: getattr(copy, f.name) for f in dataclasses.fields(c.Get)} == changed
    copy.close = not copy.close
    assert get.close is changed["close"]
