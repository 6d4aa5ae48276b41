"""Loading the settings: a TOML file, QUEUED_* variables and `serve` flags; and back to TOML.

Owns the precedence (file < environment < flags), the file's layout ([server],
[default], [queues.<name>]), reload and `describe`. It reads the config file and
the environment only; it never opens data files or sockets.
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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from queued.config.keys import (
    CONFIG_ENV,
    ENV_PREFIX,
    FLAG_KEYS,
    JOURNAL_KEYS,
    PORT_KEYS,
    QUEUE_KEYS,
    SERVER_KEYS,
    Parser,
    env_var,
    flag,
    format_duration,
    format_size,
    parse_path,
)
from queued.config.policies import (
    CorruptionPolicy,
    FsyncMode,
    FsyncPolicy,
    FullPolicy,
)
from queued.config.settings import QueueConfig, ServerConfig, no_queue_sections, override
from queued.errors import QueuedError
from queued.journal.format import valid_name

log = logging.getLogger("queued.config")


class ConfigError(QueuedError):
    """A setting is invalid; the message names the file / variable / flag and the key."""


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
            hint = " (server settings go under [server])" if key in SERVER_KEYS else ""
            raise ConfigError(
                f"{label}: {key}: unknown top-level key; expected [server], [default] "
                f"or [queues.<name>]{hint}"
            )
    server = _parse_table(_table(doc, "server", label), SERVER_KEYS, f"{label}: [server]")
    default = _parse_table(_table(doc, "default", label), QUEUE_KEYS, f"{label}: [default]")
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
        queues[name] = MappingProxyType(_parse_table(section, QUEUE_KEYS, where))
    return _FileSettings(server, default, queues)


def _from_env(env: Mapping[str, str]) -> dict[str, object]:
    parsed: dict[str, object] = {}
    for key, parse in SERVER_KEYS.items():
        name = env_var(key)
        raw = env.get(name, "")
        if raw == "":
            continue
        try:
            parsed[key] = parse(raw, True)
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    known = {env_var(key) for key in SERVER_KEYS} | {CONFIG_ENV}
    for name in env:
        # Not an error: the environment is shared with other programs (clients, tools).
        if name.startswith(ENV_PREFIX) and name not in known:
            log.warning("ignoring unknown environment variable %s", name)
    return parsed


def _from_flags(flags: Mapping[str, object]) -> dict[str, object]:
    parsed: dict[str, object] = {}
    for key, parse in SERVER_KEYS.items():
        raw = flags.get(key)
        if raw is None:
            continue
        try:
            parsed[key] = parse(raw, True)
        except ValueError as exc:
            raise ConfigError(f"{flag(key)}: {exc}") from None
    return parsed


def _check_tls(config: ServerConfig) -> None:
    if (config.tls_cert is None) != (config.tls_key is None):
        raise ConfigError("tls_cert and tls_key: set both (TLS on) or neither (TLS off)")
    if config.tls_client_ca is not None and config.tls_cert is None:
        raise ConfigError("tls_client_ca: needs tls_cert and tls_key (client certificates "
                          "are checked during the TLS handshake)")


def _check_ports(config: ServerConfig) -> None:
    seen: dict[int, str] = {}
    for key in PORT_KEYS:
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
        "tls_cert": ("FILE", "PEM certificate chain: every listener speaks TLS only"),
        "tls_key": ("FILE", "PEM private key of --tls-cert"),
        "tls_client_ca": ("FILE", "PEM CA bundle: clients must present a certificate it signed"),
        "users_file": ("FILE", "TOML users file: every connection authenticates first"),
    }
    for key in FLAG_KEYS:
        if key == "allow_anonymous":
            parser.add_argument(
                flag(key), dest=key, action="store_const", const="true", default=None,
                help="listen beyond loopback without a users file (accept the risk); "
                     f"env {env_var(key)}=1")
            continue
        metavar, text = helps[key]
        parser.add_argument(
            flag(key), dest=key, metavar=metavar, default=None, help=f"{text}; env {env_var(key)}"
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
        config_file, origin = parse_path(given["config"], True), "--config"
    elif env.get(CONFIG_ENV, "") != "":
        config_file, origin = parse_path(env[CONFIG_ENV], True), CONFIG_ENV
    file = _read_file(config_file, origin) if config_file is not None else None

    server: dict[str, object] = dict(file.server) if file is not None else {}
    overrides = _from_env(env)
    overrides.update(_from_flags(given))
    fsync = overrides.pop("fsync", None)
    server.update(overrides)
    default = override(QueueConfig(), file.default) if file else QueueConfig()
    fsync_override = fsync if isinstance(fsync, FsyncPolicy) else None
    if fsync_override is not None:
        default = dataclasses.replace(default, fsync=fsync_override)
    config = dataclasses.replace(
        override(ServerConfig(), server),
        config_file=config_file,
        default=default,
        queues=MappingProxyType(dict(file.queues)) if file is not None else no_queue_sections(),
        fsync_override=fsync_override,
    )
    _check_ports(config)
    _check_tls(config)
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
    default = override(QueueConfig(), file.default)
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
            "request_timeout",
            "auth_timeout",
            "max_age",
            "max_queue_age",
            "open_transaction_timeout",
            "checkpoint_interval",
            "expiration_timer",
            "shutdown_grace",
            "park_after",
        }
        if key in sizes and value:
            return _quote(format_size(value))
        if key in durations and value:
            return _quote(format_duration(value))
        return str(value)
    if isinstance(value, tuple):  # retry_backoff: durations
        return "[" + ", ".join(_quote(format_duration(v)) for v in value) + "]"
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
    server = {key: getattr(config, key) for key in SERVER_KEYS if key != "fsync"}
    default = {f.name: getattr(config.default, f.name) for f in dataclasses.fields(QueueConfig)}
    lines = [f"# queued configuration (config file: {source})", "[server]"]
    lines += _toml_lines(server)
    lines += ["", "[default]", *_toml_lines(default)]
    for name, overrides in sorted(config.queues.items()):
        lines += ["", f"[{_section_label(name)}]", *_toml_lines(overrides)]
    return "\n".join(lines) + "\n"
