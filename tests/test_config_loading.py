"""Tests for queued.config: TOML files, QUEUED_* variables, flags, inheritance, reload.

Every config file is a real file in a temp dir; the environment is passed explicitly
(never os.environ), so tests do not depend on the shell running them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

import pytest
from config_util import INHERIT, NO_ENV, error_of, load_file, parse_flags, write

from queued import config as cfg
from queued.config import (
    ConfigError,
    CorruptionPolicy,
    DataDirConfig,
    FsyncMode,
    FsyncPolicy,
    FullPolicy,
    MiB,
    QueueConfig,
    ServerConfig,
    add_serve_arguments,
    describe,
    keys,
    load_config,
    reload_queue_configs,
)

# -- defaults -------------------------------------------------------------------------------


def test_defaults_without_any_source() -> None:
    config = load_config(None, env=NO_ENV)
    assert config == ServerConfig()
    assert config.data_dir == Path("data")
    assert config.host == "127.0.0.1"
    assert (config.memcache_port, config.text_port, config.rpc_port, config.http_port) == (
        22133,
        2222,
        2229,
        2223,
    )
    assert config.config_file is None
    assert config.default == QueueConfig()
    assert config.default.max_memory_size == 128 * MiB
    assert config.default.fsync == FsyncPolicy(FsyncMode.ALWAYS)
    assert dict(config.queues) == {}


def test_key_tables_cover_every_field() -> None:
    queue_fields = {f.name for f in dataclasses.fields(QueueConfig)}
    assert set(cfg.QUEUE_KEYS) == queue_fields
    server_scalars = {
        f.name
        for f in dataclasses.fields(ServerConfig)
        if f.name not in ("config_file", "default", "queues", "fsync_override")
    }
    assert set(cfg.SERVER_KEYS) == server_scalars | {"fsync"}
    assert queue_fields >= cfg.JOURNAL_KEYS


# -- the file -------------------------------------------------------------------------------

FULL = """
[server]
data_dir = "/var/lib/queued"
host = "0.0.0.0"
memcache_port = 1
text_port = 2
rpc_port = 3
http_port = 4
checkpoint_interval = "5s"
expiration_timer = 250
max_open_reads = 7
max_connections = 8
max_item_size = "1MiB"
max_line = 4096
corruption = "quarantine"
archive_dir = "/srv/archive"
log_level = "debug"
log_format = "JSON"
shutdown_grace = "2.5s"
metrics_max_queues = 0
min_free_disk = "5GB"
fsync = "never"

