"""Options of the `queued` Spark source and sink: parsing and the errors bad ones raise.

Owns option names, defaults and messages; no Spark import beyond what callers pass in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from queued.core import journal_format as jf
from queued.core.errors import QueuedError


class QueuedDataSourceError(QueuedError):
    """A bad option, or a journal the source cannot read (the message says what to do)."""


def path_option(options: Any, key: str = "path") -> str:
    path = options.get(key)
    if not path:
        raise QueuedDataSourceError(
            f'the queued source needs a directory: .load("/path/to/data_dir") (option {key!r})')
    if not Path(path).is_dir():
        raise QueuedDataSourceError(f"{path}: not a directory")
    return str(path)


def archive_option(options: Any) -> str | None:
    """`archive_dir`: the server's archive of retired segments, read with the data dir."""
    return path_option(options, "archive_dir") if options.get("archive_dir") else None


def queues_option(options: Any) -> frozenset[str] | None:
    raw = options.get("queues") or options.get("queue")
    if not raw:
        return None
    names = frozenset(q.strip() for q in str(raw).split(",") if q.strip())
    bad = sorted(q for q in names if not jf.valid_name(q))
    if bad:
        raise QueuedDataSourceError(f"bad queue names in option queues: {bad}")
    return names


def int_option(options: Any, key: str, default: int) -> int:
    raw = options.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise QueuedDataSourceError(f"option {key} must be an integer, not {raw!r}") from None
    if value <= 0:
        raise QueuedDataSourceError(f"option {key} must be positive, not {value}")
    return value


def pending_reader_option(options: Any) -> str | None:
    """The reader whose unconsumed items alone are read, or None (read everything)."""
    reader = options.get("reader")
    if reader is not None and reader != "":
        if not jf.valid_name(reader):
            raise QueuedDataSourceError(f"bad reader name {reader!r}")
        return str(reader)
    if bool_option(options, "pending"):
        return ""
    return None


def bool_option(options: Any, key: str) -> bool:
    raw = str(options.get(key, "false")).strip().lower()
    if raw in ("true", "1", "yes"):
        return True
    if raw in ("false", "0", "no", ""):
        return False
    raise QueuedDataSourceError(f"option {key} must be true or false, not {raw!r}")


def float_option(options: Any, key: str, default: float) -> float:
    raw = options.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise QueuedDataSourceError(f"option {key} must be a number, not {raw!r}") from None
    if not value > 0:
        raise QueuedDataSourceError(f"option {key} must be positive, not {raw!r}")
    return value
