"""MessagePack-RPC framing and queued's RPC vocabulary: pure, sans-IO.

Owns the wire: frames in (`RpcParser.receive_data` / `next_event`), typed calls
and responses out, error codes, and the caps on frame and batch sizes. Both the
server session and `queued.client` use it. It must never touch sockets, files or
clocks; an over-cap frame is an error, never an allocation of its declared size.

Framing is the MessagePack-RPC spec's: request `[0, msgid, method, params]`,
response `[1, msgid, error, result]`, notification `[2, method, params]`. An error
is `[code, message]` with a code from `ErrorCode`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

import msgpack

from queued.errors import RemoteProtocolError
from queued.journal.headers import encode_headers
from queued.wire.parsing import (
    MAX_DEDUP_KEY,
    MAX_DELAY_MS,
    NEED_DATA,
    ConnectionClosed,
    NeedData,
    is_valid_name,
)

__all__ = [
    "METHODS",
    "NEED_DATA",
    "Abort",
    "Auth",
    "Call",
    "Confirm",
    "ConnectionClosed",
    "Delete",
    "ErrorCode",
    "Flush",
    "FlushAll",
    "Get",
    "Notification",
    "Peek",
    "Put",
    "Request",
    "Response",
    "RpcError",
    "RpcParser",
    "Stats",
    "Version",
    "encode_error",
    "encode_notification",
    "encode_request",
    "encode_response",
    "parse_call",
]

REQUEST: Final = 0
RESPONSE: Final = 1
NOTIFICATION: Final = 2

#: Default cap on one frame (a request or a response), bytes.
DEFAULT_MAX_FRAME: Final = 64 * 1024 * 1024
#: Default cap on items in one put, ids in one confirm/abort, max_items of one get.
DEFAULT_MAX_BATCH: Final = 100_000
#: Timeouts and auto-abort delays are capped (about 24.8 days), as Kestrel's are i32.
MAX_MS: Final = 2**31 - 1
MAX_FLAGS: Final = 2**32 - 1  # memcache flags: 32-bit unsigned
MAX_PRODUCER_ID: Final = 64  # bytes of a producer id (journal_records.MAX_PRODUCER_ID)
MAX_SEQUENCE: Final = 2**64 - 1  # a producer's sequence is a u64 from 1
#: Maps are only small option/stat tables; a request never needs a big one.
MAX_MAP_LEN: Final = 1024
#: msgid is a 32-bit unsigned integer in the spec.
MAX_MSGID: Final = 2**32 - 1
#: The frame scanner's first buffer (see RpcParser); it grows with the frames.
SCANNER_START: Final = 64 * 1024
_PREFIX: Final = 16  # bytes of a frame kept to name its msgid in a too-large reply


class ErrorCode(enum.IntEnum):
    """The first element of an error `[code, message]`. Stable: clients map them."""

    MALFORMED = 1  #: not MessagePack, or not a MessagePack-RPC message; closes
    UNKNOWN_METHOD = 2
    BAD_PARAMS = 3  #: wrong number or type of params, or a value out of range
    BAD_QUEUE_NAME = 4
    QUEUE_FULL = 5  #: max_items / max_size reached (discard_old_when_full off)
    ITEM_TOO_LARGE = 6  #: an item over max_item_size
    TOO_LARGE = 7  #: a frame or batch over the server's cap; closes
    TOO_MANY_OPEN_READS = 8  #: the connection holds max_open_reads open reads
    JOURNAL_FULL = 9  #: max_journal_size reached under the refuse policy
    SHUTTING_DOWN = 10  #: the server is stopping, or the queue was deleted meanwhile
    SERVER_ERROR = 11  #: a journal write failed, or a bug; see the server log
    BUSY = 12  #: too many connections, or too many gets waiting on one connection
    UNAUTHENTICATED = 13  #: a call before `auth` on a server with users; closes
    AUTH_FAILED = 14  #: wrong user or password; closes
    PERMISSION_DENIED = 15  #: the user lacks the permission on that queue
    TOO_MANY_QUEUES = 16  #: max_queues reached: the call would create a queue or reader
    NOT_OPEN = 17  #: extend or reject of a read this connection does not hold open
    PRODUCER_GAP = 18  #: a put's producer sequence skipped ahead of the next; nothing stored


class RpcError(RemoteProtocolError):
    """A request the peer got wrong (or we refuse): its error reply and whether to close.

    The reply answers `msgid`, or is an `error` notification when the msgid is unknown.
    """

    def __init__(self, code: ErrorCode, message: str, msgid: int | None = None,
                 *, close: bool = False) -> None:
        if msgid is None:
            reply = encode_notification("error", [[int(code), message]])
        else:
            reply = encode_error(msgid, code, message)
        super().__init__(f"{code.name}: {message}", reply=reply, close=close)
        self.code = code
        self.message = message
        self.msgid = msgid


@dataclass(frozen=True, slots=True)
class Request:
    msgid: int
    method: str
    params: list[Any]


@dataclass(frozen=True, slots=True)
class Notification:
    method: str
    params: list[Any]


@dataclass(frozen=True, slots=True)
class Response:
    msgid: int
    error: Any
    result: Any


Message: TypeAlias = Request | Notification | Response

def _packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def encode_request(msgid: int, method: str, params: Sequence[Any]) -> bytes:
    return _packb([REQUEST, msgid, method, params])


def encode_notification(method: str, params: Sequence[Any]) -> bytes:
    return _packb([NOTIFICATION, method, params])


def encode_response(msgid: int, result: Any) -> bytes:
    return _packb([RESPONSE, msgid, None, result])


def encode_error(msgid: int, code: ErrorCode, message: str) -> bytes:
    return _packb([RESPONSE, msgid, [int(code), message], None])


class RpcParser:
    """Bytes in, messages out, with the frame size capped.

    `receive_data(b"")` means end of stream. `next_event()` returns a `Request`,
    `Notification` or `Response` (which ones are allowed is the caller's
    business), `NEED_DATA`, or `ConnectionClosed`; it raises `RpcError` for bytes
    that are not MessagePack-RPC (close=True, sticky) or a frame over the cap.

    A frame is decoded only once all of it has arrived: a scanning Unpacker finds
    its end with `skip()`, which builds nothing. So declared lengths (a 2 GiB bin,
    nested arrays of 2**31 elements) allocate nothing before their bytes are here.
    """

    def __init__(self, *, max_frame: int = DEFAULT_MAX_FRAME,
                 max_batch: int = DEFAULT_MAX_BATCH, max_map_len: int = MAX_MAP_LEN) -> None:
        if max_frame < 64 or max_batch < 1:
            raise ValueError("max_frame must be >= 64 and max_batch >= 1")
        self.max_frame = max_frame
        self.max_batch = max_batch
        self._limits: dict[str, Any] = dict(
            max_str_len=max_frame, max_bin_len=max_frame, max_array_len=max(max_batch, 9),
            max_map_len=max_map_len, max_ext_len=0,
        )
        # read_size: the buffer it starts with (it grows to max_buffer_size as frames
        # need). Left out, msgpack starts at min(max_buffer_size, 1 MiB): 1 MiB of heap
        # for every RPC connection, even one that sends ten bytes.
        self._scanner = msgpack.Unpacker(max_buffer_size=max_frame + 1,
                                         read_size=min(max_frame + 1, SCANNER_START),
                                         **self._limits)
        self._scanner_frame = max_frame
        self._pending = bytearray()  # received, not yet fed to the scanner
        self._buf = bytearray()  # fed to the scanner; the current frame starts at _pos
        self._pos = 0
        self._fed = 0  # stream offset fed to the scanner
        self._frame_start = 0  # stream offset where the current frame begins
        self._eof = False
        #: (code, message, msgid) of the failure every later call raises again, as a new
        #: exception each time: one kept here would gather the frames of each raise in its
        #: traceback, and those frames hold this parser: a cycle that kept every failed
        #: connection's buffers until the garbage collector's next full pass.
        self._failed: tuple[ErrorCode, str, int | None] | None = None
        self.frames = 0

    def set_limits(self, max_frame: int, max_batch: int) -> None:
        """Caps for the frames that follow; max_frame no more than the parser was made
        with (its scanner's buffer is sized then)."""
        self.max_frame = min(max(64, max_frame), self._scanner_frame)
        self.max_batch = max(1, max_batch)
        self._limits.update(max_str_len=self.max_frame, max_bin_len=self.max_frame,
                            max_array_len=max(self.max_batch, 9))

    def receive_data(self, data: bytes | bytearray) -> None:
        if not data:
            self._eof = True
        else:
            self._pending += data

    @property
    def buffered_bytes(self) -> int:
        return len(self._pending) + len(self._buf) - self._pos

    def next_event(self) -> Message | NeedData | ConnectionClosed:
        if self._failed is not None:
            raise RpcError(*self._failed, close=True)
        while True:
            # (with every byte fed already scanned, the scanner could only raise
            # OutOfData: feed it first. So a read of whole frames, the usual one, raises
            # nothing, where each raise and catch costs more than the frame's scan)
            if self._fed == self._frame_start or not self._skip():
                if not self._feed():
                    if self._eof:
                        return ConnectionClosed(self._fed - self._frame_start)
                    return NEED_DATA
                continue
            end = self._scanner.tell()
            start, stop = self._pos, self._pos + (end - self._frame_start)
            try:
                with memoryview(self._buf) as view:
                    obj = msgpack.unpackb(view[start:stop], raw=False, use_list=True,
                                          strict_map_key=False, **self._limits)
            except Exception as exc:
                raise self._fail(*_unpack_error(exc)) from None
            self._frame_start = end
            self._pos = stop
            if self._pos == len(self._buf):
                self._buf.clear()
                self._pos = 0
            self.frames += 1
            return self._message(obj)

    def _skip(self) -> bool:
        """Scan past the next frame; False if its end has not arrived."""
        try:
            self._scanner.skip()
        except msgpack.OutOfData:
            return False
        except Exception as exc:  # FormatError, StackError, limits: the peer's bytes
            raise self._fail(*_unpack_error(exc)) from None
        return True

    def _feed(self) -> bool:
        """Feed pending bytes, no more than the frame cap allows. False if none left."""
        if not self._pending:
            return False
        room = self.max_frame - (self._fed - self._frame_start)
        if room <= 0:
            raise self._fail(ErrorCode.TOO_LARGE,
                             f"frame over the server's limit of {self.max_frame} bytes")
        chunk = bytes(self._pending[:room])
        del self._pending[:room]
        if self._pos:  # drop the frames already decoded (one shift per feed)
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += chunk
        self._scanner.feed(chunk)
        self._fed += len(chunk)
        return True

    def _fail(self, code: ErrorCode, message: str, *, msgid_known: bool = True) -> RpcError:
        msgid = _peek_msgid(bytes(self._buf[self._pos : self._pos + _PREFIX])) if (
            msgid_known) else None
        self._failed = (code, message, msgid)
        return RpcError(code, message, msgid, close=True)

    def _shape(self, message: str) -> RpcError:
        """A whole frame that is MessagePack but not a MessagePack-RPC message."""
        self._failed = (ErrorCode.MALFORMED, message, None)
        return RpcError(ErrorCode.MALFORMED, message, None, close=True)

    def _message(self, obj: Any) -> Message:
        if not isinstance(obj, list) or not obj or type(obj[0]) is not int:
            raise self._shape("a message must be an array [type, ...]")
        kind = obj[0]
        if kind == REQUEST and len(obj) == 4:
            _, msgid, method, params = obj
            if type(msgid) is not int or not 0 <= msgid <= MAX_MSGID:
                raise self._shape("msgid must be a 32-bit unsigned integer")
            if not isinstance(method, str) or not isinstance(params, list):
                # The frame was whole, so the connection can go on.
                raise RpcError(ErrorCode.MALFORMED,
                               "a request is [0, msgid, method (string), params (array)]",
                               msgid)
            return Request(msgid, method, params)
        if kind == NOTIFICATION and len(obj) == 3:
            _, method, params = obj
            if not isinstance(method, str) or not isinstance(params, list):
                raise self._shape("a notification is [2, method (string), params (array)]")
            return Notification(method, params)
        if kind == RESPONSE and len(obj) == 4:
            _, msgid, error, result = obj
            if type(msgid) is not int or not 0 <= msgid <= MAX_MSGID:
                raise self._shape("msgid must be a 32-bit unsigned integer")
            return Response(msgid, error, result)
        raise self._shape(f"unknown message shape (type {kind!r}, {len(obj)} elements)")


def _unpack_error(exc: Exception) -> tuple[ErrorCode, str]:
    text = str(exc)
    if "exceeds max_" in text and "max_ext_len" not in text:
        return ErrorCode.TOO_LARGE, f"frame over the server's limits: {text}"
    return ErrorCode.MALFORMED, f"not MessagePack: {text}" if text else "not MessagePack"


def _peek_msgid(prefix: bytes) -> int | None:
    """The msgid of a request from its first bytes, if they hold it."""
    u = msgpack.Unpacker(max_buffer_size=len(prefix) + 1)
    u.feed(prefix)
    try:
        if u.read_array_header() != 4 or u.unpack() != REQUEST:
            return None
        msgid = u.unpack()
    except Exception:
        return None
    return msgid if type(msgid) is int and 0 <= msgid <= MAX_MSGID else None


# -- calls: a request's params, checked and typed ----------------------------------------------


@dataclass(frozen=True, slots=True)
class Put:
    msgid: int
    queue: str
    items: list[bytes]
    expiration_ms: int  # relative; 0 = never
    flags: int = 0  # memcache flags of every item (u32), as a memcache `set` gives them
    delay_ms: int = 0  # > 0: the items stay invisible that long (delayed delivery)
    producer: bytes | None = None  # exactly-once puts: 1..64 bytes naming the producer
    sequence: int = 0  # with a producer: this put's number, 1..2**64-1
    #: the items' headers, a block each (queued.journal.headers; b"": none), or None
    headers: list[bytes] | None = None
    key: bytes | None = None  # a deduplication key: 1..64 bytes naming the whole put


@dataclass(frozen=True, slots=True)
class Get:
    msgid: int
    queue: str
    reader: str | None
    max_items: int
    timeout_ms: int
    auto_abort_ms: int  # 0 = items are removed; > 0 = open reads, aborted if not confirmed
    with_flags: bool = False  # items as [id, data, flags] rather than [id, data]
    with_deliveries: bool = False  # items as [id, data, flags, deliveries]
    with_headers: bool = False  # items as [id, data, flags, deliveries, headers]


@dataclass(frozen=True, slots=True)
class Confirm:
    msgid: int
    queue: str
    reader: str | None
    ids: list[int]


@dataclass(frozen=True, slots=True)
class Abort:
    msgid: int
    queue: str
    reader: str | None
    ids: list[int]
    delay_ms: int = 0  # abort only: the returned items wait that long first


@dataclass(frozen=True, slots=True)
class Extend:
    msgid: int
    queue: str
    reader: str | None
    ids: list[int]
    ms: int


@dataclass(frozen=True, slots=True)
class Reject:
    msgid: int
    queue: str
    reader: str | None
    ids: list[int]


@dataclass(frozen=True, slots=True)
class Pause:
    msgid: int
    queue: str
    on: bool  # pause (True) or resume


@dataclass(frozen=True, slots=True)
class Move:
    msgid: int
    queue: str  # the source
    reader: str | None
    destination: str
    max_items: int
    rate: int


@dataclass(frozen=True, slots=True)
class Browse:
    msgid: int
    queue: str
    reader: str | None
    after_id: int
    n: int
    with_headers: bool = False  # items as [id, data, flags, deliveries, headers]


@dataclass(frozen=True, slots=True)
class Peek:
    msgid: int
    queue: str
    reader: str | None


@dataclass(frozen=True, slots=True)
class Flush:
    msgid: int
    queue: str
    reader: str | None


@dataclass(frozen=True, slots=True)
class Delete:
    msgid: int
    queue: str
    reader: str | None


@dataclass(frozen=True, slots=True)
class FlushAll:
    msgid: int


@dataclass(frozen=True, slots=True)
class Stats:
    msgid: int


@dataclass(frozen=True, slots=True)
class Version:
    msgid: int


@dataclass(frozen=True, slots=True)
class Auth:
    msgid: int
    user: str
    password: str = field(repr=False)


Call: TypeAlias = (
    Put | Get | Confirm | Abort | Peek | Flush | Delete | FlushAll | Stats | Version | Auth
    | Extend | Reject | Pause | Move | Browse)


def _bad(msgid: int, message: str) -> RpcError:
    return RpcError(ErrorCode.BAD_PARAMS, message, msgid)


def _address(msgid: int, value: Any) -> tuple[str, str | None]:
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            raise RpcError(ErrorCode.BAD_QUEUE_NAME, "bad queue name", msgid) from None
    if not isinstance(value, str):
        raise _bad(msgid, "queue must be a string")
    queue, plus, reader = value.partition("+")
    if not is_valid_name(queue):
        raise RpcError(ErrorCode.BAD_QUEUE_NAME, f"bad queue name {queue[:60]!r}", msgid)
    if plus and not is_valid_name(reader):
        raise RpcError(ErrorCode.BAD_QUEUE_NAME, f"bad reader name {reader[:60]!r}", msgid)
    return queue, (reader if plus else None)


def _int(msgid: int, value: Any, what: str, lo: int, hi: int) -> int:
    if type(value) is not int:
        raise _bad(msgid, f"{what} must be an integer")
    if not lo <= value <= hi:
        raise _bad(msgid, f"{what} must be in [{lo}, {hi}]")
    return value


def _ids(msgid: int, value: Any, max_batch: int) -> list[int]:
    if not isinstance(value, list):
        raise _bad(msgid, "ids must be an array of integers")
    if len(value) > max_batch:
        raise RpcError(ErrorCode.TOO_LARGE, f"{len(value)} ids, over the limit of {max_batch}",
                       msgid, close=True)
    for i in value:
        if type(i) is not int or i <= 0:
            raise _bad(msgid, "ids must be positive integers")
    return value


def _arity(msgid: int, method: str, params: list[Any], lo: int, hi: int) -> None:
    if not lo <= len(params) <= hi:
        want = str(lo) if lo == hi else f"{lo} to {hi}"
        raise _bad(msgid, f"{method} takes {want} params, got {len(params)}")


def _headers(msgid: int, value: Any, n: int) -> list[bytes] | None:
    """put's headers param (its ninth): nil, one map (every item's), or an array of one
    map (or nil) per item; as a block per item, or None when no item has any."""
    if value is None:
        return None
    try:
        if isinstance(value, dict):
            block = encode_headers(value)
            return [block] * n if block else None
        if isinstance(value, list):
            if len(value) != n:
                raise _bad(msgid, f"headers: {len(value)} maps for {n} items (one per item, "
                                  "or one map for all)")
            blocks = list(map(encode_headers, value))
            return blocks if any(blocks) else None
    except ValueError as exc:
        raise _bad(msgid, f"headers: {exc}") from None
    raise _bad(msgid, "headers must be a map (every item's), or an array of one map (or nil) "
                      "per item")


def _put(r: Request, max_batch: int) -> Put:
    p = r.params
    _arity(r.msgid, "put", p, 2, 9)
    queue, reader = _address(r.msgid, p[0])
    if reader is not None:
        raise RpcError(ErrorCode.BAD_QUEUE_NAME,
                       "cannot put to a fanout reader; put to its queue", r.msgid)
    items = p[1]
    if not isinstance(items, list):
        raise _bad(r.msgid, "items must be an array of binary or string values")
    if len(items) > max_batch:
        raise RpcError(ErrorCode.TOO_LARGE, f"{len(items)} items, over the limit of {max_batch}",
                       r.msgid, close=True)
    if set(map(type, items)) - {bytes}:
        if not all(isinstance(it, (bytes, str)) for it in items):
            raise _bad(r.msgid, "items must be binary or string values")
        items = [it.encode() if isinstance(it, str) else it for it in items]
    expiration = _int(r.msgid, p[2], "expiration_ms", 0, 2**53) if len(p) > 2 else 0
    flags = _int(r.msgid, p[3], "flags", 0, MAX_FLAGS) if len(p) > 3 else 0
    delay = _int(r.msgid, p[4], "delay_ms", 0, MAX_DELAY_MS) if len(p) > 4 else 0
    headers = _headers(r.msgid, p[8], len(items)) if len(p) > 8 else None
    if len(p) > 7 and p[7] is not None:
        return _keyed_put(r.msgid, p, queue, items, expiration, flags, delay, headers)
    if len(p) < 6 or p[5] is None:
        return Put(r.msgid, queue, items, expiration, flags, delay, headers=headers)
    producer = p[5]
    if type(producer) is str:
        producer = producer.encode()
    if type(producer) is not bytes or not 0 < len(producer) <= MAX_PRODUCER_ID:
        raise _bad(r.msgid, f"producer must be 1 to {MAX_PRODUCER_ID} bytes")
    if len(p) < 7:
        raise _bad(r.msgid, "a put with a producer takes its sequence too")
    sequence = _int(r.msgid, p[6], "sequence", 1, MAX_SEQUENCE)
    if not items:
        raise _bad(r.msgid, "a put with a producer takes at least one item")
    return Put(r.msgid, queue, items, expiration, flags, delay, producer, sequence, headers)


def _keyed_put(msgid: int, p: list[Any], queue: str, items: list[bytes], expiration: int,
               flags: int, delay: int, headers: list[bytes] | None) -> Put:
    """A put with a deduplication key (the eighth param): not with a producer."""
    key = p[7]
    if type(key) is str:
        key = key.encode()
    if type(key) is not bytes or not 0 < len(key) <= MAX_DEDUP_KEY:
        raise _bad(msgid, f"key must be 1 to {MAX_DEDUP_KEY} bytes")
    if p[5] is not None:
        raise _bad(msgid, "a put takes a producer or a key, not both")
    if not items:
        raise _bad(msgid, "a put with a key takes at least one item")
    return Put(msgid, queue, items, expiration, flags, delay, headers=headers, key=key)


def _get(r: Request, max_batch: int) -> Get:
    p = r.params
    _arity(r.msgid, "get", p, 2, 7)
    queue, reader = _address(r.msgid, p[0])
    max_items = _int(r.msgid, p[1], "max_items", 1, 2**63)
    if max_items > max_batch:
        raise RpcError(ErrorCode.TOO_LARGE, f"max_items {max_items} is over the limit of "
                       f"{max_batch}", r.msgid, close=True)
    timeout = _int(r.msgid, p[2], "timeout_ms", 0, MAX_MS) if len(p) > 2 else 0
    auto_abort = _int(r.msgid, p[3], "auto_abort_ms", 0, MAX_MS) if len(p) > 3 else 0
    with_flags = p[4] if len(p) > 4 else False
    with_deliveries = p[5] if len(p) > 5 else False
    with_headers = p[6] if len(p) > 6 else False
    if not all(type(v) is bool for v in (with_flags, with_deliveries, with_headers)):
        raise _bad(r.msgid, "with_flags, with_deliveries and with_headers must be true or "
                            "false")
    return Get(r.msgid, queue, reader, max_items, timeout, auto_abort, with_flags,
               with_deliveries, with_headers)


def _ids_call(cls: type[Confirm] | type[Abort]) -> Callable[[Request, int], Confirm | Abort]:
    def parse(r: Request, max_batch: int) -> Confirm | Abort:
        p = r.params
        _arity(r.msgid, r.method, p, 2, 3 if cls is Abort else 2)
        queue, reader = _address(r.msgid, p[0])
        ids = _ids(r.msgid, p[1], max_batch)
        if len(p) > 2:
            return Abort(r.msgid, queue, reader, ids, _int(r.msgid, p[2], "delay_ms", 0,
                                                           MAX_DELAY_MS))
        return cls(r.msgid, queue, reader, ids)
    return parse


def _extend(r: Request, max_batch: int) -> Extend:
    """extend [queue, ids, ms]"""
    p = r.params
    _arity(r.msgid, "extend", p, 3, 3)
    queue, reader = _address(r.msgid, p[0])
    return Extend(r.msgid, queue, reader, _ids(r.msgid, p[1], max_batch),
                  _int(r.msgid, p[2], "ms", 0, MAX_MS))


def _reject(r: Request, max_batch: int) -> Reject:
    """reject [queue, ids]"""
    _arity(r.msgid, "reject", r.params, 2, 2)
    queue, reader = _address(r.msgid, r.params[0])
    return Reject(r.msgid, queue, reader, _ids(r.msgid, r.params[1], max_batch))


def _pause(on: bool) -> Callable[[Request, int], Pause]:
    def parse(r: Request, max_batch: int) -> Pause:
        _arity(r.msgid, r.method, r.params, 1, 1)
        queue, reader = _address(r.msgid, r.params[0])
        if reader is not None:
            raise RpcError(ErrorCode.BAD_QUEUE_NAME, f"{r.method} takes a queue, not a "
                           "fanout reader", r.msgid)
        return Pause(r.msgid, queue, on)
    return parse


def _move(r: Request, max_batch: int) -> Move:
    """move [source, destination, max_items=0, rate=0]"""
    p = r.params
    _arity(r.msgid, "move", p, 2, 4)
    queue, reader = _address(r.msgid, p[0])
    destination, into = _address(r.msgid, p[1])
    if into is not None:
        raise RpcError(ErrorCode.BAD_QUEUE_NAME,
                       "cannot move to a fanout reader; move to its queue", r.msgid)
    most = _int(r.msgid, p[2], "max_items", 0, 2**63) if len(p) > 2 else 0
    rate = _int(r.msgid, p[3], "rate", 0, 2**31) if len(p) > 3 else 0
    return Move(r.msgid, queue, reader, destination, most, rate)


def _browse(r: Request, max_batch: int) -> Browse:
    """browse [queue, after_id=0, n=100, with_headers=false]"""
    p = r.params
    _arity(r.msgid, "browse", p, 1, 4)
    queue, reader = _address(r.msgid, p[0])
    after = _int(r.msgid, p[1], "after_id", 0, 2**63) if len(p) > 1 else 0
    n = _int(r.msgid, p[2], "n", 1, min(max_batch, 10_000)) if len(p) > 2 else 100
    with_headers = p[3] if len(p) > 3 else False
    if type(with_headers) is not bool:
        raise _bad(r.msgid, "with_headers must be true or false")
    return Browse(r.msgid, queue, reader, after, n, with_headers)


def _queue_call(cls: type[Peek] | type[Flush] | type[Delete]) -> Callable[[Request, int], Call]:
    def parse(r: Request, max_batch: int) -> Call:
        _arity(r.msgid, r.method, r.params, 1, 1)
        return cls(r.msgid, *_address(r.msgid, r.params[0]))
    return parse


def _no_params(cls: type[FlushAll] | type[Stats] | type[Version]) -> Callable[[Request, int], Call]:
    def parse(r: Request, max_batch: int) -> Call:
        _arity(r.msgid, r.method, r.params, 0, 0)
        return cls(r.msgid)
    return parse


def _auth(r: Request, max_batch: int) -> Auth:
    """auth [user, password]; a refusal never quotes the params (a password)."""
    _arity(r.msgid, "auth", r.params, 2, 2)
    user, password = r.params
    if not isinstance(user, str) or not isinstance(password, str):
        raise _bad(r.msgid, "auth takes [user, password], two strings")
    return Auth(r.msgid, user, password)


#: method name -> parser of its params. The signatures are in docs/protocols.md.
METHODS: Final[dict[str, Callable[[Request, int], Call]]] = {
    "put": _put,
    "get": _get,
    "confirm": _ids_call(Confirm),
    "abort": _ids_call(Abort),
    "peek": _queue_call(Peek),
    "flush": _queue_call(Flush),
    "delete": _queue_call(Delete),
    "flush_all": _no_params(FlushAll),
    "stats": _no_params(Stats),
    "version": _no_params(Version),
    "auth": _auth,
    "extend": _extend,
    "reject": _reject,
    "pause": _pause(True),
    "resume": _pause(False),
    "move": _move,
    "browse": _browse,
}


def parse_call(request: Request, max_batch: int = DEFAULT_MAX_BATCH) -> Call:
    """A request's params checked and typed; raises RpcError (UNKNOWN_METHOD, BAD_PARAMS,
    BAD_QUEUE_NAME, or TOO_LARGE with close)."""
    parser = METHODS.get(request.method)
    if parser is None:
        raise RpcError(ErrorCode.UNKNOWN_METHOD, f"unknown method {request.method[:60]!r}",
                       request.msgid)
    return parser(request, max_batch)
