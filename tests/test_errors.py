"""The one error tree of queued (queued.errors): every error a module raises to its callers
is a QueuedError; one ProtocolError with h11's pair under it, each side raised where its
fault lies (the peer's: RemoteProtocolError, with its wire reply and whether the connection
closes; ours: LocalProtocolError)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import trio

import queued
from queued import errors
from queued.config import ConfigError
from queued.errors import QueuedError
from queued.wire import commands as c
from queued.wire import memcache_protocol as mp
from queued.wire import parsing as wire
from queued.wire.memcache_commands import MemcacheCodec
from queued.wire.rpc_protocol import ErrorCode, RpcError


def public_exceptions() -> list[type[BaseException]]:
    """Every public exception class defined in the package (imports each module)."""
    found = []
    for info in pkgutil.walk_packages(queued.__path__, "queued."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__ == module.__name__ and not name.startswith("_")):
                found.append(obj)
    return found


def test_errors_belong_to_the_tree() -> None:
    for cls in [errors.ProtocolError, errors.LocalProtocolError, wire.ArgumentError,
                wire.LineOverflow]:
        assert issubclass(cls, QueuedError)
    for cls in [errors.UnknownCommand, errors.BadCommand, errors.LineTooLong, errors.TooLarge,
                errors.BadDataChunk]:
        assert issubclass(cls, errors.RemoteProtocolError)


def test_config_error_is_a_queued_error() -> None:
    assert issubclass(ConfigError, QueuedError)


def test_every_public_exception_is_a_queued_error_or_a_trio_signal() -> None:
    outside = [f"{cls.__module__}.{cls.__name__}" for cls in public_exceptions()
               if not issubclass(cls, (QueuedError, trio.WouldBlock))]
    assert outside == []


def test_a_protocol_error_carries_its_reply_and_whether_to_close() -> None:
    exc = errors.BadCommand("bad get options", reply=b"CLIENT_ERROR bad options\r\n",
                            close=False)
    assert (exc.reply, exc.close, str(exc)) == (
        b"CLIENT_ERROR bad options\r\n", False, "bad get options")
    with pytest.raises(TypeError):
        errors.RemoteProtocolError("no reply given")  # type: ignore[call-arg]


def test_corrupt_records_say_where() -> None:
    exc = errors.ChecksumMismatchError(1234, "crc differs")
    assert isinstance(exc, errors.CorruptRecordError) and isinstance(exc, errors.JournalError)
    assert exc.offset == 1234 and "1234" in str(exc)


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
