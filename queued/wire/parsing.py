"""What every protocol's parser shares: the receive buffer, NEED_DATA, ConnectionClosed,
queue-name and integer parsing, and the line-parser base with its sticky failure.

PURE: bytes in, values out; no sockets, clocks or trio. Every buffer here has a cap set
by its caller; nothing allocates what a peer merely declares.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from queued.errors import LocalProtocolError, QueuedError, RemoteProtocolError
from queued.sansio import MAX_DEDUP_KEY as MAX_DEDUP_KEY  # re-exported: what parsers share
from queued.sansio import MAX_DELAY_MS as MAX_DELAY_MS
from queued.sansio import MAX_TIMEOUT_MS as MAX_TIMEOUT_MS
from queued.sansio import NAME_PATTERN as NAME_PATTERN
from queued.sansio import NAME_RE as NAME_RE
from queued.sansio import NEED_DATA as NEED_DATA
from queued.sansio import NeedData as NeedData
from queued.sansio import Signal as Signal
from queued.sansio import is_valid_name as is_valid_name

_INT_RE: Final = re.compile(rb"-?[0-9]+")
#: A deduplication key as the memcache and text protocols carry it: printable ASCII but
#: `/` (memcache options follow the queue name after one). RPC keys may be any bytes.
_KEY_RE: Final = re.compile(rb"[!-.0-~]+")


@dataclass(frozen=True, slots=True)
class ConnectionClosed:
    """The peer ended the stream (receive_data(b"")); `unparsed` bytes of a command were lost."""

    unparsed: int = 0


@dataclass(frozen=True, slots=True)
class ParserStatistics:
    buffered_bytes: int  # received, not yet parsed
    skipping_bytes: int  # still to be discarded for a refused value
    failed: bool  # a closing error happened; the parser only re-raises it


class ArgumentError(QueuedError):
    """One argument failed validation; each parser turns it into its own wire reply."""


class LineOverflow(QueuedError):
    """No line end within the cap (raised by ReceiveBuffer.take_line)."""


# -- names and numbers ------------------------------------------------------------------------


def parse_name(token: bytes, what: str) -> str:
    if NAME_RE.fullmatch(token) is None:
        raise ArgumentError(f"bad {what} name")
    return token.decode("ascii")


def parse_address(token: bytes) -> tuple[str, str | None]:
    """`q` -> (q, None); `q+r` -> (q, r), fanout reader r of queue q. Raises ArgumentError."""
    queue, plus, reader = token.partition(b"+")
    return parse_name(queue, "queue"), (parse_name(reader, "reader") if plus else None)


def parse_queue(token: bytes) -> str:
    """A plain queue name (no reader), as writes need. Raises ArgumentError."""
    queue, reader = parse_address(token)
    if reader is not None:
        raise ArgumentError("cannot write to a fanout reader; write to its queue")
    return queue


def parse_int(token: bytes, what: str, lo: int, hi: int) -> int:
    """A decimal integer in [lo, hi]; never int()'s leniency (`_`, `+`, spaces, unicode)."""
    if _INT_RE.fullmatch(token) is None:
        raise ArgumentError(f"bad {what}")
    if len(token) > 20 or not lo <= int(token) <= hi:  # length first: int() of huge strings
        raise ArgumentError(f"{what} out of range")
    return int(token)


def parse_dedup_key(token: bytes) -> bytes:
    """A put's deduplication key (`key=<k>`): 1 to MAX_DEDUP_KEY printable ASCII
    characters other than `/`. Raises ArgumentError."""
    if not token or len(token) > MAX_DEDUP_KEY:
        raise ArgumentError(f"deduplication key must be 1 to {MAX_DEDUP_KEY} characters")
    if _KEY_RE.fullmatch(token) is None:
        raise ArgumentError("deduplication key must be printable ASCII without '/'")
    return token


def parse_put_options(options: Iterable[bytes], command: str) -> tuple[int, bytes | None]:
    """A put's options, `delay=<ms>` and `key=<k>`, each at most once, in any order (the
    memcache `set q/delay=<ms>/key=<k>`, the text `put q delay=<ms> key=<k>:`): (delay ms,
    deduplication key or None). `command` names the command in the error. Raises
    ArgumentError at the first option that is unknown, repeated or has a bad value."""
    delay, seen = 0, set[bytes]()
    key: bytes | None = None
    for option in options:
        opt, eq, value = option.partition(b"=")
        if not eq or opt in seen or opt not in (b"delay", b"key"):
            raise ArgumentError(f"unknown or repeated {command} option (delay=<ms>, key=<k>)")
        seen.add(opt)
        if opt == b"key":
            key = parse_dedup_key(value)
        else:
            delay = parse_int(value, "delay", 0, MAX_DELAY_MS)
    return delay, key


# -- the receive buffer -------------------------------------------------------------------------


