"""Checking credentials: the users file loaded, passwords verified off the event loop.

Owns the server's users (re-read on reload / SIGHUP; a bad file keeps the old users),
the password check (scrypt in a worker thread, at most `CHECKS_AT_ONCE` at a time so a
flood of logins cannot take every core or much memory), a small cache of checks that
passed (keyed by a keyed hash of the password, never the password: clients that open
many connections do not pay scrypt each time), and the delay before a refusal.
Logs name the user and the peer, never a password.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import trio

from queued.config.users import DUMMY, User, load_users
from queued.wire.access import MAX_PASSWORD, Grant

log = logging.getLogger("queued.auth")

#: Password checks running at once (each scrypt takes ~16 MiB and tens of ms of a core).
CHECKS_AT_ONCE: Final = 2
#: Seconds a refused login waits before its answer (slows guessing; the connection closes).
FAIL_DELAY: Final = 0.5
#: Checks that passed, remembered (user, keyed hash of the password) -> the user's entry.
CACHE_SIZE: Final = 1024


class Authenticator:
    """The users of `path` and the checks of their passwords."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.users: Mapping[str, User] = load_users(path)
        self.failures = 0
        self._limiter = trio.CapacityLimiter(CHECKS_AT_ONCE)
        self._key = secrets.token_bytes(32)  # this process's: cache keys mean nothing outside
        self._passed: dict[tuple[str, bytes], User] = {}

    def reload(self) -> None:
        """Re-read the users file (raises UsersError and keeps the old users if it is bad)."""
        self.users = load_users(self.path)
        self._passed.clear()
        log.info("users file %s: %d users", self.path, len(self.users))

    def knows(self, name: str) -> bool:
        """Whether `name` is a user of the users file (no password checked)."""
        return name in self.users

    async def login(self, name: str, password: str, peer: str) -> Grant | None:
        """The grant of `name` if `password` is its password; None (after FAIL_DELAY,
        logged with the peer's address) if not."""
        user = self.users.get(name)
        if len(password) > MAX_PASSWORD and len(password.encode()) > MAX_PASSWORD:
            user = None  # never valid (see MAX_PASSWORD); checked as an unknown user is
        key = (name, hmac.new(self._key, password.encode(), hashlib.sha256).digest())
        if user is not None and self._passed.get(key) is user:
            return user.grant()
        check = user.password if user is not None else DUMMY
        ok = await trio.to_thread.run_sync(check.verify, password, limiter=self._limiter)
        if ok and user is not None and self.users.get(name) is user:
            if len(self._passed) >= CACHE_SIZE:
                self._passed.clear()
            self._passed[key] = user
            return user.grant()
        self.failures += 1
        log.warning("%s: authentication failed for user %r", peer, name[:64],
                    extra={"event": "auth_failed", "peer": peer})
        await trio.sleep(FAIL_DELAY)
        return None
