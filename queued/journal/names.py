"""Journal file names: segments `q.<n>`, checkpoints `q.read.<reader>`, temps `~~`.

Owns the name rules for queues and readers (they become file names) and parsing
a directory entry back. PURE: strings in, values out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from queued.sansio import is_valid_name

TEMP_MARK: Final = "~~"
#: The data dir's list of paused queues, one name a line. No "." in it: never a
#: journal file name, nor is its temp file.
PAUSED_FILE: Final = "queued-paused"


class FileRole(enum.Enum):
    SEGMENT = "segment"
    CHECKPOINT = "checkpoint"
    TEMP = "temp"
    PRODUCERS = "producers"  # q.producers: the snapshot of the queue's producer marks
    DEDUP = "dedup"  # q.dedup: the snapshot of the queue's deduplication keys


@dataclass(frozen=True, slots=True)
class JournalFileName:
    queue: str
    role: FileRole
    number: int = 0  # segments
    reader: str = ""  # checkpoints ("" = the default reader)


#: Queue and reader names: one rule for the wire and the files (`[A-Za-z0-9_:-]{1,250}`).
valid_name: Final = is_valid_name


#: Longest file name most file systems take (NAME_MAX).
NAME_MAX: Final = 255
#: Segment numbers are creation times in ms: 13 digits until the year 2286.
_LONGEST_NUMBER: Final = 10**13


def names_fit(queue: str, reader: str | None = None) -> bool:
    """True if every file of queue (or of its reader) stays within NAME_MAX bytes.

    The name grammar allows 250 characters, but `q.<13 digits>~~` must fit in 255,
    and so must `q.read.<reader>~~`.
    """
    name = segment_name(queue, _LONGEST_NUMBER) if reader is None else checkpoint_name(
        queue, reader)
    return len(temp_name(name).encode()) <= NAME_MAX


def segment_name(queue: str, number: int) -> str:
    return f"{queue}.{number}"


def checkpoint_name(queue: str, reader: str = "") -> str:
    return f"{queue}.read.{reader}"


def producers_name(queue: str) -> str:
    """The file holding a snapshot of the queue's producer marks (exactly-once puts)."""
    return f"{queue}.producers"


def dedup_name(queue: str) -> str:
    """The file holding a snapshot of the queue's deduplication keys (their DEDUP marks)."""
    return f"{queue}.dedup"


def temp_name(final_name: str) -> str:
    return final_name + TEMP_MARK


def parse_file_name(name: str) -> JournalFileName | None:
    """What a data-directory entry is, or None when it is not a journal file."""
    queue, dot, rest = name.partition(".")
    if not dot or not valid_name(queue):
        return None
    if TEMP_MARK in name:
        return JournalFileName(queue, FileRole.TEMP)
    if rest.isdigit() and rest.isascii() and (rest == "0" or rest[0] != "0"):
        return JournalFileName(queue, FileRole.SEGMENT, number=int(rest))
    if rest == "producers":
        return JournalFileName(queue, FileRole.PRODUCERS)
    if rest == "dedup":
        return JournalFileName(queue, FileRole.DEDUP)
    if rest.startswith("read."):
        reader = rest[5:]
        if reader == "" or valid_name(reader):
            return JournalFileName(queue, FileRole.CHECKPOINT, reader=reader)
    return None
