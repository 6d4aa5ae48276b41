"""Every setting's key, where it may be set, and how its raw value is parsed.

Owns the value parsers (sizes, durations, ports, enums, fsync, ...) and the key
tables of [server], [default] / [queues.<name>] and the `serve` flags. Pure: it
reads no file and no environment; loading.py feeds it what it read.

Units. Sizes are bytes: an integer, or a string with a suffix. Binary suffixes KiB, MiB,
GiB, TiB (and the JVM-style shorthands k, m, g, t) are powers of 1024; decimal suffixes
KB, MB, GB, TB are powers of 1000; B is bytes. Durations are milliseconds: an integer, or a
string with ms, s, m (minutes), h or d. Suffixes are case-insensitive and a fraction is
allowed when the result is whole ("1.5GiB", "0.5s"). Relative paths are relative to the
working directory. An empty QUEUED_* variable counts as unset.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Final

from queued.config.policies import CorruptionPolicy, FsyncPolicy, FullPolicy
from queued.journal.format import valid_name

ENV_PREFIX: Final = "QUEUED_"
CONFIG_ENV: Final = "QUEUED_CONFIG"
#: Largest integer any setting takes (a signed 64-bit value, like the journal's fields).
MAX_INT: Final = (1 << 63) - 1


# -- value parsers ----------------------------------------------------------------------------
# Each parser takes a raw value and whether it came from text (environment, command line),
# returns the typed value or raises ValueError("expected ..., got ...").

Parser = Callable[[object, bool], object]

# Digit counts are capped so a huge string never reaches int() (which has its own limit).
_NUMBER_RE: Final = re.compile(r"\s*(\d{1,30}(?:\.\d{1,30})?)\s*([A-Za-z]*)\s*")
_DIGITS_RE: Final = re.compile(r"\s*(\d{1,30})\s*")

SIZE_UNITS: Final[Mapping[str, int]] = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
DURATION_UNITS: Final[Mapping[str, int]] = {
    "": 1,
    "ms": 1,
    "s": 1000,
    "m": 60_000,
    "h": 3_600_000,
    "d": 86_400_000,
}
_LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS: Final = ("text", "json")


def _with_unit(value: object, units: Mapping[str, int], what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        if 0 <= value <= MAX_INT:
            return value
    elif isinstance(value, str):
        match = _NUMBER_RE.fullmatch(value)
        if match is not None and match[2].lower() in units:
            amount = Fraction(match[1]) * units[match[2].lower()]
            if amount.denominator == 1 and amount <= MAX_INT:
                return int(amount)
    raise ValueError(f"expected {what}, got {value!r}")


def parse_size(value: object) -> int:
    """Bytes from an int or a string like "64KiB", "16MiB", "10MB", "512k" (see module doc)."""
    return _with_unit(value, SIZE_UNITS, "a size (bytes, or a number with KiB/MiB/GiB/KB/MB/GB)")


def parse_duration(value: object) -> int:
    """Milliseconds from an int or a string like "250ms", "30s", "5m", "1h", "1d"."""
    return _with_unit(value, DURATION_UNITS, "a duration (ms, or a number with ms/s/m/h/d)")


def format_size(size: int) -> str:
    """The shortest exact spelling of `size` that parse_size reads back ("128MiB", "1000")."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def format_duration(ms: int) -> str:
    """The shortest exact spelling of `ms` that parse_duration reads back ("1h", "250ms")."""
    for unit, scale in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms and ms % scale == 0:
            return f"{ms // scale}{unit}"
    return f"{ms}ms"


def _integer(value: object, what: str, low: int, high: int) -> int:
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and (match := _DIGITS_RE.fullmatch(value)) is not None:
        number = int(match[1])
    if number is None or not low <= number <= high:
        raise ValueError(f"expected {what}, got {value!r}")
    return number


def _count(value: object, text: bool) -> int:
    return _integer(value, "a non-negative integer", 0, MAX_INT)


def _positive(value: object, text: bool) -> int:
    return _integer(value, "a positive integer", 1, MAX_INT)


def _port(value: object, text: bool) -> int:
    return _integer(value, "a port number 0..65535 (0 = any free port)", 0, 65535)


def _size(value: object, text: bool) -> int:
    return parse_size(value)


def _positive_size(value: object, text: bool) -> int:
    size = parse_size(value)
    if size == 0:
        raise ValueError(f"expected a positive size, got {value!r}")
    return size


def _duration(value: object, text: bool) -> int:
    return parse_duration(value)


def _durations(value: object, text: bool) -> tuple[int, ...]:
    """A list of durations (`["1s", "10s", "1m"]`), or in the environment a comma-separated
    string ("1s,10s,1m"); at most 64 steps."""
    if text and isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list | tuple) or len(value) > 64:
        raise ValueError(f"expected a list of at most 64 durations, got {value!r}")
    return tuple(_positive_duration(v, text) for v in value)


def _positive_duration(value: object, text: bool) -> int:
    ms = parse_duration(value)
    if ms == 0:
        raise ValueError(f"expected a positive duration, got {value!r}")
    return ms


_TRUE: Final = frozenset({"true", "1", "yes", "on"})
_FALSE: Final = frozenset({"false", "0", "no", "off"})


def parse_bool(value: object, text: bool) -> bool:
    if isinstance(value, bool):
        return value
    if text and isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise ValueError(f"expected true/false/1/0/yes/no, got {value!r}")
    raise ValueError(f"expected a boolean (true or false, unquoted), got {value!r}")


