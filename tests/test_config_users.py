"""The users file and password hashes (queued.config.users): a hash verifies its own
password only, the default cost, bad files and permission lists refused with the key
named, and parsed users carrying their permissions. Logins over the wire: test_security.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from security_util import FAST

from queued.config.users import PasswordHash, UsersError, hash_password, parse_users


def test_hash_verifies_its_password_only() -> None:
    h = PasswordHash.parse(hash_password("s3cret word", log_n=FAST))
    assert h.verify("s3cret word")
    assert not h.verify("s3cret word ")
    assert not h.verify("")
    assert hash_password("x", log_n=FAST) != hash_password("x", log_n=FAST)  # salted


def test_default_hash_cost() -> None:
    assert hash_password("x").startswith("$scrypt$ln=14,r=8,p=1$")


@pytest.mark.parametrize(("text", "message"), [
    ('[users.a]\npassword = "hunter2"\n', "not a plaintext password"),
    ("[users.a]\nput = []\n", "password: missing"),
    ('[users.a]\npassword = "$scrypt$ln=30,r=8,p=1$AAAAAAAAAAAAAAAAAAAAAA$'
     'AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"\n', "cost out of range"),
    ("[users.a]\npassword = 'H'\nadmin = 'yes'\n", "password"),
    ("[users.\"a b\"]\npassword = 'x'\n", "user name"),
    ("[users.a]\npasword = 'x'\n", "unknown key"),
    ("[other]\n", "unknown top-level key"),
    ("[users.a\n", "invalid TOML"),
])
def test_bad_users_files_are_refused_with_the_key_named(text: str, message: str) -> None:
    with pytest.raises(UsersError, match=message):
        parse_users(text, "users.toml")


def test_bad_permission_lists_are_refused() -> None:
    good = hash_password("x", log_n=FAST)
    with pytest.raises(UsersError, match="put: expected a list"):
        parse_users(f'[users.a]\npassword = "{good}"\nput = "orders"\n', "f")
    with pytest.raises(UsersError, match="admin: expected true or false"):
        parse_users(f'[users.a]\npassword = "{good}"\nadmin = "yes"\n', "f")


def test_parsed_users_carry_their_permissions(users_file: Path) -> None:
    users = parse_users(users_file.read_text(), "f")
    assert set(users) == {"alice", "bob", "root"}
    assert users["alice"].put == ("orders", "jobs-*") and not users["alice"].admin
    assert users["root"].admin and users["alice"].password.verify("alice pw")
