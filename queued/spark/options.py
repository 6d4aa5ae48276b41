"""Options of the `queued` Spark source and sink: parsing and the errors bad ones raise.

Owns option names, defaults and messages; no Spark import beyond what callers pass in.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from queued.errors import QueuedError
from queued.journal import format as jf


class QueuedDataSourceError(QueuedError):
    """A bad option, or a journal the source cannot read (the message says what to do)."""


class DataLossError(QueuedDataSourceError):
    """A stream's offset points at items that are gone (failOnDataLoss=true, the default)."""


# -- which options each use takes ----------------------------------------------------------

#: Options of `spark.read` (canonical name -> the older names still accepted). The names
#: are the Kafka source's where the meaning is the same; see docs/spark.md's table.
READ_OPTIONS: dict[str, tuple[str, ...]] = {
    "path": (),
    "subscribe": ("queues", "queue"),
    "subscribePattern": (),
    "startingOffsets": (),
    "endingOffsets": (),
    "startingTimestamp": (),
    "endingTimestamp": (),
    "startingOffsetsByTimestamp": (),
    "endingOffsetsByTimestamp": (),
    "minPartitions": (),
    "failOnDataLoss": (),
    "min_id": (),
    "max_id": (),
    "archive_dir": (),
    "max_partition_bytes": (),
    "pending": (),
    "reader": (),
    "include_flags": (),
    "includeHeaders": (),
}
#: Options of `spark.readStream`.
STREAM_OPTIONS: dict[str, tuple[str, ...]] = {
    "path": (),
    "subscribe": ("queues", "queue"),
    "subscribePattern": (),
    "startingOffsets": ("starting",),
    "startingTimestamp": (),
    "startingOffsetsByTimestamp": (),
    "maxOffsetsPerTrigger": ("max_items_per_trigger",),
    "minOffsetsPerTrigger": (),
    "maxTriggerDelay": (),
    "minPartitions": (),
    "failOnDataLoss": (),
    "archive_dir": (),
    "max_partition_bytes": (),
    "include_flags": (),
    "includeHeaders": (),
}
#: Options of `df.write` (the sink).
WRITE_OPTIONS: dict[str, tuple[str, ...]] = {
    "server": ("servers",),
    "queue": ("topic",),
    "batch_size": (),
    "batch_bytes": (),
    "expiration_ms": (),
    "delay_ms": (),
    "timeout": (),
    "connect_timeout": (),
    "skip_null_data": (),
    "tls": (),
    "tls_ca": (),
    "tls_cert": (),
    "tls_key": (),
    "user": (),
    "password": (),
    "delivery_timeout": (),
    "idempotency_key": (),
}
#: Options of `df.writeStream` (Spark passes its own checkpointLocation and path along).
WRITE_STREAM_OPTIONS: dict[str, tuple[str, ...]] = {
    k: v for k, v in WRITE_OPTIONS.items() if k != "idempotency_key"} | {
    "exactly_once": (),
    "checkpointLocation": (),
    "path": (),
}
#: Options Spark itself may add to what a data source gets.
_SPARK_ADDED = frozenset({"path", "paths"})


class Options:
    """A data source's options by case-insensitive name, checked against one of the tables
    above: an unknown name is an error listing the valid ones, and each value is found
    under its canonical name or any of its older names."""

    def __init__(self, raw: Any, table: dict[str, tuple[str, ...]], use: str) -> None:
        self.raw = {str(k).lower(): v for k, v in dict(raw or {}).items()}
        self.table = table
        self._canonical = {n.lower(): n for n in table}
        spelled = {n.lower(): n for n in table}
        for name, aliases in table.items():
            for alias in aliases:
                self._canonical[alias.lower()] = name
                spelled[alias.lower()] = alias
        unknown = sorted(k for k in self.raw
                         if k not in self._canonical and k not in _SPARK_ADDED)
        if unknown:
            valid = ", ".join(n + (f" (or {', '.join(table[n])})" if table[n] else "")
                              for n in sorted(table, key=str.lower))
            raise QueuedDataSourceError(
                f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for "
                f"{use} of the queued source; valid options: {valid}")
        given: dict[str, str] = {}
        for key in self.raw:
            found = self._canonical.get(key)
            if found is not None:
                name = found
                if name in given and self.raw[key] != self.raw[given[name]]:
                    raise QueuedDataSourceError(
                        f"options {spelled[given[name]]} and {spelled[key]} mean the same; "
                        "give one")
                given[name] = key

    def get(self, key: str, default: Any = None) -> Any:
        """The value of option `key` (canonical name or alias) or `default`."""
        name = self._canonical.get(key.lower(), key)
        for k in (name, *self.table.get(name, ())):
            value = self.raw.get(k.lower())
            if value is not None:
                return value
        return default

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None


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
    """`subscribe` (older names `queues`, `queue`): a comma list of queue names."""
    raw = options.get("subscribe")
    if not raw:
        return None
    names = frozenset(q.strip() for q in str(raw).split(",") if q.strip())
    bad = sorted(q for q in names if not jf.valid_name(q))
    if bad:
        raise QueuedDataSourceError(f"bad queue names in option subscribe: {bad}")
    return names


