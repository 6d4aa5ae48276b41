"""The one error tree of queued, rooted at QueuedError.

Owns exception types only; it must never import I/O or protocol code.
A remote protocol error (the peer's fault) carries its wire reply and whether the
connection closes; a local one (ours) is a bug, as in h11.
"""

from __future__ import annotations


class QueuedError(Exception):
    """Base of every error queued raises on purpose."""


class JournalError(QueuedError):
    """Something about the on-disk journal."""


class CorruptRecordError(JournalError):
    """Bytes that are not a valid record (bad header, bad size, checksum mismatch)."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"corrupt record at offset {offset}: {reason}")
        self.offset = offset
        self.reason = reason


class BadMagicError(CorruptRecordError):
    """The file does not start with the magic bytes of the expected kind."""


class ChecksumMismatchError(CorruptRecordError):
    """A checksum record does not match the bytes it covers."""


class CorruptJournalError(JournalError):
    """Corruption in the middle of a segment: data after the damage was acknowledged."""


class JournalWriteError(JournalError):
    """A write or fsync failed: the journal refuses further appends (reads keep working)."""


class JournalFullError(JournalError):
    """The queue's journal reached max_journal_size under the refuse policy."""


class JournalClosedError(JournalError):
    """The journal was closed (you closed it)."""


class DataDirError(JournalError):
    """The data directory cannot be used: a probe file could not be written and fsynced."""


class NotSavedError(JournalError):
    """A stop that could not write everything: `unsaved` says what, one entry each."""

    def __init__(self, unsaved: list[str]) -> None:
        super().__init__("; ".join(unsaved))
        self.unsaved = unsaved


class QueueError(QueuedError):
    """A queue operation the server refuses; the protocols map each to a reply."""


class BadNameError(QueueError, ValueError):
    """A queue or reader name that is invalid, or too long for its journal file names."""


class QueueFullError(QueueError):
    """max_items or max_size reached and discard_old_when_full is off."""


class ItemTooLargeError(QueueError):
    """An item over the queue's max_item_size."""


class ReadStateError(QueueError):
    """A reliable-read rule was broken (too many open reads, plain get with one open)."""


class NotOpenError(QueueError):
    """A touch or reject named a read this connection does not hold open."""


class TooManyQueuesError(QueueError):
    """Creating a queue or fanout reader would pass the server's max_queues."""


class QueueClosedError(QueueError):
    """The queue was deleted, or the server is shutting down."""


class ProducerGapError(QueueError):
    """A put of a producer skipped ahead of its next sequence: refused, nothing stored
    (a put before it was lost; the producer starts afresh or re-sends it)."""


# -- the wire: whose fault (h11's pair) ----------------------------------------------------


class ProtocolError(QueuedError):
    """The protocol was broken: by the peer (RemoteProtocolError) or by us
    (LocalProtocolError). Catch this where either is meant, one of them where only it is."""


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol.

    `reply` is what to send (b"" when the command asked for noreply); `close` says whether
    the connection must end after it. When `close` is false the parser has already dropped
    the offending command and next_event() may be called again.
    """

    def __init__(self, message: str, *, reply: bytes, close: bool) -> None:
        super().__init__(message)
        self.reply = reply
        self.close = close


class UnknownCommand(RemoteProtocolError):
    """A command name this protocol does not have."""


class BadCommand(RemoteProtocolError):
    """A known command with bad or missing arguments."""


class LineTooLong(RemoteProtocolError):
    """A line longer than the parser's cap; its end cannot be found, so the connection closes."""


class TooLarge(RemoteProtocolError):
    """A value (or put) larger than the cap; refused before its bytes are read."""


class BadDataChunk(RemoteProtocolError):
    """A data block not followed by CRLF: framing is lost, so the connection closes."""


class LocalProtocolError(ProtocolError):
    """We were asked to encode something the wire cannot carry, or fed a parser after its
    end of stream (our bug, not the peer's)."""
