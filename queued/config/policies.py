"""The policies storage is run with: fsync, a full journal, corruption, and their bundles.

Pure values (frozen dataclasses and enums) that settings produce and storage
consumes. Imports nothing from storage and does no I/O, so storage can depend on
it without configuration depending on storage.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20


class FsyncMode(enum.Enum):
    ALWAYS = "always"
    NEVER = "never"
    PERIODIC = "periodic"


@dataclass(frozen=True, slots=True)
class FsyncPolicy:
    mode: FsyncMode = FsyncMode.ALWAYS
    interval_ms: int = 0

    @classmethod
    def parse(cls, value: str | int) -> FsyncPolicy:
        """`"always"`, `"never"`, or a number of milliseconds (`"200"`, `200`, `"200ms"`)."""
        text = str(value).strip().lower()
        if text == "always":
            return cls(FsyncMode.ALWAYS)
        if text == "never":
            return cls(FsyncMode.NEVER)
        text = text.removesuffix("ms")
        if text.isdigit() and int(text) > 0:
            return cls(FsyncMode.PERIODIC, int(text))
        if text == "0":
            return cls(FsyncMode.ALWAYS)
        raise ValueError(f"fsync must be 'always', 'never' or a number of ms, not {value!r}")

    def __str__(self) -> str:
        return f"{self.interval_ms}" if self.mode is FsyncMode.PERIODIC else self.mode.value


class FullPolicy(enum.Enum):
    REFUSE = "refuse"  # refuse puts while the journal is at max_journal_size
    DROP_OLDEST = "drop_oldest"  # drop the oldest segment, items and all


class CorruptionPolicy(enum.Enum):
    REFUSE = "refuse"  # refuse to start, name the file and offset
    QUARANTINE = "quarantine"  # keep a copy aside, salvage every verified batch


@dataclass(frozen=True, slots=True)
class JournalConfig:
    journal_size: int = 16 * MiB
    max_journal_size: int = 0  # 0 = unbounded
    full_policy: FullPolicy = FullPolicy.REFUSE
    fsync: FsyncPolicy = FsyncPolicy()
    #: rewrite a closed segment when at most this fraction of its items is still needed
    compact_live_ratio: float = 0.25


@dataclass(frozen=True, slots=True)
class DataDirConfig:
    corruption: CorruptionPolicy = CorruptionPolicy.REFUSE
    archive_dir: Path | None = None
    quarantine_dir_name: str = "quarantine"