def _string(value: object) -> str:
    if not isinstance(value, str | Path) or not str(value).strip():
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return str(value).strip()


def parse_path(value: object, text: bool) -> Path:
    return Path(_string(value)).expanduser()


def _host(value: object, text: bool) -> str:
    host = _string(value)
    if any(c.isspace() for c in host):
        raise ValueError(f"expected a host name or address, got {value!r}")
    return host


def _log_level(value: object, text: bool) -> str:
    level = value.strip().upper() if isinstance(value, str) else ""
    level = "WARNING" if level == "WARN" else level
    if level not in _LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(_LOG_LEVELS)}, got {value!r}")
    return level


def _log_format(value: object, text: bool) -> str:
    word = value.strip().lower() if isinstance(value, str) else ""
    if word not in LOG_FORMATS:
        raise ValueError(f"expected one of {', '.join(LOG_FORMATS)}, got {value!r}")
    return word


def parse_queue_name(value: object, text: bool) -> str:
    if not isinstance(value, str) or not valid_name(value):
        raise ValueError(f"expected a queue name matching [A-Za-z0-9_:-]{{1,250}}, got {value!r}")
    return value


def _optional(parse: Parser) -> Parser:
    def parse_optional(value: object, text: bool) -> object:
        return None if value == "" else parse(value, text)

    return parse_optional


def _enum(choices: type[FullPolicy] | type[CorruptionPolicy]) -> Parser:
    def parse_enum(value: object, text: bool) -> object:
        if isinstance(value, choices):
            return value
        word = value.strip().lower() if isinstance(value, str) else None
        for choice in choices:
            if choice.value == word:
                return choice
        names = " or ".join(repr(c.value) for c in choices)
        raise ValueError(f"expected {names}, got {value!r}")

    return parse_enum


def _fsync(value: object, text: bool) -> FsyncPolicy:
    if isinstance(value, FsyncPolicy):
        return value
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f"expected 'always', 'never' or a number of ms, got {value!r}")
    try:
        return FsyncPolicy.parse(value)
    except ValueError:
        raise ValueError(f"expected 'always', 'never' or a number of ms, got {value!r}") from None


# -- the keys ---------------------------------------------------------------------------------

#: [server] keys (every ServerConfig scalar but config_file); "fsync" sets default.fsync.
SERVER_KEYS: Final[Mapping[str, Parser]] = {
    "data_dir": parse_path,
    "host": _host,
    "memcache_port": _port,
    "text_port": _port,
    "rpc_port": _port,
    "http_port": _port,
    "checkpoint_interval": _positive_duration,
    "expiration_timer": _positive_duration,
    "max_open_reads": _positive,
    "max_connections": _positive,
    "max_item_size": _positive_size,
    "max_line": _positive,
    "rpc_max_frame": _positive_size,
    "rpc_max_batch": _positive,
    "corruption": _enum(CorruptionPolicy),
    "archive_dir": _optional(parse_path),
    "log_level": _log_level,
    "log_format": _log_format,
    "shutdown_grace": _positive_duration,
    "metrics_max_queues": _count,
    "min_free_disk": _size,
    "fsync": _fsync,
    "tls_cert": _optional(parse_path),
    "tls_key": _optional(parse_path),
    "tls_client_ca": _optional(parse_path),
    "users_file": _optional(parse_path),
    "allow_anonymous": parse_bool,
    "request_timeout": _positive_duration,
    "auth_timeout": _positive_duration,
    "max_queues": _positive,
    "park_after": _duration,
}
PORT_KEYS: Final = ("memcache_port", "text_port", "rpc_port", "http_port")

QUEUE_KEYS: Final[Mapping[str, Parser]] = {
    "max_items": _count,
    "max_size": _size,
    "max_item_size": _size,
    "max_age": _duration,
    "discard_old_when_full": parse_bool,
    "max_memory_size": _positive_size,
    "journal_size": _positive_size,
    "max_journal_size": _size,
    "journal_full_policy": _enum(FullPolicy),
    "fsync": _fsync,
    "expire_to_queue": _optional(parse_queue_name),
    "max_expire_sweep": _count,
    "max_queue_age": _duration,
    "open_transaction_timeout": _duration,
    "error_queue": _optional(parse_queue_name),
    "max_errors": _count,
    "retry_backoff": _durations,
    "max_producers": _positive,
    "producer_expiry": _positive_duration,
    "dedup_window": _positive_duration,
    "max_dedup_keys": _positive,
}
#: Keys of the queue's journal, which its fanout readers share: not settable per reader.
JOURNAL_KEYS: Final = frozenset(
    {"journal_size", "max_journal_size", "journal_full_policy", "fsync", "max_producers",
     "producer_expiry", "dedup_window", "max_dedup_keys"}
)

#: Command-line flags of `serve` (a subset of the server keys, plus --config).
FLAG_KEYS: Final = (
    "data_dir",
    "host",
    "memcache_port",
    "text_port",
    "rpc_port",
    "http_port",
    "fsync",
    "log_level",
    "log_format",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
    "users_file",
    "allow_anonymous",
)


def env_var(key: str) -> str:
    """The environment variable of server key `key` ("data_dir" -> "QUEUED_DATA_DIR")."""
    return ENV_PREFIX + key.upper()


def flag(key: str) -> str:
    """The `serve` flag of server key `key` ("data_dir" -> "--data-dir")."""
    return "--" + key.replace("_", "-")

