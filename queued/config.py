"""Server configuration: frozen dataclasses, a TOML file, QUEUED_* variables and flags.

Owns parsing and validation of every setting (precedence: file < environment < flags)
and the per-queue inheritance default -> [queues.q] -> [queues."q+reader"]. It reads
the config file and the environment only; it never opens data files or sockets.

Units. Sizes are bytes: an integer, or a string with a suffix. Binary suffixes KiB, MiB,
GiB, TiB (and the JVM-style shorthands k, m, g, t) are powers of 1024; decimal suffixes
KB, MB, GB, TB are powers of 1000; B is bytes. Durations are milliseconds: an integer, or a
string with ms, s, m (minutes), h or d. Suffixes are case-insensitive and a fraction is
allowed when the result is whole ("1.5GiB", "0.5s"). Relative paths are relative to the
working directory. An empty QUEUED_* variable counts as unset.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, TypeVar

from queued.core.errors import QueuedError
from queued.core.journal_format import valid_name
from queued.storage.journal import (
    DataDirConfig,
    FsyncMode,
    FsyncPolicy,
    FullPolicy,
    JournalConfig,
    MiB,
)
from queued.storage.recovery import CorruptionPolicy

log = logging.getLogger("queued.config")

ENV_PREFIX: Final = "QUEUED_"
CONFIG_ENV: Final = "QUEUED_CONFIG"
#: Largest integer any setting takes (a signed 64-bit value, like the journal's fields).
MAX_INT: Final = (1 << 63) - 1


class ConfigError(QueuedError):
    """A setting is invalid; the message names the file / variable / flag and the key."""


# -- value parsers ----------------------------------------------------------------------------
# Each parser takes a raw value and whether it came from text (environment, command line),
# returns the typed value or raises ValueError("expected ..., got ...").

Parser = Callable[[object, bool], object]

# Digit counts are capped so a huge string never reaches int() (which has its own limit).
_NUMBER_RE: Final = re.compile(r"\s*(\d{1,30}(?:\.\d{1,30})?)\s*([A-Za-z]*)\s*")
_DIGITS_RE: Final = re.compile(r"\s*(\d{1,30})\s*")

_SIZE_UNITS: Final[Mapping[str, int]] = {
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
_DURATION_UNITS: Final[Mapping[str, int]] = {
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
    return _with_unit(value, _SIZE_UNITS, "a size (bytes, or a number with KiB/MiB/GiB/KB/MB/GB)")


def parse_duration(value: object) -> int:
    """Milliseconds from an int or a string like "250ms", "30s", "5m", "1h", "1d"."""
    return _with_unit(value, _DURATION_UNITS, "a duration (ms, or a number with ms/s/m/h/d)")


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


def _positive_duration(value: object, text: bool) -> int:
    ms = parse_duration(value)
    if ms == 0:
        raise ValueError(f"expected a positive duration, got {value!r}")
    return ms


_TRUE: Final = frozenset({"true", "1", "yes", "on"})
_FALSE: Final = frozenset({"false", "0", "no", "off"})


def _bool(value: object, text: bool) -> bool:
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


def _path(value: object, text: bool) -> Path:
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


def _queue_name(value: object, text: bool) -> str:
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


# -- the settings -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """Kestrel's per-queue settings, snake_case. 0 / None mean "no limit" / "off"."""

    max_items: int = 0
    max_size: int = 0  # bytes of item data
    max_item_size: int = 0  # bytes; 0 = only the server-wide protocol cap applies
    max_age: int = 0  # ms; items expire at most this long after being put
    discard_old_when_full: bool = False
    max_memory_size: int = 128 * MiB  # item data kept in memory; the rest is read behind
    journal_size: int = 16 * MiB
    max_journal_size: int = 0
    journal_full_policy: FullPolicy = FullPolicy.REFUSE
    fsync: FsyncPolicy = field(default_factory=FsyncPolicy)
    expire_to_queue: str | None = None
    max_expire_sweep: int = 0  # 0 = unlimited per sweep
    max_queue_age: int = 0  # ms; an empty queue older than this is deleted
    open_transaction_timeout: int = 0  # ms; an open read not closed in time is aborted
    error_queue: str | None = None
    max_errors: int = 0  # aborts before an item moves to error_queue; 0 = never

    def journal_config(self) -> JournalConfig:
        return JournalConfig(
            journal_size=self.journal_size,
            max_journal_size=self.max_journal_size,
            full_policy=self.journal_full_policy,
            fsync=self.fsync,
        )


_T = TypeVar("_T")


def _override(obj: _T, changes: Mapping[str, object]) -> _T:
    """dataclasses.replace with changes whose types the key tables already checked."""
    typed: dict[str, Any] = dict(changes)
    return dataclasses.replace(obj, **typed)  # type: ignore[type-var]


