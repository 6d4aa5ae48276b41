"""Who may do what: a user's permissions and the one table of what each command needs.

Owns the three permissions (put, get, admin), the queue-name patterns they carry
(fnmatch, case-sensitive; a fanout name "q+r" counts as queue q), `needed`, which
says for every protocol-neutral command which permission on which queue it takes, and
what of the server's figures each grant sees (`visible`, `sees_everything`).
PURE: the users file is read by `queued.config.users`, passwords are checked by
`queued.server.auth`; the session asks `Grant.denied` before it runs a command.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Final

from queued.wire import commands as c


class Permission(enum.Enum):
    PUT = "put"
    GET = "get"  # get, peek, open/close/abort, confirm, monitor, touch, reject, browse
    ADMIN = "admin"  # flush, flush_all, delete, shutdown, reload, dump_stats, flush_expired,
    # pause, resume, move


#: Commands every authenticated user may run (stats shows only the queues one may use).
_OPEN: Final = (c.Stats, c.Version, c.Quit, c.Auth)
_GET: Final = (c.Get, c.Peek, c.Confirm, c.Abort, c.Monitor, c.Touch, c.Reject, c.Browse)
_ADMIN: Final = (c.Flush, c.FlushAll, c.FlushExpired, c.FlushAllExpired, c.Delete,
                 c.Reload, c.Shutdown, c.Pause, c.Move)
#: Results a grant remembers per queue and permission before it starts again.
_CACHE: Final = 1024
#: The server figures of `stats` a user who is not an admin sees: they count no queue
#: (its uptime, clock and version, which the open `version` command tells it anyway).
OWN_FIGURES: Final = ("uptime", "time", "version")
#: The longest user name (the users file refuses longer ones).
MAX_USER_NAME: Final = 64
#: The longest password, in UTF-8 bytes: `queued passwd` refuses a longer one and a login
#: with one fails, so no longer credential pair is ever valid (the memcache codec relies
#: on that to tell a login set from an item).
MAX_PASSWORD: Final = 1024


def needed(command: c.Command) -> tuple[Permission, str | None] | None:
    """The permission `command` takes and the queue it takes it on (None: server-wide);
    None when any authenticated user may run it."""
    t = type(command)
    if t is c.Put:
        return Permission.PUT, command.queue  # type: ignore[union-attr]
    if t in _GET:
        return Permission.GET, command.queue  # type: ignore[union-attr]
    if t is c.Stats:
        return (Permission.ADMIN, None) if command.dump else None  # type: ignore[union-attr]
    if t in _OPEN:
        return None
    if t in _ADMIN:
        return Permission.ADMIN, getattr(command, "queue", None)
    raise AssertionError(f"no permission known for {t.__name__}")  # a new command: add it


def queue_of(name: str) -> str:
    """The queue a name stands for: a fanout reader "q+r" is queue q."""
    return name.partition("+")[0]


@dataclass(slots=True)
class Grant:
    """One user's permissions: queue-name patterns for put and get, and admin; `metrics`:
    a scraper's, which reads all of /metrics and may do nothing else."""

    user: str
    put: Sequence[str] = ()
    get: Sequence[str] = ()
    admin: bool = False
    metrics: bool = False
    _seen: dict[tuple[Permission, str], bool] = field(default_factory=dict, repr=False)

    def may(self, permission: Permission, queue: str | None) -> bool:
        if permission is Permission.ADMIN:
            return self.admin
        if queue is None:
            return False
        key = (permission, queue)
        found = self._seen.get(key)
        if found is None:
            name = queue_of(queue)
            patterns = self.put if permission is Permission.PUT else self.get
            found = any(fnmatchcase(name, p) for p in patterns)
            if len(self._seen) >= _CACHE:
                self._seen.clear()
            self._seen[key] = found
        return found

    def may_see(self, queue: str) -> bool:
        """A queue this user may put to or get from (what `stats` shows it)."""
        return self.admin or self.may(Permission.PUT, queue) or self.may(Permission.GET, queue)

    def denied(self, command: c.Command) -> str | None:
        """Why this user may not run `command` (naming the permission and the queue), or
        None when it may."""
        need = needed(command)
        if need is None or self.may(*need):
            return None
        permission, queue = need
        where = f" on queue {queue_of(queue)!r}" if queue is not None else ""
        return f"permission denied: user {self.user!r} lacks {permission.value!r}{where}"


#: What a server without users grants every connection.
ANONYMOUS: Final = Grant("anonymous", ("*",), ("*",), admin=True)


def visible(figures: Mapping[str, object], grant: Grant | None) -> dict[str, object]:
    """The `stats` figures ({"server": ..., "queues": {name: ...}}) as `grant` may see them:
    all for an admin (None: no users, all); for anyone else only the queues it may put to
    or get from and, of the server's, only `OWN_FIGURES` (the rest count every queue)."""
    if grant is None or grant.admin:
        return dict(figures)
    server: Mapping[str, object] = figures["server"]  # type: ignore[assignment]
    queues: Mapping[str, object] = figures["queues"]  # type: ignore[assignment]
    return {"server": {k: server[k] for k in OWN_FIGURES if k in server},
            "queues": {k: v for k, v in queues.items() if grant.may_see(k)}}


def sees_everything(grant: Grant | None) -> bool:
    """Whether /metrics shows `grant` every queue and the server-wide series: an admin,
    a metrics user, or no users at all (None)."""
    return grant is None or grant.admin or grant.metrics
