"""Server configuration: settings and their policies, read from TOML, QUEUED_* and flags.

- policies: pure values storage is run with (fsync, full journal, corruption)
- keys: every key, where it may be set, and how its value is parsed (units)
- settings: ServerConfig and QueueConfig, the per-queue inheritance
- loading: file < environment < flags, reload, describe

Imports only the pure layers (queued.journal, queued.wire); storage imports the policies
from here, never the reverse.
"""

from queued.config.keys import (
    CONFIG_ENV,
    ENV_PREFIX,
    JOURNAL_KEYS,
    LOG_FORMATS,
    MAX_INT,
    QUEUE_KEYS,
    SERVER_KEYS,
    Parser,
    env_var,
    format_duration,
    format_size,
    parse_duration,
    parse_size,
)
from queued.config.loading import (
    ConfigError,
    add_serve_arguments,
    describe,
    load_config,
    reload_queue_configs,
)
from queued.config.policies import (
    CorruptionPolicy,
    DataDirConfig,
    FsyncMode,
    FsyncPolicy,
    FullPolicy,
    JournalConfig,
    MiB,
)
from queued.config.settings import QueueConfig, ServerConfig

__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "JOURNAL_KEYS",
    "LOG_FORMATS",
    "MAX_INT",
    "QUEUE_KEYS",
    "SERVER_KEYS",
    "ConfigError",
    "CorruptionPolicy",
    "DataDirConfig",
    "FsyncMode",
    "FsyncPolicy",
    "FullPolicy",
    "JournalConfig",
    "MiB",
    "Parser",
    "QueueConfig",
    "ServerConfig",
    "add_serve_arguments",
    "describe",
    "env_var",
    "format_duration",
    "format_size",
    "load_config",
    "parse_duration",
    "parse_size",
    "reload_queue_configs",
]
