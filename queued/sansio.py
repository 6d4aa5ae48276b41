"""What every sans-IO parser and file format shares: NEED_DATA, the name rule for queues and
readers, and the limits on timeouts, delays and deduplication keys.

PURE: no I/O. The wire codecs (queued.wire) and the journal format (queued.journal) both
import it; it imports nothing of queued.
"""

from __future__ import annotations

import enum
import re
from typing import Final, Literal, TypeAlias

#: Queue and reader names become file names: `[A-Za-z0-9_:-]{1,250}`.
NAME_PATTERN: Final = rb"[A-Za-z0-9_:-]{1,250}"
NAME_RE: Final = re.compile(NAME_PATTERN)
#: Timeouts are capped as Kestrel's are: it parses them as a Java Int.
MAX_TIMEOUT_MS: Final = (1 << 31) - 1
#: Longest delay a put or an abort may ask for (memcache, text, RPC): 10 years, in ms;
#: due times stay far inside the journal's i64 and inside what a client can mean.
MAX_DELAY_MS: Final = 10 * 366 * 24 * 3600 * 1000
#: Longest deduplication key a put may carry (memcache, text, RPC; the DEDUP record's cap).
MAX_DEDUP_KEY: Final = 64

class Signal(enum.Enum):
    NEED_DATA = "NEED_DATA"

NEED_DATA: Final = Signal.NEED_DATA
NeedData: TypeAlias = Literal[Signal.NEED_DATA]

def is_valid_name(name: str) -> bool:
    """True if `name` may be a queue or reader name (they become file names)."""
    return name.isascii() and NAME_RE.fullmatch(name.encode("ascii")) is not None