def pattern_option(options: Any) -> re.Pattern[str] | None:
    """`subscribePattern`: a regular expression a whole queue name must match."""
    raw = options.get("subscribePattern")
    if raw is None or raw == "":
        return None
    if options.get("subscribe"):
        raise QueuedDataSourceError("give option subscribe or subscribePattern, not both")
    try:
        return re.compile(str(raw))
    except re.error as exc:
        raise QueuedDataSourceError(f"option subscribePattern {raw!r}: {exc}") from None


#: What startingOffsets / endingOffsets name: "earliest", "latest", or per queue an id
#: (EARLIEST = -2 and LATEST = -1 as in the Kafka source's JSON).
EARLIEST, LATEST = -2, -1
OffsetSpec = str | dict[str, int]


def offsets_option(options: Any, key: str, default: str) -> OffsetSpec:
    """`earliest`, `latest` or JSON `{"queue": id, ...}` (-2 earliest, -1 latest)."""
    raw = options.get(key)
    if raw is None or str(raw).strip() == "":
        return default
    text = str(raw).strip()
    if text.lower() in ("earliest", "latest"):
        return text.lower()
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and (v >= 1 or v in (-1, -2))
            for v in value.values()):
        raise QueuedDataSourceError(
            f'option {key} must be "earliest", "latest" or JSON like {{"orders": 1234, '
            f'"jobs": -2}} (an id >= 1 per queue; -2 earliest, -1 latest), not {text!r}')
    _check_names(key, value)
    return {str(k): int(v) for k, v in value.items()}


def timestamp_option(options: Any, key: str) -> int | None:
    """A time in ms since the epoch (compared with each item's add_time)."""
    raw = options.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise QueuedDataSourceError(
            f"option {key} must be milliseconds since the epoch, not {raw!r}") from None
    if value < 0:
        raise QueuedDataSourceError(f"option {key} must be >= 0, not {value}")
    return value


def timestamps_option(options: Any, key: str) -> dict[str, int] | None:
    """JSON `{"queue": ms since the epoch, ...}`."""
    raw = options.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = json.loads(str(raw))
    except ValueError:
        value = None
    if not isinstance(value, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values()):
        raise QueuedDataSourceError(
            f'option {key} must be JSON like {{"orders": 1700000000000}} (ms since the '
            f"epoch per queue), not {raw!r}")
    _check_names(key, value)
    return {str(k): int(v) for k, v in value.items()}


def _check_names(key: str, value: dict[Any, Any]) -> None:
    bad = sorted(str(q) for q in value if not jf.valid_name(str(q)))
    if bad:
        raise QueuedDataSourceError(f"bad queue names in option {key}: {bad}")


_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*", re.IGNORECASE)
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration_option(options: Any, key: str, default: float) -> float:
    """Seconds, from `15m`, `30s`, `500ms`, `1h` (a bare number is seconds)."""
    raw = options.get(key)
    if raw is None or raw == "":
        return default
    m = _DURATION.fullmatch(str(raw))
    if not m:
        raise QueuedDataSourceError(
            f"option {key} must be a duration like 15m, 30s or 500ms, not {raw!r}")
    return float(m.group(1)) * _UNIT[(m.group(2) or "s").lower()]


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


def optional_int(options: Any, key: str) -> int:
    """A positive integer option, 0 when not given."""
    return int_option(options, key, 0) if options.get(key) not in (None, "") else 0


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