[default]
max_items = 10
max_size = "10MB"
max_item_size = "64KiB"
max_age = "1d"
discard_old_when_full = true
max_memory_size = "1GiB"
journal_size = "512k"
max_journal_size = "2GiB"
journal_full_policy = "drop_oldest"
expire_to_queue = "expired"
max_expire_sweep = 100
max_queue_age = "30m"
open_transaction_timeout = "30s"
error_queue = "errors"
max_errors = 3
"""


def test_every_key_from_file(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    config = load_file(path)
    assert config == ServerConfig(
        data_dir=Path("/var/lib/queued"),
        host="0.0.0.0",
        memcache_port=1,
        text_port=2,
        rpc_port=3,
        http_port=4,
        checkpoint_interval=5000,
        expiration_timer=250,
        max_open_reads=7,
        max_connections=8,
        max_item_size=MiB,
        max_line=4096,
        corruption=CorruptionPolicy.QUARANTINE,
        archive_dir=Path("/srv/archive"),
        log_level="DEBUG",
        log_format="json",
        shutdown_grace=2500,
        metrics_max_queues=0,
        min_free_disk=5_000_000_000,
        config_file=path,
        default=QueueConfig(
            max_items=10,
            max_size=10_000_000,
            max_item_size=64 * 1024,
            max_age=86_400_000,
            discard_old_when_full=True,
            max_memory_size=1 << 30,
            journal_size=512 * 1024,
            max_journal_size=2 << 30,
            journal_full_policy=FullPolicy.DROP_OLDEST,
            fsync=FsyncPolicy(FsyncMode.NEVER),
            expire_to_queue="expired",
            max_expire_sweep=100,
            max_queue_age=30 * 60_000,
            open_transaction_timeout=30_000,
            error_queue="errors",
            max_errors=3,
        ),
    )
    assert config.data_dir_config() == DataDirConfig(
        corruption=CorruptionPolicy.QUARANTINE, archive_dir=Path("/srv/archive")
    )


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, "")
    assert load_file(path) == ServerConfig(config_file=path)


def test_server_fsync_shorthand_sets_default_fsync(tmp_path: Path) -> None:
    config = load_file(write(tmp_path, '[server]\nfsync = "200ms"\n'))
    assert config.default.fsync == FsyncPolicy(FsyncMode.PERIODIC, 200)
    assert config.fsync_override is None


@pytest.mark.parametrize(
    ("text", "policy"),
    [
        ('"always"', FsyncPolicy(FsyncMode.ALWAYS)),
        ('"never"', FsyncPolicy(FsyncMode.NEVER)),
        ("50", FsyncPolicy(FsyncMode.PERIODIC, 50)),
        ('"50ms"', FsyncPolicy(FsyncMode.PERIODIC, 50)),
        ('"NEVER"', FsyncPolicy(FsyncMode.NEVER)),
    ],
)
def test_fsync_spellings(tmp_path: Path, text: str, policy: FsyncPolicy) -> None:
    config = load_file(write(tmp_path, f"[default]\nfsync = {text}\n"))
    assert config.default.fsync == policy


def test_fsync_in_server_and_default_is_an_error(tmp_path: Path) -> None:
    message = error_of('[server]\nfsync = "never"\n[default]\nfsync = "always"\n', tmp_path)
    assert "[server] fsync: also set in [default]" in message


def test_paths_expand_user(tmp_path: Path) -> None:
    config = load_file(write(tmp_path, '[server]\ndata_dir = "~/q"\n'))
    assert config.data_dir == Path("~/q").expanduser()


def test_empty_string_clears_optional_settings(tmp_path: Path) -> None:
    text = '[default]\nerror_queue = "errs"\n[queues.jobs]\nerror_queue = ""\n'
    config = load_file(write(tmp_path, text))
    assert config.default.error_queue == "errs"
    assert config.queue_config("jobs").error_queue is None


# -- inheritance ----------------------------------------------------------------------------


# -- precedence -----------------------------------------------------------------------------

PRECEDENCE_FILE = """
[server]
data_dir = "from-file"
host = "10.0.0.1"
memcache_port = 1000
text_port = 1001
log_level = "ERROR"
checkpoint_interval = 111
fsync = "never"
[queues.jobs]
fsync = "7ms"
"""


def test_file_then_env_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, PRECEDENCE_FILE)
    env = {
        "QUEUED_CONFIG": str(path),
        "QUEUED_DATA_DIR": "from-env",
        "QUEUED_HOST": "10.0.0.2",
        "QUEUED_MEMCACHE_PORT": "2000",
        "QUEUED_LOG_LEVEL": "warning",
        "QUEUED_FSYNC": "100",
        "QUEUED_CHECKPOINT_INTERVAL": "2s",
    }
    flags = parse_flags("--data-dir", "from-flag", "--memcache-port", "3000", "--fsync", "always")
    config = load_config(flags, env=env)
    assert config.config_file == path  # named by QUEUED_CONFIG
    assert config.data_dir == Path("from-flag")  # file < env < flag
    assert config.memcache_port == 3000  # file < env < flag
    assert config.host == "10.0.0.2"  # file < env
    assert config.log_level == "WARNING"  # file < env
    assert config.checkpoint_interval == 2000  # file < env
    assert config.text_port == 1001  # file only
    assert config.rpc_port == 2229  # nowhere: default
    assert config.default.fsync == FsyncPolicy(FsyncMode.ALWAYS)  # file < env < flag
    assert config.fsync_override == FsyncPolicy(FsyncMode.ALWAYS)
    # the flag sets the default; a queue's own fsync in the file stays more specific
    assert config.queue_config("jobs").fsync == FsyncPolicy(FsyncMode.PERIODIC, 7)

    config = load_config(parse_flags(), env=env)
    assert config.data_dir == Path("from-env")
    assert config.default.fsync == FsyncPolicy(FsyncMode.PERIODIC, 100)

    config = load_config(parse_flags(), env={"QUEUED_CONFIG": str(path)})
    assert config.data_dir == Path("from-file")
    assert config.default.fsync == FsyncPolicy(FsyncMode.NEVER)
    assert config.fsync_override is None


def test_config_flag_beats_queued_config(tmp_path: Path) -> None:
    flagged = write(tmp_path, '[server]\nhost = "flagged"\n', "a.toml")
    from_env = write(tmp_path, '[server]\nhost = "from-env"\n', "b.toml")
    config = load_config(
        parse_flags("--config", str(flagged)), env={"QUEUED_CONFIG": str(from_env)}
    )
    assert (config.config_file, config.host) == (flagged, "flagged")


def test_every_flag(tmp_path: Path) -> None:
    path = write(tmp_path, "")
    flags = parse_flags(
        "--config", str(path), "--data-dir", "d", "--host", "::1", "--memcache-port", "0",
        "--text-port", "0", "--rpc-port", "0", "--http-port", "0", "--fsync", "never",
        "--log-level", "debug", "--log-format", "json",
    )  # fmt: skip
    config = load_config(flags, env=NO_ENV)
    assert config == ServerConfig(
        data_dir=Path("d"),
        host="::1",
        memcache_port=0,
        text_port=0,
        rpc_port=0,
        http_port=0,
        log_level="DEBUG",
        log_format="json",
        config_file=path,
        default=QueueConfig(fsync=FsyncPolicy(FsyncMode.NEVER)),
        fsync_override=FsyncPolicy(FsyncMode.NEVER),
    )


def test_flags_not_given_are_none() -> None:
    flags = parse_flags()
    assert all(value is None for value in vars(flags).values())
    assert load_config(flags, env=NO_ENV) == ServerConfig()


def test_flag_help_names_the_env_var() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    text = parser.format_help()
    for var in ("QUEUED_CONFIG", "QUEUED_DATA_DIR", "QUEUED_MEMCACHE_PORT", "QUEUED_FSYNC"):
        assert var in text


def test_mapping_flags_take_any_server_key_and_ignore_others() -> None:
    config = load_config(
        {"memcache_port": 0, "max_line": 99, "data_dir": Path("p"), "command": "serve"},
        env=NO_ENV,
    )
    assert (config.memcache_port, config.max_line, config.data_dir) == (0, 99, Path("p"))


def test_every_env_var() -> None:
    env = {
        "QUEUED_DATA_DIR": "dd",
        "QUEUED_HOST": "h",
        "QUEUED_MEMCACHE_PORT": "11",
        "QUEUED_TEXT_PORT": "12",
        "QUEUED_RPC_PORT": "13",
        "QUEUED_HTTP_PORT": "14",
        "QUEUED_CHECKPOINT_INTERVAL": "1m",
        "QUEUED_EXPIRATION_TIMER": "10",
        "QUEUED_MAX_OPEN_READS": "5",
        "QUEUED_MAX_CONNECTIONS": "6",
        "QUEUED_MAX_ITEM_SIZE": "1k",
        "QUEUED_MAX_LINE": "100",
        "QUEUED_CORRUPTION": "Quarantine",
        "QUEUED_ARCHIVE_DIR": "arch",
        "QUEUED_LOG_LEVEL": "warn",
        "QUEUED_FSYNC": "never",
    }
    config = load_config(env=env)
    assert config == ServerConfig(
        data_dir=Path("dd"),
        host="h",
        memcache_port=11,
        text_port=12,
        rpc_port=13,
        http_port=14,
        checkpoint_interval=60_000,
        expiration_timer=10,
        max_open_reads=5,
        max_connections=6,
        max_item_size=1024,
        max_line=100,
        corruption=CorruptionPolicy.QUARANTINE,
        archive_dir=Path("arch"),
        log_level="WARNING",
        default=QueueConfig(fsync=FsyncPolicy(FsyncMode.NEVER)),
        fsync_override=FsyncPolicy(FsyncMode.NEVER),
    )


def test_empty_env_var_counts_as_unset(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nmemcache_port = 5\n")
    config = load_config(env={"QUEUED_CONFIG": str(path), "QUEUED_MEMCACHE_PORT": ""})
    assert config.memcache_port == 5
    assert load_config(env={"QUEUED_CONFIG": ""}).config_file is None


def test_unknown_env_var_is_logged_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="queued.config"):
        config = load_config(env={"QUEUED_DATADIR": "x", "OTHER": "y"})
    assert config.data_dir == Path("data")
    assert "QUEUED_DATADIR" in caplog.text
    assert "OTHER" not in caplog.text


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUEUED_HOST", "environ-host")
    assert load_config().host == "environ-host"


# -- errors: every message names where and which key ---------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '[queues.jobs]\nmax_items = "x"\n',
            "[queues.jobs] max_items: expected a non-negative integer, got 'x'",
        ),
        ("[default]\nmax_items = -1\n", "[default] max_items: expected a non-negative integer"),
        ("[default]\nmax_items = 1.5\n", "[default] max_items: expected a non-negative integer"),
        ("[default]\nmax_items = true\n", "[default] max_items: expected a non-negative integer"),
        ('[default]\nmax_size = "12 parsecs"\n', "[default] max_size: expected a size"),
        ('[default]\nmax_size = "-5MiB"\n', "[default] max_size: expected a size"),
        ('[default]\nmax_size = "0.5B"\n', "[default] max_size: expected a size"),
        ("[default]\nmax_size = 2.5\n", "[default] max_size: expected a size"),
        ('[default]\nmax_memory_size = "0MiB"\n', "max_memory_size: expected a positive size"),
        ("[default]\njournal_size = 0\n", "[default] journal_size: expected a positive size"),
        ('[default]\nmax_age = "5 fortnights"\n', "[default] max_age: expected a duration"),
        ('[default]\nmax_age = "1.5"\n', "[default] max_age: expected a duration"),
        ('[server]\ncheckpoint_interval = "0s"\n', "expected a positive duration, got '0s'"),
        ('[default]\ndiscard_old_when_full = "yes"\n', "expected a boolean (true or false"),
        ("[default]\ndiscard_old_when_full = 1\n", "discard_old_when_full: expected a boolean"),
        ('[default]\nfsync = "sometimes"\n', "[default] fsync: expected 'always', 'never'"),
        ("[default]\nfsync = true\n", "[default] fsync: expected 'always', 'never'"),
        ('[default]\njournal_full_policy = "shrug"\n', "expected 'refuse' or 'drop_oldest'"),
        ('[server]\ncorruption = "ignore"\n', "[server] corruption: expected 'refuse' or"),
        ('[default]\nerror_queue = "bad name"\n', "[default] error_queue: expected a queue name"),
        ('[default]\nexpire_to_queue = "q+r"\n', "expire_to_queue: expected a queue name"),
        ("[server]\nmemcache_port = 65536\n", "[server] memcache_port: expected a port number"),
        ("[server]\nhttp_port = -1\n", "[server] http_port: expected a port number"),
        ('[server]\nhost = ""\n', "[server] host: expected a non-empty string"),
        ('[server]\nhost = "a b"\n', "[server] host: expected a host name or address"),
        ("[server]\ndata_dir = 5\n", "[server] data_dir: expected a non-empty string"),
        ('[server]\nlog_level = "LOUD"\n', "[server] log_level: expected one of DEBUG, INFO"),
        ('[server]\nlog_format = "xml"\n', "[server] log_format: expected one of text, json"),
        ("[server]\nshutdown_grace = 0\n", "[server] shutdown_grace: expected a positive"),
        ("[server]\nmetrics_max_queues = -1\n", "[server] metrics_max_queues: expected a non-"),
        ('[server]\nmin_free_disk = "lots"\n', "[server] min_free_disk: expected a size"),
        ("[server]\nmax_connections = 0\n", "[server] max_connections: expected a positive"),
    ],
)
def test_bad_values(tmp_path: Path, text: str, expected: str) -> None:
    message = error_of(text, tmp_path)
    assert message.startswith(f"{tmp_path / 'config.toml'}: ")
    assert expected in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[default]\nmax_itmes = 1\n",
            "[default] max_itmes: unknown key (did you mean 'max_items'?)",
        ),
        ("[queues.jobs]\nmaxItems = 1\n", "[queues.jobs] maxItems: unknown key (did you mean "),
        ("[server]\nconfig_file = 'x'\n", "[server] config_file: unknown key"),
        ("[server]\nmax_items = 1\n", "[server] max_items: unknown key"),
        ("[default]\nhost = 'x'\n", "[default] host: unknown key"),
        ("[queue.jobs]\nmax_items = 1\n", "queue: unknown top-level key"),
        ('data_dir = "x"\n', "data_dir: unknown top-level key; expected [server], [default] or"),
        ("server = 1\n", "server: expected a table [server], got 1"),
        ("[queues]\njobs = 1\n", "[queues.jobs]: expected a table of queue settings, got 1"),
        ("[queues.a.b]\nmax_items = 1\n", "[queues.a] b: unknown key"),
    ],
)
def test_unknown_keys_and_misplaced_tables(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in error_of(text, tmp_path)


def test_unknown_key_suggests_snake_case(tmp_path: Path) -> None:
    message = error_of("[queues.jobs]\nmaxItems = 1\n", tmp_path)
    assert message.endswith("unknown key (did you mean 'max_items'?)")
    assert error_of("[default]\nzzz = 1\n", tmp_path).endswith("[default] zzz: unknown key")


@pytest.mark.parametrize(
    "name",
    ["bad name", "", "x" * 251, "a/b", "a.b", "q+", "+r", "q+r+s", "q+bad name", "é"],
)
def test_bad_queue_names(tmp_path: Path, name: str) -> None:
    message = error_of(f'[queues."{name}"]\nmax_items = 1\n', tmp_path)
    assert f"invalid queue name {name!r}" in message
    assert "[A-Za-z0-9_:-]{1,250}" in message


def test_longest_valid_name(tmp_path: Path) -> None:
    name = "x" * 250
    config = load_file(write(tmp_path, f'[queues."{name}+{name}"]\nmax_items = 1\n'))
    assert config.reader_config(name, name).max_items == 1


@pytest.mark.parametrize("key", sorted(cfg.JOURNAL_KEYS))
def test_journal_key_on_reader_section(tmp_path: Path, key: str) -> None:
    value = {"journal_full_policy": '"refuse"', "fsync": '"never"'}.get(key, "1024")
    message = error_of(f'[queues."jobs+audit"]\n{key} = {value}\n', tmp_path)
    assert f'[queues."jobs+audit"] {key}: not settable for a fanout reader' in message
    assert "set it in [queues.jobs]" in message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=r"nope\.toml: cannot read config file named by --config"):
        load_config({"config": str(path)}, env=NO_ENV)
    with pytest.raises(ConfigError, match="named by QUEUED_CONFIG: No such file"):
        load_config(env={"QUEUED_CONFIG": str(path)})


def test_directory_as_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config({"config": str(tmp_path)}, env=NO_ENV)


@pytest.mark.parametrize(
    "text", ["[server\n", "max_items = \n", "[default]\na = 1\na = 2\n", "\xff = 1\n"]
)
def test_invalid_toml(tmp_path: Path, text: str) -> None:
    message = error_of(text, tmp_path)
    assert message.startswith(f"{tmp_path / 'config.toml'}: invalid TOML: ")


def test_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(b'[server]\nhost = "\xff"\n')
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_file(path)


@pytest.mark.parametrize(
    ("var", "value", "expected"),
    [
        ("QUEUED_MEMCACHE_PORT", "70000", "QUEUED_MEMCACHE_PORT: expected a port number"),
        ("QUEUED_TEXT_PORT", "http", "QUEUED_TEXT_PORT: expected a port number 0..65535"),
        ("QUEUED_RPC_PORT", "-1", "QUEUED_RPC_PORT: expected a port number"),
        ("QUEUED_HTTP_PORT", "1.0", "QUEUED_HTTP_PORT: expected a port number"),
        ("QUEUED_FSYNC", "often", "QUEUED_FSYNC: expected 'always', 'never' or a number of ms"),
        ("QUEUED_CHECKPOINT_INTERVAL", "soon", "QUEUED_CHECKPOINT_INTERVAL: expected a duration"),
        ("QUEUED_MAX_ITEM_SIZE", "big", "QUEUED_MAX_ITEM_SIZE: expected a size"),
        ("QUEUED_LOG_LEVEL", "chatty", "QUEUED_LOG_LEVEL: expected one of"),
        ("QUEUED_CORRUPTION", "skip", "QUEUED_CORRUPTION: expected 'refuse' or 'quarantine'"),
        ("QUEUED_MAX_LINE", "0", "QUEUED_MAX_LINE: expected a positive integer, got '0'"),
    ],
)
def test_bad_env(var: str, value: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={var: value})
    assert str(info.value).startswith(expected)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (("--memcache-port", "65536"), "--memcache-port: expected a port number 0..65535"),
        (("--http-port", "x"), "--http-port: expected a port number"),
        (("--fsync", "sometimes"), "--fsync: expected 'always', 'never'"),
        (("--log-level", "LOUD"), "--log-level: expected one of"),
        (("--host", " "), "--host: expected a non-empty string"),
    ],
)
def test_bad_flags(argv: tuple[str, ...], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(parse_flags(*argv), env=NO_ENV)
    assert str(info.value).startswith(expected)


def test_flag_errors_win_over_good_env() -> None:
    with pytest.raises(ConfigError, match="--rpc-port"):
        load_config(parse_flags("--rpc-port", "99999"), env={"QUEUED_RPC_PORT": "1"})


def test_duplicate_ports() -> None:
    with pytest.raises(ConfigError, match="rpc_port and memcache_port are both 5000"):
        load_config({"memcache_port": 5000, "rpc_port": 5000}, env=NO_ENV)
    # port 0 (any free port) may repeat
    config = load_config({"memcache_port": 0, "text_port": 0}, env=NO_ENV)
    assert config.memcache_port == config.text_port == 0


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("FALSE", False), ("1", True), ("0", False), ("yes", True), ("No", False)],
)
def test_env_bool_spellings(value: str, expected: bool) -> None:
    assert keys.parse_bool(value, True) is expected


@pytest.mark.parametrize("value", ["maybe", "", "2", "y"])
def test_env_bad_bool(value: str) -> None:
    with pytest.raises(ValueError, match="expected true/false/1/0/yes/no"):
        keys.parse_bool(value, True)


# -- sizes and durations --------------------------------------------------------------------


# -- reload ---------------------------------------------------------------------------------


def test_reload_replaces_queue_config_and_keeps_server_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nmemcache_port = 1\n[queues.jobs]\nmax_items = 5\n")
    config = load_config({"config": str(path), "host": "flag-host"}, env=NO_ENV)
    path.write_text(
        '[server]\nmemcache_port = 2\nhost = "file-host"\nfsync = "never"\n'
        "[default]\nmax_items = 7\n[queues.other]\nmax_age = 10\n"
    )
    reloaded = reload_queue_configs(config)
    assert reloaded.memcache_port == 1  # server keys need a restart
    assert reloaded.host == "flag-host"
    assert reloaded.config_file == path
    assert reloaded.default == QueueConfig(max_items=7, fsync=FsyncPolicy(FsyncMode.NEVER))
    assert set(reloaded.queues) == {"other"}
    assert reloaded.queue_config("jobs").max_items == 7  # its section is gone
    assert reloaded.queue_config("other").max_age == 10
    assert dataclasses.replace(reloaded, default=config.default, queues=config.queues) == config


def test_reload_keeps_env_and_flag_fsync(tmp_path: Path) -> None:
    path = write(tmp_path, '[default]\nfsync = "never"\n')
    config = load_config({"config": str(path)}, env={"QUEUED_FSYNC": "30ms"})
    assert config.default.fsync == FsyncPolicy(FsyncMode.PERIODIC, 30)
    path.write_text('[default]\nfsync = "always"\nmax_items = 3\n')
    reloaded = reload_queue_configs(config)
    assert reloaded.default == QueueConfig(max_items=3, fsync=FsyncPolicy(FsyncMode.PERIODIC, 30))


def test_reload_of_invalid_file_raises(tmp_path: Path) -> None:
    path = write(tmp_path, "[queues.jobs]\nmax_items = 5\n")
    config = load_file(path)
    path.write_text("[queues.jobs]\nmax_itmes = 5\n")
    with pytest.raises(ConfigError, match=r"\[queues.jobs\] max_itmes: unknown key"):
        reload_queue_configs(config)
    path.write_text('[server]\nmemcache_port = "x"\n')  # server keys are still validated
    with pytest.raises(ConfigError, match=r"\[server\] memcache_port"):
        reload_queue_configs(config)
    path.unlink()
    with pytest.raises(ConfigError, match="cannot read config file"):
        reload_queue_configs(config)
    assert config.queue_config("jobs").max_items == 5  # the caller's config is untouched


def test_reload_without_file_is_a_no_op() -> None:
    config = load_config({"memcache_port": 0}, env=NO_ENV)
    assert reload_queue_configs(config) is config


# -- describe -------------------------------------------------------------------------------


def test_describe_mentions_everything(tmp_path: Path) -> None:
    path = write(tmp_path, FULL + INHERIT.replace("[default]", "[queues.more]"))
    config = load_file(path)
    text = describe(config)
    assert f"config file: {path}" in text
    assert 'data_dir = "/var/lib/queued"' in text
    assert 'max_memory_size = "1GiB"' in text
    assert 'max_queue_age = "30m"' in text
    assert 'fsync = "never"' in text
    assert '[queues."jobs+audit"]' in text
    assert "[queues.jobs]" in text
    assert 'fsync = "20ms"' in text
    assert "config file: none" in describe(ServerConfig())


@pytest.mark.parametrize("text", [FULL, INHERIT, PRECEDENCE_FILE, ""])
def test_describe_is_toml_that_loads_back(tmp_path: Path, text: str) -> None:
    config = load_file(write(tmp_path, text))
    again = load_file(write(tmp_path, describe(config), "described.toml"))
    assert dataclasses.replace(again, config_file=config.config_file) == config
