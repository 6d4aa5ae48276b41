"""The users file and password hashes: who may connect, and with which permissions.

Owns the file's layout (TOML, one `[users.NAME]` table each: `password`, `put`, `get`,
`admin`, `metrics`), its checks (a plaintext password is refused: only hashes made by `queued
passwd` are accepted), and the hash itself: scrypt (hashlib, OpenSSL's), salted, in
the PHC string format `$scrypt$ln=14,r=8,p=1$<salt>$<hash>` (unpadded base64), checked
in constant time. It reads files and computes hashes; it never opens sockets or waits
(the server runs `verify` in a thread: a check takes tens of milliseconds by design).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from queued.errors import QueuedError
from queued.wire.access import MAX_PASSWORD, MAX_USER_NAME, Grant

#: scrypt cost: N = 2**LOG_N, r, p. 2**14 x 8 x 128 B = 16 MiB and ~50 ms per check.
LOG_N: Final = 14
BLOCK: Final = 8
PARALLEL: Final = 1
SALT_BYTES: Final = 16
HASH_BYTES: Final = 32
#: A hash's cost is read from it; more than this is refused (a file could ask for GiBs).
MAX_LOG_N: Final = 20
MAXMEM: Final = 1 << 30
USER_RE: Final = re.compile(rf"[A-Za-z0-9_.@:-]{{1,{MAX_USER_NAME}}}")
_HASH_RE: Final = re.compile(
    r"\$scrypt\$ln=(\d{1,2}),r=(\d{1,2}),p=(\d{1,2})\$([A-Za-z0-9+/]{16,})\$([A-Za-z0-9+/]{40,})")
_KEYS: Final = frozenset({"password", "put", "get", "admin", "metrics"})


class UsersError(QueuedError):
    """The users file cannot be used; the message names the file, the user and the key."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4))


def hash_password(password: str, *, log_n: int = LOG_N) -> str:
    """A new salted scrypt hash of `password`, in PHC string format (ValueError if it is
    longer than MAX_PASSWORD bytes: no login could use it)."""
    if len(password.encode()) > MAX_PASSWORD:
        raise ValueError(f"a password is at most {MAX_PASSWORD} bytes")
    salt = secrets.token_bytes(SALT_BYTES)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=1 << log_n, r=BLOCK, p=PARALLEL,
                            maxmem=MAXMEM, dklen=HASH_BYTES)
    return f"$scrypt$ln={log_n},r={BLOCK},p={PARALLEL}${_b64(salt)}${_b64(digest)}"


@dataclass(frozen=True, slots=True)
class PasswordHash:
    log_n: int
    r: int
    p: int
    salt: bytes
    digest: bytes = field(repr=False)

    @classmethod
    def parse(cls, text: str) -> PasswordHash:
        """Raises ValueError unless `text` is a hash `hash_password` could have made."""
        m = _HASH_RE.fullmatch(text)
        if m is None:
            raise ValueError("expected a hash made by `queued passwd` ($scrypt$ln=...), "
                             "not a plaintext password")
        log_n, r, p = int(m[1]), int(m[2]), int(m[3])
        if not (1 <= log_n <= MAX_LOG_N and 1 <= r <= 32 and 1 <= p <= 16):
            raise ValueError(f"scrypt cost out of range (ln 1..{MAX_LOG_N}, r 1..32, p 1..16)")
        return cls(log_n, r, p, _unb64(m[4]), _unb64(m[5]))

    def verify(self, password: str) -> bool:
        """Whether `password` is the one hashed: the digests compared in constant time."""
        got = hashlib.scrypt(password.encode(), salt=self.salt, n=1 << self.log_n, r=self.r,
                             p=self.p, maxmem=MAXMEM, dklen=len(self.digest))
        return hmac.compare_digest(got, self.digest)


#: Checked for a user that does not exist, so a wrong name costs what a wrong password does.
DUMMY: Final = PasswordHash(LOG_N, BLOCK, PARALLEL, b"\0" * SALT_BYTES, b"\0" * HASH_BYTES)


@dataclass(frozen=True, slots=True)
class User:
    name: str
    password: PasswordHash
    put: tuple[str, ...] = ()
    get: tuple[str, ...] = ()
    admin: bool = False
    metrics: bool = False  # a scraper: all of /metrics, nothing else

    def grant(self) -> Grant:
        return Grant(self.name, self.put, self.get, self.admin, self.metrics)


def _patterns(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise UsersError(f"{where}: expected a list of queue-name patterns, e.g. "
                         f'["orders", "jobs.*"], got {value!r}')
    return tuple(value)


def parse_users(text: str, label: str) -> dict[str, User]:
    """The users of a users file's text; raises UsersError naming `label` and the key."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsersError(f"{label}: invalid TOML: {exc}") from None
    extra = set(doc) - {"users"}
    if extra:
        raise UsersError(f"{label}: {sorted(extra)[0]}: unknown top-level key; expected "
                         "[users.<name>] tables")
    table = doc.get("users", {})
    if not isinstance(table, dict):
        raise UsersError(f"{label}: users: expected [users.<name>] tables")
    users: dict[str, User] = {}
    for name, section in table.items():
        where = f"{label}: [users.{name}]"
        if not USER_RE.fullmatch(name):
            raise UsersError(f"{where}: a user name is 1-64 of A-Z a-z 0-9 _ . @ : -")
        if not isinstance(section, dict):
            raise UsersError(f"{where}: expected a table")
        unknown = set(section) - _KEYS
        if unknown:
            raise UsersError(f"{where} {sorted(unknown)[0]}: unknown key; expected "
                             "password, put, get, admin, metrics")
        if "password" not in section or not isinstance(section["password"], str):
            raise UsersError(f"{where} password: missing; set it to what `queued passwd` prints")
        try:
            password = PasswordHash.parse(section["password"])
        except ValueError as exc:
            raise UsersError(f"{where} password: {exc}") from None
        admin, metrics = _flag(section, "admin", where), _flag(section, "metrics", where)
        put = _patterns(section.get("put", []), f"{where} put")
        get = _patterns(section.get("get", []), f"{where} get")
        if metrics and (put or get or admin):
            raise UsersError(f"{where} metrics: a metrics user may only read /metrics; give "
                             "put, get or admin to another user")
        users[name] = User(name, password, put, get, admin, metrics)
    return users


def _flag(section: Mapping[str, object], key: str, where: str) -> bool:
    value = section.get(key, False)
    if not isinstance(value, bool):
        raise UsersError(f"{where} {key}: expected true or false, got {value!r}")
    return value


def load_users(path: Path) -> Mapping[str, User]:
    """The users of the file at `path`; raises UsersError (unreadable, invalid)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsersError(f"{path}: cannot read the users file: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsersError(f"{path}: invalid TOML: not UTF-8 at byte {exc.start}") from None
    return parse_users(text, str(path))
