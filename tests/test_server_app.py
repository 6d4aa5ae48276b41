"""The server process's start (queued.server.app): loopback hosts, the refusal to listen
beyond loopback without users (unless the risk is accepted), TLS settings in pairs, and
bad certificate or users files stopping the start before any port opens."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from security_util import Pki, tls_settings
from server_util import (
    QUEUED,
    make_config,
)

from queued.config import ConfigError
from queued.server.app import check_exposure, is_loopback, open_security


def test_loopback_hosts() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::")


def test_non_loopback_host_needs_users_or_an_explicit_risk(tmp_path: Path,
                                                           users_file: Path) -> None:
    with pytest.raises(ConfigError, match="allow_anonymous") as info:
        check_exposure(make_config(tmp_path / "d", host="0.0.0.0"))
    assert "users_file" in str(info.value)
    check_exposure(make_config(tmp_path / "d", host="0.0.0.0", allow_anonymous="true"))
    check_exposure(make_config(tmp_path / "d", host="0.0.0.0", users_file=str(users_file)))
    check_exposure(make_config(tmp_path / "d"))  # loopback: fine


def test_serve_refuses_to_listen_beyond_loopback_without_users(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(QUEUED), "serve", "--data-dir", str(tmp_path / "d"), "--host", "0.0.0.0",
         "--memcache-port", "0", "--text-port", "0", "--rpc-port", "0", "--http-port", "0"],
        capture_output=True, timeout=60, stdin=subprocess.DEVNULL,
        env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert b"QUEUED_ALLOW_ANONYMOUS=1" in proc.stderr and b"--users-file" in proc.stderr
    assert b"listening for" not in proc.stderr


def test_tls_settings_must_come_in_pairs(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(ConfigError, match="set both"):
        make_config(tmp_path / "d", tls_cert=str(pki.cert))
    with pytest.raises(ConfigError, match="needs tls_cert"):
        make_config(tmp_path / "d", tls_client_ca=str(pki.ca_file))


def test_bad_certificate_or_users_files_stop_the_start(tmp_path: Path, pki: Pki) -> None:
    pki.key.write_text("not a key")
    with pytest.raises(ConfigError, match=r"server\.key: cannot load"):
        open_security(make_config(tmp_path / "data", **tls_settings(pki)))
    with pytest.raises(ConfigError, match="cannot read the users file"):
        open_security(make_config(tmp_path / "data", users_file=str(tmp_path / "none")))
