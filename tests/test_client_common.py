"""What both clients share (queued.client.common), pure: every error code of the RPC port
becomes its own exception, carrying the code, the message and the server; a get's reply
becomes items equal to ones built by `Item(...)`, and a malformed one is refused; items
to confirm or abort are grouped by where their reads are open."""

from __future__ import annotations

import dataclasses

import pytest

from queued.client import (
    BadResponse,
    Item,
    RpcCallError,
)
from queued.client.common import ERRORS, call_error, settle_groups, to_items
from queued.wire.rpc_protocol import (
    ErrorCode,
)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_error_code_has_its_exception(code: ErrorCode) -> None:
    exc = call_error([int(code), "why"], "h:1")
    assert type(exc) is ERRORS[code] and exc.code is code
    assert exc.message == "why" and exc.server == "h:1"
    assert code.name in str(exc)
    unknown = call_error([99, "new"], "h:1")
    assert type(unknown) is RpcCallError and unknown.code == 99


@pytest.mark.parametrize("pair, expected", [
    ([7, b"ab"], Item(7, b"ab", "q", "h:1", 3, client="c")),
    ([7, "ab"], Item(7, b"ab", "q", "h:1", 3, client="c")),
    ([7, b"ab", 5], Item(7, b"ab", "q", "h:1", 3, 5, client="c")),
    ([7, b"ab", 5, 2], Item(7, b"ab", "q", "h:1", 3, 5, 2, client="c")),
    ([7, b"ab", 5, 2, {"k": b"v"}], Item(7, b"ab", "q", "h:1", 3, 5, 2, {"k": b"v"}, "c")),
])
def test_get_reply_items_are_items(pair: list[object], expected: Item) -> None:
    """to_items builds its items without Item's __init__ (see _NewItem): each is an Item
    in every respect, every field as `Item(...)` sets it, and frozen."""
    [item] = to_items([pair], "q", "h:1", 3, "c")
    assert type(item) is Item
    assert dataclasses.astuple(item) == dataclasses.astuple(expected)
    assert item == expected and repr(item) == repr(expected)
    if item.headers is None:  # (a dict of headers is not hashable)
        assert hash(item) == hash(expected)
    assert item.client == "c"
    with pytest.raises(dataclasses.FrozenInstanceError):
        item.id = 8  # type: ignore[misc]
    many = to_items([pair] * 3, "q", "h:1", 3, "c")
    assert many == [expected] * 3 and len({id(i) for i in many}) == 3


@pytest.mark.parametrize("reply", [
    {"not": "a list"}, [[7]], [[7, b"a", 1, 2, {}, 9]], [["7", b"a"]], [[7, 5]],
    [[7, b"a", -1]], [[7, b"a", 2**32]], [[7, b"a", 1, -1]], [[7, b"a", 1, 1, {1: b"v"}]],
    [[7, b"a", 1, 1, {"k": 5}]], [(7, b"a")], [[True, b"a"]],
])
def test_malformed_get_reply_is_refused(reply: object) -> None:
    with pytest.raises(BadResponse):
        to_items(reply, "q", "h:1", 0)


def test_settle_groups_by_server_queue_and_connection_in_order() -> None:
    def items(ids: range, queue: str, server: str, connection: int) -> list[Item]:
        return [Item(i, b"", queue, server, connection) for i in ids]
    a = items(range(0, 3), "q", "h:1", 1)
    b = items(range(3, 5), "r", "h:1", 1)  # another queue, same connection
    c = items(range(5, 7), "q", "h:2", 1)  # another server
    d = items(range(7, 9), "q", "h:1", 2)  # another connection
    mixed = a[:2] + b + c[:1] + a[2:] + d + c[1:]
    assert list(settle_groups(iter(mixed)).items()) == [
        (("h:1", "q", 1), [0, 1, 2]), (("h:1", "r", 1), [3, 4]), (("h:2", "q", 1), [5, 6]),
        (("h:1", "q", 2), [7, 8])]
    assert settle_groups(a[1]) == {("h:1", "q", 1): [1]}
    assert settle_groups([]) == {}
    plain = Item(9, b"", "", "", 0)  # (a plain get's: queue, server and connection empty)
    assert settle_groups([plain]) == {("", "", 0): [9]}
