"""Whether a write task's rows ended where Spark meant them to, or the task failed upstream.

PySpark hands a Python data source writer its rows as an iterator that ends quietly both
when they are all there and when the task failed before the writer (a source, a UDF, a
fetch): the JVM then half-closes the Python worker's socket, the Arrow stream ends early,
and `write()` returns as if done (PySpark 4.3; its commit message is dropped). A writer
with exactly-once puts must not put the last, partial chunk of such an input: the
re-run cuts that chunk longer, under another producer id, and would store its rows twice.

PySpark's worker protocol follows a complete input with an END_OF_STREAM marker on the
same socket, and a truncated one with end of file. `InputEnd` finds the worker's stream
behind the iterator (the one its Arrow reader reads: PySpark internals, so it may not be
found) before the rows are read, and peeks at it after. Never reads a byte of it.
"""

from __future__ import annotations

import gc
import logging
import threading
from typing import Any

log = logging.getLogger("queued.spark")

#: Objects looked at while looking for the stream behind an iterator.
_MAX_LOOKS = 200
#: Seconds to wait for the marker after the last row before calling it unknown.
_PATIENCE = 10.0


def _find_stream(iterator: Any) -> Any | None:
    """The buffered socket stream PySpark's Arrow reader reads, behind `iterator` (a chain of
    maps, tuples and generators), or None."""
    todo: list[Any] = [iterator]
    seen: set[int] = set()
    while todo and len(seen) < _MAX_LOOKS:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        frame = getattr(obj, "gi_frame", None)
        if frame is not None:
            for value in frame.f_locals.values():
                if hasattr(value, "peek") and hasattr(value, "fileno"):
                    return value
                todo.append(value)
        elif isinstance(obj, map | tuple | list):
            todo.extend(gc.get_referents(obj))
    return None


class InputEnd:
    """Made before a task reads its rows; `truncated()` after: True when the input ended
    early (the task failed upstream), False when it is complete, None when unknown."""

    def __init__(self, iterator: Any) -> None:
        try:
            self.stream = _find_stream(iterator)
        except Exception:
            self.stream = None

    def truncated(self) -> bool | None:
        stream = self.stream
        if stream is None:
            return None
        # A peek reads the socket when the stream's buffer is empty, and could wait: a
        # thread does it (the worker's own next read waits for the stream's lock, then
        # reads the bytes the peek left).
        seen: list[bytes | None] = []

        def peek() -> None:
            try:
                seen.append(stream.peek(4))
            except (OSError, ValueError):  # closed meanwhile: the task is going down
                seen.append(None)

        waiter = threading.Thread(target=peek, name="queued-sink-input-end", daemon=True)
        waiter.start()
        waiter.join(_PATIENCE)
        if not seen:
            log.warning("queued sink: no end marker from Spark %.0f s after the last row; "
                        "taking the input as complete", _PATIENCE)
            return None
        return not seen[0]