def _empty_queues() -> Mapping[str, Mapping[str, object]]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class ServerConfig:
    data_dir: Path = Path("data")
    host: str = "127.0.0.1"
    memcache_port: int = 22133
    text_port: int = 2222
    rpc_port: int = 2229
    http_port: int = 2223
    checkpoint_interval: int = 1000  # ms
    expiration_timer: int = 1000  # ms; the background expiry sweep period
    max_open_reads: int = 1000  # per connection, all queues together
    max_connections: int = 10000
    max_item_size: int = 16 * MiB  # protocol cap: a bigger declared item is refused unread
    max_line: int = 2048
    rpc_max_frame: int = 64 * MiB  # one MessagePack-RPC request or reply, bytes
    rpc_max_batch: int = 100_000  # items of a put, ids of a confirm, max_items of a get
    corruption: CorruptionPolicy = CorruptionPolicy.REFUSE
    archive_dir: Path | None = None
    log_level: str = "INFO"
    log_format: str = "text"  # "json": one JSON object per line
    shutdown_grace: int = 5000  # ms sessions get to finish their batch on shutdown
    metrics_max_queues: int = 1000  # readers with their own /metrics series; 0 = none
    min_free_disk: int = 1 << 30  # bytes; below this the server warns; 0 = never
    config_file: Path | None = None
    default: QueueConfig = QueueConfig()
    #: Validated, typed overrides per [queues.<name>] section ("jobs", "jobs+audit").
    queues: Mapping[str, Mapping[str, object]] = field(default_factory=_empty_queues)
    #: fsync given by QUEUED_FSYNC / --fsync: already in `default`, re-applied on reload.
    fsync_override: FsyncPolicy | None = None

    def queue_config(self, queue: str) -> QueueConfig:
        """`default`, then the [queues.<queue>] overrides; "q+r" means reader_config(q, r)."""
        name, plus, reader = queue.partition("+")
        if plus:
            return self.reader_config(name, reader)
        return _override(self.default, self.queues.get(queue, {}))

    def reader_config(self, queue: str, reader: str) -> QueueConfig:
        """queue_config(queue), then the [queues."<queue>+<reader>"] overrides."""
        base = self.queue_config(queue)
        if not reader:
            return base
        return _override(base, self.queues.get(f"{queue}+{reader}", {}))

    def data_dir_config(self) -> DataDirConfig:
        return DataDirConfig(corruption=self.corruption, archive_dir=self.archive_dir)


#: [server] keys (every ServerConfig scalar but config_file); "fsync" sets default.fsync.
_SERVER_KEYS: Final[Mapping[str, Parser]] = {
    "data_dir": _path,
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
    "archive_dir": _optional(_path),
    "log_level": _log_level,
    "log_format": _log_format,
    "shutdown_grace": _positive_duration,
    "metrics_max_queues": _count,
    "min_free_disk": _size,
    "fsync": _fsync,
}
_PORT_KEYS: Final = ("memcache_port", "text_port", "rpc_port", "http_port")

_QUEUE_KEYS: Final[Mapping[str, Parser]] = {
    "max_items": _count,
    "max_size": _size,
    "max_item_size": _size,
    "max_age": _duration,
    "discard_old_when_full": _bool,
    "max_memory_size": _positive_size,
    "journal_size": _positive_size,
    "max_journal_size": _size,
    "journal_full_policy": _enum(FullPolicy),
    "fsync": _fsync,
    "expire_to_queue": _optional(_queue_name),
    "max_expire_sweep": _count,
    "max_queue_age": _duration,
    "open_transaction_timeout": _duration,
    "error_queue": _optional(_queue_name),
    "max_errors": _count,
}
#: Keys of the queue's journal, which its fanout readers share: not settable per reader.
JOURNAL_KEYS: Final = frozenset(
    {"journal_size", "max_journal_size", "journal_full_policy", "fsync"}
)

#: Command-line flags of `serve` (a subset of the server keys, plus --config).
_FLAG_KEYS: Final = (
    "data_dir",
    "host",
    "memcache_port",
    "text_port",
    "rpc_port",
    "http_port",
    "fsync",
    "log_level",
    "log_format",
)


def env_var(key: str) -> str:
    """The environment variable of server key `key` ("data_dir" -> "QUEUED_DATA_DIR")."""
    return ENV_PREFIX + key.upper()


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


# -- reading each source ----------------------------------------------------------------------


def _unknown(key: str, known: Mapping[str, object]) -> str:
    snake = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", key).lower().replace("-", "_")
    guesses = [snake] if snake in known else difflib.get_close_matches(key, list(known), n=1)
    return f"unknown key (did you mean {guesses[0]!r}?)" if guesses else "unknown key"


def _section_label(name: str) -> str:
    return f"queues.{name}" if re.fullmatch(r"[A-Za-z0-9_-]+", name) else f"queues.{_quote(name)}"


