"""The web console on the operations port: its pages, its one JSON view of a queue's
items page by page, and its admin actions (flush, delete, pause, resume, and a redrive:
move).

Owns the console's routes, what each needs (the pages and the item pages: a user who
may see the queue, as `stats` filters; the item pages: `get` on it; the actions: an
admin, users configured, and a same-origin request), and the safe preview of item bytes.
The pages are static files shipped in the package (`queued/server/static`) that read
every figure from /stats.json; this module never formats the queues' statistics itself,
never removes, opens or takes an item to show it (it pages with the broker's `browse`),
and never puts item bytes in HTML. `queued.server.http` parses the requests and logs in
the user; this module only answers.
"""

from __future__ import annotations

import logging
import string
import time
from collections.abc import Mapping
from importlib import resources
from typing import TYPE_CHECKING, Final
from urllib.parse import parse_qsl, unquote

from queued.errors import JournalError
from queued.journal.headers import header_pairs
from queued.server.history import History
from queued.server.replies import JSON, Reply, json_reply
from queued.wire.access import Grant, Permission
from queued.wire.parsing import ArgumentError, parse_address

if TYPE_CHECKING:
    from queued.broker.broker import Broker
    from queued.reader.state import Item

log = logging.getLogger("queued.console")

#: Every reply of the port carries these (the console's pages need them; the rest lose
#: nothing): scripts, styles, fetches and images from this origin only, no inline script
#: or style, no framing, no form posts, no plugins.
SECURITY_HEADERS: Final = (
    ("Content-Security-Policy",
     "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
     "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
)
#: The header a console action must carry. A cross-site form cannot set a header, and a
#: cross-site fetch that sets one needs a CORS preflight this port never grants.
ACTION_HEADER: Final = "x-queued-console"
#: Items a page of the queue view shows, and the bytes of each it previews.
HEAD_ITEMS: Final = 10
#: Parameters a page request's query string may carry (more: a 400).
MAX_QUERY_FIELDS: Final = 8
PREVIEW_BYTES: Final = 256

#: URL path -> (file in queued/server/static, Content-Type).
_STATIC: Final = {
    "/console/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "/console/console.css": ("console.css", "text/css; charset=utf-8"),
    "/console/icon.svg": ("icon.svg", "image/svg+xml"),
}
_PAGES: Final = {"index": "index.html", "queue": "queue.html"}
_HTML: Final = "text/html; charset=utf-8"
_ACTIONS: Final = ("flush", "delete", "pause", "resume", "move")
#: The charts' data: every queue the user may see, the last 15 minutes (server/history.py).
HISTORY_PATH: Final = "/api/history"
#: Items one redrive from the console moves at most (the page says so; `queued move` and
#: the RPC `move` have no such cap), so an HTTP request never runs for long.
CONSOLE_MOVE_MAX: Final = 10_000
#: Characters a preview shows as they are; the rest (controls, DEL) become \\xNN.
_SHOWN: Final = frozenset(string.printable) - frozenset("\x0b\x0c\r")


def static_file(name: str) -> bytes:
    """A file of the console as shipped in the package (raises FileNotFoundError)."""
    return resources.files("queued.server").joinpath("static", name).read_bytes()


def is_console_path(path: str) -> bool:
    return path.startswith(("/queues/", "/api/queues/", "/console/")) or path == HISTORY_PATH


def wants_html(headers: list[tuple[bytes, bytes]]) -> bool:
    """A browser asking for a page (`Accept: text/html`); curl and probes get text."""
    return any(k == b"accept" and b"text/html" in v for k, v in headers)


def preview(data: bytes, limit: int = PREVIEW_BYTES) -> dict[str, object]:
    """How the console shows an item's bytes: the first `limit`, as text when they are
    UTF-8 without control characters (else `binary`, and their hex too); characters not
    shown as they are become `\\xNN`, bytes that are not UTF-8 U+FFFD. The browser puts
    these strings in the page as text, never as HTML."""
    head = data[:limit]
    decoded, binary = _decode(head, cut=len(data) > limit)
    shown = _escape(decoded, _SHOWN)
    if binary or shown != decoded:  # binary: on one line, its layout means nothing
        binary, shown = True, _escape(decoded, _SHOWN - frozenset("\n\t"))
    out: dict[str, object] = {"text": shown, "binary": binary, "size": len(data),
                              "truncated": len(data) > limit}
    if binary:
        out["hex"] = head.hex(" ")
    return out


def _escape(text: str, shown: frozenset[str]) -> str:
    return "".join(ch if ch in shown or ord(ch) > 0x9f else f"\\x{ord(ch):02x}"
                   for ch in text)


def _decode(head: bytes, *, cut: bool) -> tuple[str, bool]:
    """(the text, whether it is not UTF-8); a last character cut in two by the
    preview's limit (`cut`) is dropped, not counted as binary."""
    try:
        return head.decode("utf-8"), False
    except UnicodeDecodeError as exc:
        if cut and exc.start >= len(head) - 3:
            try:
                return head[:exc.start].decode("utf-8"), False
            except UnicodeDecodeError:
                pass
        return head.decode("utf-8", "replace"), True


def after_of(query: str) -> int | None:
    """The `after` of a page request's query string (0 when absent; other parameters are
    ignored); None when it is not an item id."""
    try:
        pairs = parse_qsl(query, keep_blank_values=True, max_num_fields=MAX_QUERY_FIELDS)
    except ValueError:
        return None
    values = [v for k, v in pairs if k == "after"]
    if not values:
        return 0
    v = values[-1]
    if len(values) > 1 or not (v.isascii() and v.isdigit()) or len(v) > 19:
        return None
    return int(v)


def _item(it: Item, now_ms: int) -> dict[str, object]:
    return {"id": it.id, "age_ms": max(0, now_ms - it.add_time_ms),
            "expires_in_ms": (None if it.expire_time_ms is None
                              else max(0, it.expire_time_ms - now_ms)),
            "error_count": it.error_count, "flags": it.flags, **preview(it.data),
            "headers": [{"key": _escape(k, _SHOWN - frozenset("\n\t")), **preview(v)}
                        for k, v in header_pairs(it.headers)] if it.headers else []}


def _not_found(what: str) -> Reply:
    return json_reply(404, {"error": f"not found: {what}"})


class Console:
    """The console's routes. `users`: a users file is configured (else read-only)."""

    def __init__(self, *, users: bool, history: History | None = None) -> None:
        self.users = users
        self.history = history if history is not None else History()

    async def respond(self, method: bytes, path: str, headers: list[tuple[bytes, bytes]],
                      grant: Grant | None, broker: Broker | None, *, scheme: str,
                      query: str = "") -> Reply | None:
        """The console's answer to `method path` from a logged-in `grant` (None: no
        users); None when `path` is not the console's. The caller sends `/` here only
        for a browser (`wants_html`); curl and probes keep the port's text index."""
        if path == "/":
            return _method_not_allowed() if method == b"POST" else self._page("index")
        if path in _STATIC:
            if method == b"POST":
                return _method_not_allowed()
            name, ctype = _STATIC[path]
            return Reply(200, static_file(name), (("Content-Type", ctype),))
        if path == HISTORY_PATH:
            if method == b"POST":
                return _method_not_allowed()
            if broker is None:
                return json_reply(503, {"error": "recovering the journals"})
            return json_reply(200, self.history.view(
                (lambda _: True) if grant is None else grant.may_see, time.time(),
                dict(broker.queue_stats())))
        if not path.startswith(("/queues/", "/api/queues/")):
            return _not_found("no such page") if is_console_path(path) else None
        api = path.startswith("/api/")
        rest = unquote(path[len("/api/queues/" if api else "/queues/"):], errors="replace")
        name, _, action = rest.partition("/")
        if broker is None:
            return json_reply(503, {"error": "recovering the journals"})
        missing = self._find(name, grant, broker)
        if missing is not None:
            return missing
        try:
            return await self._queue_route(method, name, action, api, headers, grant,
                                           broker, scheme, query)
        except JournalError as exc:  # a parked queue that cannot load (logged)
            return json_reply(503, {"error": str(exc), "name": name})

    async def _queue_route(self, method: bytes, name: str, action: str, api: bool,
                           headers: list[tuple[bytes, bytes]], grant: Grant | None,
                           broker: Broker, scheme: str, query: str) -> Reply:
        if not api or not action:
            if method == b"POST" or action:
                return _method_not_allowed()
            return (await self._page_of_items(name, query, grant, broker) if api
                    else self._page("queue"))
        action, _, target = action.partition("/")
        if action not in _ACTIONS or bool(target) != (action == "move"):
            return _not_found("no such page")
        if method != b"POST":
            return Reply(405, b'{"error": "POST only"}\n', (("Content-Type", JSON),
                                                             ("Allow", "POST")))
        refused = self.refuse_action(headers, grant, scheme)
        if refused is not None:
            return refused
        return await self._act(name, action, grant, broker, target)

    @staticmethod
    def _page(page: str) -> Reply:
        return Reply(200, static_file(_PAGES[page]), (("Content-Type", _HTML),))

    @staticmethod
    def _find(name: str, grant: Grant | None, broker: Broker) -> Reply | None:
        """404 unless `name` (`q` or `q+r`) is an existing queue or reader `grant` may see."""
        try:
            queue, reader = parse_address(name.encode("ascii"))
        except (ArgumentError, UnicodeEncodeError):
            return _not_found("not a queue name")
        if not broker.has_reader(queue, reader):  # (a parked queue loads for its page)
            return _not_found(f"no queue {name}")
        if grant is not None and not grant.may_see(name):
            return _not_found(f"no queue {name}")  # as if it did not exist, as `stats` does
        return None

    async def _page_of_items(self, name: str, query: str, grant: Grant | None,
                             broker: Broker) -> Reply:
        """A page of the reader's items in delivery order: the first HEAD_ITEMS after item
        `after` (query `?after=<id>`, 0 or none: from the head), through `browse`: from
        memory, then from the journal on disk; nothing opened, taken or counted."""
        queue, _, reader = name.partition("+")
        admin = self.users and grant is not None and grant.admin
        may = {"admin": admin, "read_only": not self.users}
        if grant is not None and not grant.may(Permission.GET, name):
            return json_reply(403, {"error": f"user {grant.user!r} lacks 'get' on queue "
                                             f"{queue!r}", "name": name, **may})
        after = after_of(query)
        if after is None:
            return json_reply(400, {"error": "after: want an item id, a whole number >= 0"})
        # False: `q` whose default reader a fanout reader took over (it has no items)
        has_reader = broker.has_reader(queue, reader)
        items = (await broker.browse(queue, reader or None, after, HEAD_ITEMS + 1)
                 if has_reader else [])
        now = broker.clock()
        return json_reply(200, {
            "name": name, **may, "limit": HEAD_ITEMS, "preview_bytes": PREVIEW_BYTES,
            "reader": has_reader, "after": after, "more": len(items) > HEAD_ITEMS,
            "items": [_item(it, now) for it in items[:HEAD_ITEMS]],
        })

    def refuse_action(self, headers: list[tuple[bytes, bytes]], grant: Grant | None,
                      scheme: str) -> Reply | None:
        """Why a console action may not run (a 403), or None when it may: users are
        configured, `grant` is an admin's, and the request came from the console's own
        page (the action header; Origin, when sent, is this host; Sec-Fetch-Site, when
        sent, same-origin)."""
        if not self.users or grant is None:
            return json_reply(403, {"error": "read-only console: no users_file is set, "
                                             "so no admin actions"})
        if not grant.admin:
            return json_reply(403, {"error": f"user {grant.user!r} is not an admin"})
        h: Mapping[bytes, bytes] = dict(headers)
        host = h.get(b"host", b"").decode("latin-1")
        origin = h.get(b"origin")
        why = None
        if h.get(ACTION_HEADER.encode()) != b"1":
            why = f"missing the {ACTION_HEADER} header (not sent by the console)"
        elif origin is not None and origin.decode("latin-1") != f"{scheme}://{host}":
            why = "Origin is not this server"
        elif h.get(b"sec-fetch-site", b"same-origin") != b"same-origin":
            why = "not a same-origin request"
        if why is not None:
            log.warning("console: refused an action from user %r: %s", grant.user, why)
            return json_reply(403, {"error": f"refused: {why}"})
        return None

    @staticmethod
    async def _act(name: str, action: str, grant: Grant | None, broker: Broker,
                   target: str = "") -> Reply:
        """An action on `name` that `refuse_action` cleared: what the `flush`, `delete`,
        `pause`, `resume` and `move` commands do (`q`: its default reader / the whole
        queue; `q+r`: reader r; pause and resume take the queue of `q+r`)."""
        queue, _, reader = name.partition("+")
        who = grant.user if grant is not None else "?"
        if action in ("pause", "resume"):
            await broker.set_paused(queue, action == "pause")
            log.info("console: user %r %sd %s", who, action, queue)
            return json_reply(200, {"paused": action == "pause"})
        if action == "move":
            try:
                moved = await broker.move(queue, reader or None, target, CONSOLE_MOVE_MAX)
            except ValueError as exc:  # a bad destination name, or the queue itself
                return json_reply(400, {"error": str(exc)})
            log.info("console: user %r moved %d items from %s to %s", who, moved, name, target)
            return json_reply(200, {"moved": moved, "limit": CONSOLE_MOVE_MAX})
        if action == "flush":
            n = broker.flush(queue, reader or None)
            log.info("console: user %r flushed %s (%d items)", who, name, n)
            return json_reply(200, {"flushed": n})
        existed = await broker.delete(queue, reader or None)
        log.info("console: user %r deleted %s", who, name)
        return json_reply(200, {"deleted": existed})


def _method_not_allowed() -> Reply:
    return Reply(405, b'{"error": "GET or HEAD only"}\n', (("Content-Type", JSON),
                                                           ("Allow", "GET, HEAD")))
