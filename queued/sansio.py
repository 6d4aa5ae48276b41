"""What every sans-IO parser and file format shares: NEED_DATA, the name rule for queues and
readers, the limits on timeouts, delays and deduplication keys, and the rule for item
headers.

PURE: no I/O. The wire codecs (queued.wire) and the journal format (queued.journal) both
import it; it imports nothing of queued.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from typing import Any, Final, Literal, TypeAlias

#: Queue and reader names become file names: `[A-Za-z0-9_:-]{1,250}`.
NAME_PATTERN: Final = rb"[A-Za-z0-9_:-]{1,250}"
NAME_RE: Final = re.compile(NAME_PATTERN)
#: Timeouts are capped as Kestrel's are: it parses them as a Java Int.
MAX_TIMEOUT_MS: Final = (1 << 31) - 1
#: Longest delay a put or an abort may ask for (memcache, text, RPC): 10 years, in ms;
#: due times stay far inside the journal's i64 and inside what a client can mean.
MAX_DELAY_MS: Final = 10 * 366 * 24 * 3600 * 1000
#: Item headers: at most this many entries, and this many bytes of keys and values in all
#: (UTF-8 for strings), so a header never costs more than a small item.
MAX_HEADERS: Final = 64
MAX_HEADERS_SIZE: Final = 16 * 1024

#: A header value as given and as returned: bytes, or a string (kept as a string).
HeaderValue: TypeAlias = bytes | str
#: Longest deduplication key a put may carry (memcache, text, RPC; the DEDUP record's cap).
MAX_DEDUP_KEY: Final = 64

class Signal(enum.Enum):
    NEED_DATA = "NEED_DATA"

NEED_DATA: Final = Signal.NEED_DATA
NeedData: TypeAlias = Literal[Signal.NEED_DATA]

def is_valid_name(name: str) -> bool:
    """True if `name` may be a queue or reader name (they become file names)."""
    return name.isascii() and NAME_RE.fullmatch(name.encode("ascii")) is not None


def header_entries(headers: Mapping[Any, Any]) -> list[tuple[str, bytes, bool]]:
    """The entries of an item's `headers` (key, value bytes, value was a string), in
    order, checked against the rule: string keys (not empty), bytes or string values, at
    most MAX_HEADERS entries and MAX_HEADERS_SIZE bytes of keys and values (UTF-8) in
    all. ValueError says what is wrong."""
    if not isinstance(headers, Mapping):
        raise ValueError(f"headers must be a map of string keys to bytes or string values, "
                         f"not {type(headers).__name__}")
    if len(headers) > MAX_HEADERS:
        raise ValueError(f"{len(headers)} headers, over the limit of {MAX_HEADERS}")
    out: list[tuple[str, bytes, bool]] = []
    size = 0
    for key, value in headers.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"header key {key!r}: keys must be non-empty strings")
        text = isinstance(value, str)
        if not text and not isinstance(value, bytes | bytearray | memoryview):
            raise ValueError(f"header {key!r}: values must be bytes or strings, not "
                             f"{type(value).__name__}")
        try:
            raw = value.encode() if text else bytes(value)
            size += len(key.encode()) + len(raw)
        except UnicodeEncodeError as exc:
            raise ValueError(f"header {key[:40]!r}: not valid UTF-8 ({exc.reason})") from None
        if size > MAX_HEADERS_SIZE:
            raise ValueError(f"headers over the limit of {MAX_HEADERS_SIZE} bytes of keys and "
                             "values in all")
        out.append((key, raw, text))
    return out
