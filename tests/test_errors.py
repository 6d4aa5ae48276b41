"""The one error tree of queued (queued.errors): every error a module raises to its callers
is a QueuedError; a protocol error carries its wire reply and whether the connection
closes; what the peer got wrong and what we got wrong are apart (h11's way)."""

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
from queued.wire import parsing as wire


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
        assert issubclass(cls, errors.ProtocolError)
    # Our own encoding mistakes are not the peer's.
    assert not issubclass(errors.LocalProtocolError, errors.ProtocolError)


def test_config_error_is_a_queued_error() -> None:
    assert issubclass(ConfigError, QueuedError)


@pytest.mark.xfail(strict=True, reason="queued.server.tls.TlsError derives from Exception, "
                   "not QueuedError (STYLE habit 3); strict: passes once it is fixed")
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
        errors.ProtocolError("no reply given")  # type: ignore[call-arg]


def test_corrupt_records_say_where() -> None:
    exc = errors.ChecksumMismatchError(1234, "crc differs")
    assert isinstance(exc, errors.CorruptRecordError) and isinstance(exc, errors.JournalError)
    assert exc.offset == 1234 and "1234" in str(exc)