def _quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _parse_table(
    table: Mapping[str, object], keys: Mapping[str, Parser], where: str
) -> dict[str, object]:
    parsed: dict[str, object] = {}
    for key, raw in table.items():
        if key not in keys:
            raise ConfigError(f"{where} {key}: {_unknown(key, keys)}")
        try:
            parsed[key] = keys[key](raw, False)
        except ValueError as exc:
            raise ConfigError(f"{where} {key}: {exc}") from None
    return parsed


@dataclass(frozen=True, slots=True)
class _FileSettings:
    server: Mapping[str, object]  # parsed [server] keys, without fsync
    default: Mapping[str, object]  # parsed [default] keys, [server] fsync folded in
    queues: Mapping[str, Mapping[str, object]]


def _table(doc: Mapping[str, object], name: str, label: str) -> Mapping[str, object]:
    value = doc.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{label}: {name}: expected a table [{name}], got {value!r}")
    return value


def _read_file(path: Path, origin: str) -> _FileSettings:
    label = str(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(f"{label}: cannot read config file named by {origin}: {reason}") from None
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{label}: invalid TOML: not UTF-8 at byte {exc.start}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{label}: invalid TOML: {exc}") from None
    for key in doc:
        if key not in ("server", "default", "queues"):
            hint = " (server settings go under [server])" if key in _SERVER_KEYS else ""
            raise ConfigError(
                f"{label}: {key}: unknown top-level key; expected [server], [default] "
                f"or [queues.<name>]{hint}"
            )
    server = _parse_table(_table(doc, "server", label), _SERVER_KEYS, f"{label}: [server]")
    default = _parse_table(_table(doc, "default", label), _QUEUE_KEYS, f"{label}: [default]")
    if "fsync" in server:
        if "fsync" in default:
            raise ConfigError(
                f"{label}: [server] fsync: also set in [default]; set it in one place only"
            )
        default["fsync"] = server.pop("fsync")
    queues: dict[str, Mapping[str, object]] = {}
    for name, section in _table(doc, "queues", label).items():
        where = f"{label}: [{_section_label(name)}]"
        queue, plus, reader = name.partition("+")
        if not valid_name(queue) or (plus and not valid_name(reader)):
            raise ConfigError(
                f"{where}: invalid queue name {name!r}: expected [A-Za-z0-9_:-]{{1,250}}, "
                "optionally followed by +reader with the same rule"
            )
        if not isinstance(section, dict):
            raise ConfigError(f"{where}: expected a table of queue settings, got {section!r}")
        if plus:
            for key in section:
                if key in JOURNAL_KEYS:
                    raise ConfigError(
                        f"{where} {key}: not settable for a fanout reader (readers share their "
                        f"queue's journal); set it in [{_section_label(queue)}]"
                    )
        queues[name] = MappingProxyType(_parse_table(section, _QUEUE_KEYS, where))
    return _FileSettings(server, default, queues)


def _from_env(env: Mapping[str, str]) -> dict[str, object]:
    parsed: dict[str, object] = {}
    for key, parse in _SERVER_KEYS.items():
        name = env_var(key)
        raw = env.get(name, "")
        if raw == "":
            continue
        try:
            parsed[key] = parse(raw, True)
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    known = {env_var(key) for key in _SERVER_KEYS} | {CONFIG_ENV}
    for name in env:
        # Not an error: the environment is shared with other programs (clients, tools).
        if name.startswith(ENV_PREFIX) and name not in known:
            log.warning("ignoring unknown environment variable %s", name)
    return parsed


def _from_flags(flags: Mapping[str, object]) -> dict[str, object]:
    parsed: dict[str, object] = {}
    for key, parse in _SERVER_KEYS.items():
        raw = flags.get(key)
        if raw is None:
            continue
        try:
            parsed[key] = parse(raw, True)
        except ValueError as exc:
            raise ConfigError(f"{_flag(key)}: {exc}") from None
    return parsed


def _check_ports(config: ServerConfig) -> None:
    seen: dict[int, str] = {}
    for key in _PORT_KEYS:
        port: int = getattr(config, key)
        if port and port in seen:
            raise ConfigError(f"{key} and {seen[port]} are both {port}: every listener needs one")
        seen[port] = key


# -- public entry points ----------------------------------------------------------------------


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags; each defaults to None so load_config can tell "not given"."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help=f"TOML config file (env {CONFIG_ENV}); flags > environment > file",
    )
    helps = {
        "data_dir": ("DIR", "journal directory (default data)"),
        "host": ("HOST", "address every listener binds (default 127.0.0.1)"),
        "memcache_port": ("PORT", "memcache protocol port, 0 = any free (default 22133)"),
        "text_port": ("PORT", "text protocol port, 0 = any free (default 2222)"),
        "rpc_port": ("PORT", "MessagePack-RPC port, 0 = any free (default 2229)"),
        "http_port": ("PORT", "HTTP metrics/health port, 0 = any free (default 2223)"),
        "fsync": ("POLICY", "default queue fsync: always, never or <ms> (default always)"),
        "log_level": ("LEVEL", "DEBUG, INFO, WARNING, ERROR or CRITICAL (default INFO)"),
        "log_format": ("FORMAT", "text or json, one object per line (default text)"),
    }
    for key in _FLAG_KEYS:
        metavar, text = helps[key]
        parser.add_argument(
            _flag(key), dest=key, metavar=metavar, default=None, help=f"{text}; env {env_var(key)}"
        )


