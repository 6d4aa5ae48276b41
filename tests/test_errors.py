"""queued.errors: one ProtocolError with h11's pair under it, and each side raised where its
fault lies (the peer's: RemoteProtocolError, with its reply; ours: LocalProtocolError)."""

from __future__ import annotations

import pytest

from queued import errors
from queued.wire import commands as c
from queued.wire import memcache_protocol as mp
from queued.wire.memcache_commands import MemcacheCodec
from queued.wire.rpc_protocol import ErrorCode, RpcError


def test_the_pair_shares_one_base_and_neither_is_the_other() -> None:
    assert issubclass(errors.RemoteProtocolError, errors.ProtocolError)
    assert issubclass(errors.LocalProtocolError, errors.ProtocolError)
    assert issubclass(errors.ProtocolError, errors.QueuedError)
    assert not issubclass(errors.LocalProtocolError, errors.RemoteProtocolError)
    assert not issubclass(errors.RemoteProtocolError, errors.LocalProtocolError)


@pytest.mark.parametrize("cls", [errors.UnknownCommand, errors.BadCommand, errors.LineTooLong,
                                 errors.TooLarge, errors.BadDataChunk])
def test_every_refusal_of_the_peer_is_remote_and_carries_its_reply(
        cls: type[errors.RemoteProtocolError]) -> None:
    e = cls("no", reply=b"ERROR\r\n", close=True)
    assert isinstance(e, errors.RemoteProtocolError)
    assert (e.reply, e.close) == (b"ERROR\r\n", True)


def test_an_rpc_refusal_is_remote_and_answers_its_msgid() -> None:
    e = RpcError(ErrorCode.BAD_PARAMS, "bad", 7)
    assert isinstance(e, errors.RemoteProtocolError) and e.reply and not e.close


def test_a_codec_hands_back_the_peers_errors_in_place() -> None:
    codec = MemcacheCodec(c.Limits(max_line=2048, max_item_size=64, max_frame=1 << 20,
                                   max_batch=100))
    codec.receive_data(b"bogus\r\nversion\r\n")
    refused, version = codec.next_requests(10)
    assert isinstance(refused, errors.RemoteProtocolError) and refused.reply.startswith(b"ERROR")
    assert isinstance(version, c.Request)


def test_our_own_mistakes_are_local_and_no_codec_takes_them_for_the_peers() -> None:
    with pytest.raises(errors.LocalProtocolError):
        mp.value("a key with spaces", 0, b"x")  # cannot go on the wire
    parser = mp.MemcacheParser(max_line=2048, max_item_size=64)
    parser.receive_data(b"")
    with pytest.raises(errors.LocalProtocolError):
        parser.receive_data(b"after the end")
    with pytest.raises(errors.ProtocolError) as caught:  # the base, where either is meant
        parser.receive_data(b"again")
    assert not isinstance(caught.value, errors.RemoteProtocolError)
