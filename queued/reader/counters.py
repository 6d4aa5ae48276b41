"""A reader's counters: what the reader, its delays and its live reader add to on every
item. A module of its own so that it is compiled (queued/reader/shared.py is not: its
empty containers subclass the builtins), and compiled code reads and adds to the
counters in the object's struct rather than by name.

PURE: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ReaderCounters:
    total_items: int = 0  # items added to this reader since start
    taken: int = 0  # items handed to clients (gets and open reads; an aborted item, taken
    # again, counts again)
    expired: int = 0
    discarded: int = 0
    transactions: int = 0  # reliable reads opened
    canceled_transactions: int = 0  # aborted, timed out or returned on disconnect
    flushes: int = 0
    rejected: int = 0  # open reads given up on (reject): to error_queue, or dropped
    age_ms: int = 0  # how long the last item taken had waited