def load_config(
    flags: argparse.Namespace | Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
) -> ServerConfig:
    """The server's config from the file, then the environment, then flags (later wins).

    The file is flags["config"], else $QUEUED_CONFIG, else none. `flags` may also carry any
    other server key (e.g. {"memcache_port": 0}); keys that are not settings are ignored.
    """
    env = os.environ if env is None else env
    given: Mapping[str, object] = (
        {} if flags is None else vars(flags) if isinstance(flags, argparse.Namespace) else flags
    )
    config_file: Path | None = None
    origin = ""
    if given.get("config") not in (None, ""):
        config_file, origin = _path(given["config"], True), "--config"
    elif env.get(CONFIG_ENV, "") != "":
        config_file, origin = _path(env[CONFIG_ENV], True), CONFIG_ENV
    file = _read_file(config_file, origin) if config_file is not None else None

    server: dict[str, object] = dict(file.server) if file is not None else {}
    overrides = _from_env(env)
    overrides.update(_from_flags(given))
    fsync = overrides.pop("fsync", None)
    server.update(overrides)
    default = _override(QueueConfig(), file.default) if file else QueueConfig()
    fsync_override = fsync if isinstance(fsync, FsyncPolicy) else None
    if fsync_override is not None:
        default = dataclasses.replace(default, fsync=fsync_override)
    config = dataclasses.replace(
        _override(ServerConfig(), server),
        config_file=config_file,
        default=default,
        queues=MappingProxyType(dict(file.queues)) if file is not None else _empty_queues(),
        fsync_override=fsync_override,
    )
    _check_ports(config)
    return config


def reload_queue_configs(config: ServerConfig) -> ServerConfig:
    """Re-read config.config_file and replace only `default` and `queues` (Kestrel's reload).

    Server keys in the file are validated but not applied (they need a restart); an
    fsync from QUEUED_FSYNC / --fsync still overrides the default. Raises ConfigError when
    the file is now invalid: the caller keeps `config`.
    """
    if config.config_file is None:
        return config
    file = _read_file(config.config_file, "config_file")
    default = _override(QueueConfig(), file.default)
    if config.fsync_override is not None:
        default = dataclasses.replace(default, fsync=config.fsync_override)
    return dataclasses.replace(config, default=default, queues=MappingProxyType(dict(file.queues)))


def _toml_value(key: str, value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        sizes = {"max_size", "max_item_size", "max_memory_size", "journal_size",
                 "max_journal_size", "rpc_max_frame", "min_free_disk"}
        durations = {
            "max_age",
            "max_queue_age",
            "open_transaction_timeout",
            "checkpoint_interval",
            "expiration_timer",
            "shutdown_grace",
        }
        if key in sizes and value:
            return _quote(format_size(value))
        if key in durations and value:
            return _quote(format_duration(value))
        return str(value)
    if isinstance(value, FsyncPolicy):
        text = f"{value.interval_ms}ms" if value.mode is FsyncMode.PERIODIC else value.mode.value
        return _quote(text)
    if isinstance(value, FullPolicy | CorruptionPolicy):
        return _quote(value.value)
    return _quote(str(value))


def _toml_lines(values: Mapping[str, object]) -> list[str]:
    return [
        f'{key} = ""  # not set' if value is None else f"{key} = {_toml_value(key, value)}"
        for key, value in values.items()
    ]


def describe(config: ServerConfig) -> str:
    """A human summary for the startup log and `dump_config`; also valid TOML for the file."""
    source = str(config.config_file) if config.config_file is not None else "none"
    server = {key: getattr(config, key) for key in _SERVER_KEYS if key != "fsync"}
    default = {f.name: getattr(config.default, f.name) for f in dataclasses.fields(QueueConfig)}
    lines = [f"# queued configuration (config file: {source})", "[server]"]
    lines += _toml_lines(server)
    lines += ["", "[default]", *_toml_lines(default)]
    for name, overrides in sorted(config.queues.items()):
        lines += ["", f"[{_section_label(name)}]", *_toml_lines(overrides)]
    return "\n".join(lines) + "\n"
