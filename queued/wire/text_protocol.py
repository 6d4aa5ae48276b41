"""Kestrel's line "text" protocol (port 2222): a sans-IO parser and the reply encoders.

Owns line framing, `put <queue>:` item blocks, argument checks and the reply bytes
(`:data`, `*`, `+count`, `-message`, each ending in `\\n`, as Kestrel's TextHandler).
PURE: no sockets, files, clocks or trio; it never buffers past its caps.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Final, TypeAlias

from queued.errors import (
    BadCommand,
    LineTooLong,
    LocalProtocolError,
    TooLarge,
    UnknownCommand,
)
from queued.wire.parsing import (
    MAX_TIMEOUT_MS,
    NEED_DATA,
    ArgumentError,
    ConnectionClosed,
    LineOverflow,
    LineParser,
    NeedData,
    ParserStatistics,
    parse_address,
    parse_int,
    parse_put_options,
    parse_queue,
)

DEFAULT_MAX_LINE: Final = 2048
DEFAULT_MAX_ITEM_SIZE: Final = 64 * 1024  # one item is one line
DEFAULT_MAX_PUT_ITEMS: Final = 1024  # Kestrel's MAX_PUT_BUFFER
DEFAULT_MAX_PUT_BYTES: Final = 4 * 1024 * 1024

# -- commands -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Put:
    queue: str
    items: tuple[bytes, ...]
    expiry_ms: int | None = None  # relative milliseconds, as Kestrel's `put <queue> [expiry]:`
    delay_ms: int = 0  # ours: `put <queue> [expiry_ms] delay=<ms>:`
    key: bytes | None = None  # ours: `put <queue> [expiry_ms] key=<k>:` (deduplication)


@dataclass(frozen=True, slots=True)
class Get:
    queue: str
    timeout_ms: int = 0
    reader: str | None = None
    deliveries: bool = False  # `get <q> [timeout_ms] deliveries`: `:<count> <item>`


@dataclass(frozen=True, slots=True)
class Peek:
    queue: str
    timeout_ms: int = 0
    reader: str | None = None


@dataclass(frozen=True, slots=True)
class Monitor:
    queue: str
    timeout_ms: int
    max_items: int | None = None
    reader: str | None = None


@dataclass(frozen=True, slots=True)
class Confirm:
    queue: str
    count: int
    reader: str | None = None


@dataclass(frozen=True, slots=True)
class Flush:
    queue: str
    reader: str | None = None


@dataclass(frozen=True, slots=True)
class Delete:
    queue: str
    reader: str | None = None


@dataclass(frozen=True, slots=True)
class Version:
    pass


@dataclass(frozen=True, slots=True)
class Auth:
    """`auth <user> <password>`: the password is the rest of the line."""

    user: str
    password: str = field(repr=False)


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class Quit:
    pass


@dataclass(frozen=True, slots=True)
class Touch:
    """`touch <queue> <ms>`: the connection's open reads on it (a monitor's) get `ms` more."""

    queue: str
    ms: int
    reader: str | None = None


@dataclass(frozen=True, slots=True)
class Pause:
    """`pause <queue>` (on) or `resume <queue>`."""

    queue: str
    on: bool = True


Command: TypeAlias = (
    Put | Get | Peek | Monitor | Confirm | Flush | Delete | Version | Shutdown | Quit | Auth
    | Touch | Pause
)
Event: TypeAlias = Command | ConnectionClosed

# -- reply encoders -------------------------------------------------------------------------


def item(data: bytes) -> bytes:
    """`:<data>`. An item holding `\\n` cannot be framed here: LocalProtocolError."""
    if b"\n" in data:
        raise LocalProtocolError("item contains a newline; the text protocol cannot carry it")
    return b":" + data + b"\n"


def empty() -> bytes:
    """`*`: no item (get/peek timed out, or the end of a monitor)."""
    return b"*\n"


def count(n: int) -> bytes:
    """`+<n>`: items stored by put, confirmed by confirm; `+0` acknowledges flush/delete."""
    return b"+%d\n" % n


def error(msg: str) -> bytes:
    # Messages may quote peer input: keep them on one printable line.
    return b"-" + "".join(c if " " <= c <= "~" else "?" for c in msg).encode("ascii") + b"\n"


def version(v: str) -> bytes:
    """Kestrel answers `version` with a string response, `:<version>`."""
    return item(v.encode("ascii", "replace"))


# -- parser ---------------------------------------------------------------------------------


class _State(enum.Enum):
    LINE = "line"  # waiting for a command line
    PUT = "put"  # collecting the item lines of a put
    DISCARD = "discard"  # dropping the rest of a refused put, up to its blank line


class TextParser(LineParser["Command"]):
    """Bytes in (receive_data), commands out (next_event), in order, until NEED_DATA.

    Lines end in `\\n` (a preceding `\\r` is dropped). Blank lines between commands are
    ignored. A refused put (bad header, too many items or bytes) raises once and its
    remaining lines are dropped up to the blank line, so the connection stays in step.
    A line over its cap (max_line for commands, max_item_size for items) closes.
    """

    def __init__(
        self,
        *,
        max_line: int = DEFAULT_MAX_LINE,
        max_item_size: int = DEFAULT_MAX_ITEM_SIZE,
        max_put_items: int = DEFAULT_MAX_PUT_ITEMS,
        max_put_bytes: int = DEFAULT_MAX_PUT_BYTES,
    ) -> None:
        if max_line < 16 or max_item_size < 1 or max_put_items < 1 or max_put_bytes < 0:
            raise ValueError("caps too small")
        self.max_line = max_line
        self.max_item_size = max_item_size
        self.max_put_items = max_put_items
        self.max_put_bytes = max_put_bytes
        super().__init__()
        self._state = _State.LINE
        self._put: tuple[str, int | None, int, bytes | None] | None = None
        self._items: list[bytes] = []
        self._put_size = 0

    def in_request(self) -> bool:
        return self._state is not _State.LINE or len(self.buffer) > 0

    def statistics(self) -> ParserStatistics:
        return ParserStatistics(len(self.buffer) + self._put_size, 0, self.failure is not None)

    def _next(self) -> Event | NeedData:
        while True:
            limit = self.max_line if self._state is _State.LINE else self.max_item_size
            try:
                line = self.buffer.take_line(limit)
            except LineOverflow as e:
                raise LineTooLong(str(e), reply=error("Line too long."), close=True) from None
            if line is None:
                if self.buffer.eof:
                    return ConnectionClosed(len(self.buffer) + self._put_size)
                return NEED_DATA
            if self._state is _State.LINE:
                event = self._command(line)
                if event is not None:
                    return event
            elif self._state is _State.DISCARD:
                if not line:
                    self._state = _State.LINE
            elif line:
                self._add_item(line)
            else:
                assert self._put is not None
                put = Put(self._put[0], tuple(self._items), *self._put[1:])
                self._end_put(_State.LINE)
                return put

    def _add_item(self, line: bytes) -> None:
        if len(self._items) >= self.max_put_items:
            self._end_put(_State.DISCARD)
            msg = f"Too many items in one put (max {self.max_put_items})."
            raise TooLarge(msg, reply=error(msg), close=False)
        if self._put_size + len(line) > self.max_put_bytes:
            self._end_put(_State.DISCARD)
            msg = f"Put larger than {self.max_put_bytes} bytes."
            raise TooLarge(msg, reply=error(msg), close=False)
        self._items.append(line)
        self._put_size += len(line)

    def _end_put(self, state: _State) -> None:
        self._state = state
        self._put = None
        self._items = []
        self._put_size = 0

    def _command(self, line: bytes) -> Command | None:
        """An event, or None for a blank line or a put header (its items follow)."""
        line = line.rstrip()
        tokens = line.split()
        if not tokens:
            return None
        name = tokens[0].lower()
        if name in (b"put", b"put:"):
            self._put_header(line)
            return None
        if name == b"auth":
            return _auth(line)
        try:
            return self._simple(name, tokens[1:])
        except ArgumentError as e:
            raise BadCommand(str(e), reply=error(str(e)), close=False) from None

    def _put_header(self, line: bytes) -> None:
        if not line.endswith(b":"):
            msg = "A put needs a trailing ':' and its items on the next lines."
            raise BadCommand(msg, reply=error(msg), close=False)
        args = line[:-1].split()[1:]
        try:
            options = []
            while len(args) > 1 and b"=" in args[-1]:  # options, last first
                options.append(args.pop())
            delay, key = parse_put_options(options, "put")
            _arity(args, 1, 2, "put <queue> [expiry_ms] [delay=<ms>] [key=<k>]:")
            queue = parse_queue(args[0])
            expiry = parse_int(args[1], "expiry", 0, MAX_TIMEOUT_MS) if len(args) > 1 else None
        except ArgumentError as e:
            self._end_put(_State.DISCARD)  # its items follow anyway: keep in step
            raise BadCommand(str(e), reply=error(str(e)), close=False) from None
        self._put = (queue, expiry, delay, key)
        self._state = _State.PUT

    def _simple(self, name: bytes, args: list[bytes]) -> Command:
        if name == b"get" and len(args) > 1 and args[-1] == b"deliveries":
            _arity(args, 2, 3, "get <queue> [timeout_ms] deliveries")
            queue, reader = parse_address(args[0])
            timeout = parse_int(args[1], "timeout", 0, MAX_TIMEOUT_MS) if len(args) > 2 else 0
            return Get(queue, timeout, reader, deliveries=True)
        if name in (b"get", b"peek"):
            _arity(args, 1, 2, f"{name.decode()} <queue> [timeout_ms]")
            queue, reader = parse_address(args[0])
            timeout = parse_int(args[1], "timeout", 0, MAX_TIMEOUT_MS) if len(args) > 1 else 0
            return (Get if name == b"get" else Peek)(queue, timeout, reader)
        if name == b"touch":
            _arity(args, 2, 2, "touch <queue> <ms>")
            queue, reader = parse_address(args[0])
            return Touch(queue, parse_int(args[1], "ms", 0, MAX_TIMEOUT_MS), reader)
        if name in (b"pause", b"resume"):
            _arity(args, 1, 1, f"{name.decode()} <queue>")
            return Pause(parse_queue(args[0]), name == b"pause")
        if name == b"monitor":
            _arity(args, 2, 3, "monitor <queue> <timeout_ms> [max_items]")
            queue, reader = parse_address(args[0])
            timeout = parse_int(args[1], "timeout", 0, MAX_TIMEOUT_MS)
            most = parse_int(args[2], "max_items", 1, MAX_TIMEOUT_MS) if len(args) > 2 else None
            return Monitor(queue, timeout, most, reader)
        if name == b"confirm":
            _arity(args, 2, 2, "confirm <queue> <count>")
            queue, reader = parse_address(args[0])
            return Confirm(queue, parse_int(args[1], "count", 0, MAX_TIMEOUT_MS), reader)
        if name in (b"flush", b"delete"):
            _arity(args, 1, 1, f"{name.decode()} <queue>")
            return (Flush if name == b"flush" else Delete)(*parse_address(args[0]))
        simple: dict[bytes, Command] = {
            b"version": Version(), b"shutdown": Shutdown(), b"quit": Quit(),
        }
        if name in simple:
            _arity(args, 0, 0, name.decode())
            return simple[name]
        shown = name[:40].decode("latin-1")
        raise UnknownCommand(f"unknown command {shown!r}",
                             reply=error(f"Unknown command: {shown}"), close=False)


def _auth(line: bytes) -> Auth:
    """`auth <user> <password>`; the message of a refusal never quotes the line."""
    parts = line.split(None, 2)
    if len(parts) != 3:
        msg = "Usage: auth <user> <password>"
        raise BadCommand(msg, reply=error(msg), close=False)
    try:
        return Auth(parts[1].decode(), parts[2].decode())
    except UnicodeDecodeError:
        msg = "auth: user and password must be UTF-8"
        raise BadCommand(msg, reply=error(msg), close=False) from None


def _arity(args: list[bytes], lo: int, hi: int, usage: str) -> None:
    if not lo <= len(args) <= hi:
        raise ArgumentError(f"Usage: {usage}")
