"""Checking credentials (queued.server.auth.Authenticator) against real users files with
cheap hashes: a good password gives the user's grant, a wrong one or an unknown user is
refused after FAIL_DELAY of trio time (on the test's MockClock: no real wait), a reload
takes a changed file (and forgets the checks that passed), a password over the cap never
logs in. Logins over the wire: test_security.py and test_login_again.py."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import pytest
import trio
import trio.testing
from security_util import users_toml
from wait_util import autojumping

from queued.config.users import UsersError
from queued.server import auth
from queued.server.auth import Authenticator
from queued.wire.access import MAX_PASSWORD, Permission


def users_file(tmp_path: Path, **passwords: str) -> Path:
    path = tmp_path / "users.toml"
    path.write_text(users_toml(**{name: {"password": pw, "put": ["jobs"], "get": ["jobs"]}
                                  for name, pw in passwords.items()}))
    return path


async def test_a_good_password_gives_the_grant_a_bad_one_nothing_after_the_delay(
        tmp_path: Path, trio_clock: trio.testing.MockClock) -> None:
    a = Authenticator(users_file(tmp_path, alice="alice pw"))
    assert a.knows("alice") and not a.knows("mallory")
    with autojumping(trio_clock):  # (no deadline is pending while scrypt runs in its thread)
        grant = await a.login("alice", "alice pw", "test")
        assert grant is not None and grant.may(Permission.PUT, "jobs")
        assert grant.user == "alice" and not grant.may(Permission.PUT, "orders")
        for name, password in (("alice", "wrong"), ("mallory", "alice pw")):
            started = trio.current_time()
            assert await a.login(name, password, "test") is None
            assert trio.current_time() - started >= auth.FAIL_DELAY
    assert a.failures == 2


async def test_a_reload_takes_the_new_file_and_forgets_passed_checks(
        tmp_path: Path, trio_clock: trio.testing.MockClock) -> None:
    path = users_file(tmp_path, alice="first")
    a = Authenticator(path)
    assert await a.login("alice", "first", "test") is not None  # (now in the cache)
    users_file(tmp_path, alice="second")
    assert await a.login("alice", "first", "test") is not None  # the file is read on reload
    a.reload()
    assert await a.login("alice", "second", "test") is not None
    with autojumping(trio_clock):  # (a refusal waits FAIL_DELAY of trio time)
        assert await a.login("alice", "first", "test") is None
    path.write_text("[users.bob]\npassword = \"plaintext\"\n")
    with pytest.raises(UsersError):
        a.reload()
    assert a.knows("alice") and not a.knows("bob")  # a bad file keeps the old users


async def test_a_password_over_the_cap_never_logs_in(
        tmp_path: Path, trio_clock: trio.testing.MockClock) -> None:
    """Even when its hash matches (made by hand, past `queued passwd`'s refusal)."""
    long = "p" * (MAX_PASSWORD + 1)
    salt = b"0123456789abcdef"
    digest = hashlib.scrypt(long.encode(), salt=salt, n=16, r=8, p=1, dklen=32)
    b64 = base64.b64encode
    path = tmp_path / "users.toml"
    path.write_text(f'[users.eve]\npassword = "$scrypt$ln=4,r=8,p=1$'
                    f'{b64(salt).decode().rstrip("=")}${b64(digest).decode().rstrip("=")}"\n')
    a = Authenticator(path)
    assert a.users["eve"].password.verify(long)
    with autojumping(trio_clock):  # (the refusal waits FAIL_DELAY of trio time)
        assert await a.login("eve", long, "test") is None