class ReceiveBuffer:
    """Bytes received but not yet parsed, consumed from the front without O(n) shifts.

    The usual read holds whole requests: it becomes the buffer as it is (no copy), and
    a line or a data block is one slice of it. Bytes that arrive while some are still
    unparsed wait in a list (no copy either: a big data block arriving read by read is
    not copied once per read) and are joined to the unparsed rest, once, when a line
    is looked for or a block's bytes are all there."""

    __slots__ = ("_buf", "_more", "_parts", "_pos", "_scanned", "eof")

    def __init__(self) -> None:
        self._buf = b""  # unparsed from _pos on
        self._pos = 0
        self._parts: list[bytes] = []  # received after _buf, not joined to it yet
        self._more = 0  # their bytes
        self._scanned = 0  # bytes after _pos known to hold no b"\n"
        self.eof = False

    def __len__(self) -> int:
        return len(self._buf) - self._pos + self._more

    def append(self, data: bytes | bytearray | memoryview) -> None:
        chunk = data if isinstance(data, bytes) else bytes(data)
        if not chunk:
            return
        if self._more or self._pos < len(self._buf):
            self._parts.append(chunk)
            self._more += len(chunk)
        else:
            self._buf = chunk
            self._pos = 0
            self._scanned = 0

    def _join(self) -> None:
        """Every buffered byte in `_buf`, from `_pos` = 0 (`_scanned` still holds)."""
        pos = self._pos
        rest = self._buf[pos:] if pos else self._buf
        self._parts.insert(0, rest)
        self._buf = b"".join(self._parts)
        self._parts.clear()
        self._pos = 0
        self._more = 0

    def take_line(self, limit: int) -> bytes | None:
        """The next line without its `\\n` or `\\r\\n`, or None if incomplete.

        Raises LineOverflow when more than `limit` bytes precede the line end.
        """
        if self._more:
            self._join()
        buf, pos = self._buf, self._pos
        i = buf.find(b"\n", pos + self._scanned, pos + limit + 2)
        if i < 0:
            n = len(buf) - pos
            if n >= limit + 2:
                raise LineOverflow(f"line longer than {limit} bytes")
            self._scanned = n
            return None
        end = i - 1 if i > pos and buf[i - 1] == 13 else i  # (without its \r)
        self._pos = i + 1
        self._scanned = 0
        if end - pos > limit:
            raise LineOverflow(f"line longer than {limit} bytes")
        return buf[pos:end]

    def take(self, n: int) -> bytes | None:
        """Exactly `n` bytes, or None if fewer are buffered."""
        if len(self) < n:
            return None
        pos = self._pos
        if pos + n > len(self._buf):
            self._join()
            pos = 0
        self._pos = end = pos + n
        self._scanned = 0
        return self._buf[pos:end]

    def take_block(self, n: int) -> bytes | None:
        """`n` bytes followed by CRLF (both consumed; the data returned), None if fewer
        than n + 2 are buffered or the CRLF is not there (nothing consumed then)."""
        pos = self._pos
        end = pos + n
        if len(self._buf) < end + 2:
            if len(self) < n + 2:
                return None
            self._join()
            pos, end = 0, n
        buf = self._buf
        if buf[end] != 13 or buf[end + 1] != 10:
            return None
        self._pos = end + 2
        self._scanned = 0
        return buf[pos:end]

    def peek(self, start: int, end: int) -> bytes:
        """Buffered bytes [start, end) counted from the first unread byte, left unread."""
        stop = min(end, len(self))
        if self._pos + stop > len(self._buf):
            self._join()
        pos = self._pos
        return self._buf[pos + start : pos + stop]

    def skip(self, n: int) -> int:
        """Drop up to `n` bytes; returns how many were dropped."""
        n = min(n, len(self))
        if self._pos + n > len(self._buf):
            self._join()
        self._pos += n
        self._scanned = 0
        return n


# -- the line-parser base ---------------------------------------------------------------------

E = TypeVar("E")


class LineParser(Generic[E]):
    """h11's shape for a line protocol: receive_data(bytes), next_event() -> event or
    NEED_DATA. A closing RemoteProtocolError is sticky: every later next_event() raises it
    again and received bytes are dropped. Subclasses implement `_next`."""

    def __init__(self) -> None:
        self.buffer = ReceiveBuffer()
        self.failure: RemoteProtocolError | None = None

    def receive_data(self, data: bytes | bytearray) -> None:
        """Append received bytes; b"" means the peer closed (feed it once)."""
        if self.buffer.eof:
            raise LocalProtocolError("receive_data() after end of stream")
        if not data:
            self.buffer.eof = True
        elif self.failure is None:
            self._accept(data)

    def _accept(self, data: bytes | bytearray) -> None:
        self.buffer.append(data)

    def in_request(self) -> bool:
        """A request has begun to arrive and is not complete."""
        return len(self.buffer) > 0

    def next_event(self) -> E | ConnectionClosed | NeedData:
        """The next command, ConnectionClosed, or NEED_DATA; raises RemoteProtocolError."""
        if self.failure is not None:
            raise self.failure
        try:
            return self._next()
        except RemoteProtocolError as e:
            if e.close:
                self.failure = e
            raise

    def _next(self) -> E | ConnectionClosed | NeedData:
        raise NotImplementedError
