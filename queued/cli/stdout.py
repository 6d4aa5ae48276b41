"""The client commands' standard output, and how much of it its reader has taken.

Owns writing to stdout and telling, when stdout is a pipe, how many of the bytes written
the reader has read out of it (Linux's FIONREAD on the write end; elsewhere, or on a
file or a terminal, whatever was written counts as taken) and whether the reader has
closed its end. `queued get` confirms an item only once its line left the pipe, so a
reader that stops early (`| head -1`) takes nothing it did not read. It never talks to a
server and never decides what to confirm: the caller does, by byte offsets.
"""

from __future__ import annotations

import array
import fcntl
import os
import select
import stat
import termios
from typing import BinaryIO

#: poll() events that mean the reader's end is closed (or the descriptor is bad).
_GONE = select.POLLERR | select.POLLHUP | select.POLLNVAL


class Stdout:
    """`stream` (stdout's bytes) with a count of the bytes written and of those taken."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.fd = stream.fileno()
        self.written = 0
        #: A pipe: what was written may still sit in it, unread.
        self.pipe = stat.S_ISFIFO(os.fstat(self.fd).st_mode)
        self._poll = select.poll()
        self._poll.register(self.fd, 0)  # no events asked: only errors and hang-ups wake it

    def write(self, data: bytes) -> None:
        """Write and flush `data`; raises BrokenPipeError when the reader is gone."""
        self.stream.write(data)
        self.stream.flush()
        self.written += len(data)

    def taken(self) -> int:
        """How many of the bytes written the reader has read (all, unless a pipe)."""
        if not self.pipe:
            return self.written
        unread = array.array("i", [0])
        try:
            fcntl.ioctl(self.fd, termios.FIONREAD, unread, True)
        except OSError:  # a system without FIONREAD on a pipe's write end: cannot tell
            self.pipe = False
            return self.written
        return self.written - unread[0]

    def reader_gone(self, wait_ms: int) -> bool:
        """Whether the reader has closed its end, waiting up to `wait_ms` for it to."""
        return any(events & _GONE for _, events in self._poll.poll(wait_ms))
