"""Whether the server is ready to take writes (/readyz, the `queued_ready` gauge), and why
not, told to each asker as far as it may know.

Owns the list of reasons and what each names: an admin (or anyone, on a server without
users) reads every reason in full; a logged-in user reads in full those of the queues it
may see; anyone else, a probe without credentials above all, reads only what kind of
trouble it is, naming no queue, path or error. Reads the server; changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

import trio

from queued.server.metrics import disk_usage

if TYPE_CHECKING:
    from queued.broker.broker import Broker

#: Below this many free bytes the data dir counts as full (/readyz fails).
DISK_FULL_BYTES: Final = 1 << 20


class Probed(Protocol):
    """What readiness reads from the server (`queued.server.listeners.Server`)."""

    @property
    def broker(self) -> Broker: ...
    @property
    def closing(self) -> bool: ...
    @property
    def shutdown_requested(self) -> trio.Event: ...
    @property
    def unwritable(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class Reason:
    """One reason the server is not ready: in full, and as a stranger reads it."""

    detail: str  # what an admin reads
    general: str  # names nothing: no queue, no path, no error text
    queue: str | None = None  # the queue it is about, if one


def reasons(server: Probed | None) -> list[Reason]:
    """Why `server` (None: still recovering) is not ready; [] when it is."""
    if server is None:
        return [Reason("recovering the journals", "recovering the journals")]
    if server.closing or server.shutdown_requested.is_set():
        return [Reason("shutting down", "shutting down")]
    found = [Reason(f"queue {name}: {qs.journal.failed}", "a queue's journal refuses writes",
                    name)
             for name, qs in sorted(server.broker.queues.items())  # (a failed one never parks)
             if qs.journal.failed is not None]
    if server.unwritable is not None:  # the last write probe (every DISK_CHECK_SECONDS)
        found.append(Reason(server.unwritable, "the data dir is not writable"))
    path = server.broker.datadir.path
    disk = disk_usage(path)
    if disk is None:
        found.append(Reason(f"data dir {path}: cannot read its file system",
                            "the data dir's file system cannot be read"))
    elif disk.free < DISK_FULL_BYTES:
        found.append(Reason(f"data dir {path}: disk full ({disk.free} bytes free)",
                            "disk full"))
    return found


def told(found: list[Reason], sees: Callable[[str], bool] | None) -> list[str]:
    """The lines of `found` for an asker: `sees` None reads everything in full (an admin,
    or no users configured); else each reason about a queue `sees` accepts in full and the
    rest in general, each general line once."""
    if sees is None:
        return [r.detail for r in found]
    lines: list[str] = []
    for r in found:
        line = r.detail if r.queue is not None and sees(r.queue) else r.general
        if line not in lines:
            lines.append(line)
    return lines
