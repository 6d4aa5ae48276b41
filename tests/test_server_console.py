"""The web console's HTTP side over real HTTP (the pages in a real browser: tests/browser):
its pages and headers, the files shipped in the package, logins and what each user sees,
the head view (read-only, binary shown safely), and the admin actions with their CSRF
defence. Each test runs its own server on free 127.0.0.1 ports; requests go through
the standard library's http.client.
"""

from __future__ import annotations

import http.client
import json
import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
import trio
from ops_util import basic, cfg, get, put
from security_util import users_toml
from server_util import HOST, running
from wait_util import wait_for

from queued.reader.open_reads import OpenReads
from queued.server import http as qhttp
from queued.server.console import HEAD_ITEMS, PREVIEW_BYTES, preview, static_file

ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "queued" / "server" / "static"
HTML = {"Accept": "text/html,application/xhtml+xml"}
ACTION = {"X-Queued-Console": "1"}

USERS = dict(
    alice={"password": "alice pw", "put": ["orders", "jobs-*"], "get": ["orders"]},
    bob={"password": "bob-pw", "get": ["jobs-*"]},
    root={"password": "root-pw", "admin": True, "put": ["*"], "get": ["*"]},
    ops={"password": "ops-pw", "admin": True},  # admin, but no get: may act, may not peek
)


def as_(user: str) -> dict[str, str]:
    return basic(user, USERS[user]["password"])


@pytest.fixture
def users(tmp_path: Path) -> Path:
    path = tmp_path / "users.toml"
    path.write_text(users_toml(**USERS))
    return path


async def doc(port: int, path: str, headers: dict[str, str] | None = None,
              method: str = "GET") -> tuple[int, dict[str, object]]:
    status, hdrs, body = await get(port, path, headers, method=method)
    assert hdrs["content-type"] == "application/json", (status, body)
    return status, json.loads(body)


async def stats_names(port: int, headers: dict[str, str] | None = None) -> set[str]:
    status, d = await doc(port, "/stats.json", headers)
    assert status == 200
    return set(d["queues"])  # type: ignore[arg-type]


# -- the files and the headers ----------------------------------------------------------------


def test_the_static_files_are_package_data() -> None:
    """Every file of queued/server/static is read through importlib.resources and matched
    by pyproject.toml's package-data globs (so a wheel, `pip install .`, carries it)."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["queued.server"]
    names = sorted(p.name for p in STATIC.iterdir())
    assert {"index.html", "queue.html", "console.js", "console.css", "icon.svg"} <= set(names)
    for name in names:
        assert any(fnmatch(f"static/{name}", g) for g in globs), name
        assert static_file(name) == (STATIC / name).read_bytes()


def test_no_inline_script_or_style_and_no_html_from_data() -> None:
    """What the CSP would block never appears: <script> without src, <style>, style= or
    on*= attributes, javascript: URLs; and the script never parses data as HTML."""
    for page in ("index.html", "queue.html"):
        html = static_file(page).decode()
        scripts = re.findall(r"<script\b[^>]*>", html)
        assert scripts and all('src="/console/' in s for s in scripts)
        assert not re.search(r"<style\b|\sstyle=|\son[a-z]+=|javascript:", html, re.I)
        assert not re.search(r"(src|href)=\"(https?:)?//", html)  # no CDN
    js = re.sub(r"^\s*//.*$", "", static_file("console.js").decode(), flags=re.M)
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(", js)


async def test_pages_and_headers_without_users(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        port = server.ports["http"]
        await put(server, "jobs", b"x")
        status, headers, body = await get(port, "/", HTML)
        assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
        assert b'src="/console/console.js"' in body
        csp = headers["content-security-policy"]
        for part in ("default-src 'none'", "script-src 'self'", "style-src 'self'",
                     "connect-src 'self'", "frame-ancestors 'none'"):
            assert part in csp
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["cache-control"] == "no-store"
        # curl and probes still get the text index at /
        status, headers, body = await get(port, "/")
        assert status == 200 and body.startswith(b"queued ") and b"/metrics" in body
        # every reply carries the headers, JSON and errors included
        status, headers, _ = await get(port, "/stats.json")
        assert status == 200 and "content-security-policy" in headers
        for path, ctype in (("/console/console.js", "text/javascript; charset=utf-8"),
                            ("/console/console.css", "text/css; charset=utf-8"),
                            ("/console/icon.svg", "image/svg+xml")):
            status, headers, body = await get(port, path)
            assert (status, headers["content-type"]) == (200, ctype)
            assert body == static_file(path.rpartition("/")[2])
        status, headers, body = await get(port, "/queues/jobs")
        assert status == 200 and headers["content-type"].startswith("text/html")
        status, headers, body = await get(port, "/queues/jobs", method="HEAD")
        assert status == 200 and body == b"" and int(headers["content-length"]) > 100
        for missing in ("/console/nope.js", "/console/../http.py", "/queues/nope",
                        "/api/queues/nope", "/api/queues/jobs/nope", "/queues/jobs+nope"):
            assert (await get(port, missing))[0] == 404, missing


@pytest.mark.parametrize("name", [
    "%3Cscript%3E", "a%2Fb", "..%2F..%2Fetc", "%00", "a%20b", "x" * 251, "q+r+s", "%C3%A9",
    "%ff", "jobs%2B", "+r",
])
async def test_hostile_names_are_404_and_create_nothing(tmp_path: Path, name: str) -> None:
    async with running(cfg(tmp_path)) as server:
        port = server.ports["http"]
        await put(server, "jobs", b"x")
        for path in (f"/queues/{name}", f"/api/queues/{name}"):
            status, _, body = await get(port, path)
            assert status == 404, path
            assert b"<" not in body  # nothing echoed that a browser could take for HTML
        assert set(server.broker.queues) == {"jobs"}


async def test_without_users_the_console_is_read_only(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        port = server.ports["http"]
        await put(server, "jobs", b"a", b"b")
        status, d = await doc(port, "/api/queues/jobs")
        assert status == 200 and d["admin"] is False and d["read_only"] is True
        for action in ("flush", "delete"):
            status, d = await doc(port, f"/api/queues/jobs/{action}", ACTION, method="POST")
            assert status == 403 and "read-only" in str(d["error"])
        assert server.broker.reader_info("jobs")["items"] == 2
        # POST anywhere else is refused as before
        assert (await get(port, "/stats.json", method="POST"))[0] == 405
        assert (await get(port, "/queues/jobs", method="POST"))[0] == 405


# -- logins and what each user sees -------------------------------------------------------------


async def test_console_needs_a_login_and_filters_queues(tmp_path: Path, users: Path) -> None:
    async with running(cfg(tmp_path, users_file=str(users))) as server:
        port = server.ports["http"]
        for q in ("orders", "jobs-1", "secret"):
            server.broker.registry.queue(q)
        for path in ("/queues/orders", "/api/queues/orders", "/console/console.js",
                     "/api/queues/orders/flush"):
            status, headers, _ = await get(port, path)
            assert status == 401 and headers["www-authenticate"].startswith("Basic"), path
        status, headers, _ = await get(port, "/", HTML)
        assert status == 401 and "www-authenticate" in headers  # the browser asks
        assert (await get(port, "/"))[0] == 401  # the text index too: it names the server
        assert (await get(port, "/", {**HTML, **basic("alice", "wrong")}))[0] == 401
        assert (await get(port, "/", {**HTML, **as_("alice")}))[0] == 200
        # /stats.json: the same filter as the `stats` command (put or get; admin: all)
        assert await stats_names(port, as_("alice")) == {"orders", "jobs-1"}
        assert await stats_names(port, as_("bob")) == {"jobs-1"}
        assert await stats_names(port, as_("root")) == {"orders", "jobs-1", "secret"}
        # a queue one may not see is not there at all, as if it did not exist
        for path in ("/queues/secret", "/api/queues/secret"):
            assert (await get(port, path, as_("alice")))[0] == 404
        assert (await get(port, "/queues/jobs-1", as_("alice")))[0] == 200


async def test_the_head_view_needs_get(tmp_path: Path, users: Path) -> None:
    async with running(cfg(tmp_path, users_file=str(users))) as server:
        port = server.ports["http"]
        await server.broker.put("jobs-1", [b"one"])
        status, d = await doc(port, "/api/queues/jobs-1", as_("alice"))  # put only
        assert status == 403 and "lacks 'get'" in str(d["error"]) and d["admin"] is False
        assert "items" not in d
        status, d = await doc(port, "/api/queues/jobs-1", as_("bob"))
        assert status == 200 and [i["text"] for i in d["items"]] == ["one"]  # type: ignore
        assert d["admin"] is False and d["read_only"] is False
        status, d = await doc(port, "/api/queues/jobs-1", as_("ops"))  # admin without get
        assert status == 403 and d["admin"] is True
        status, d = await doc(port, "/api/queues/jobs-1", as_("root"))
        assert status == 200 and d["admin"] is True


# -- the head view --------------------------------------------------------------------------


async def test_the_head_view_is_read_only(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        port, b = server.ports["http"], server.broker
        await b.put("jobs", [f"item {i}".encode() for i in range(HEAD_ITEMS + 5)])
        client = b.register(OpenReads("holder"))
        held = await b.get("jobs", client=client, open=True)  # an open read: not shown
        assert held is not None and held.data == b"item 0"
        def state() -> object:  # everything but the clock's oldest_item_age_msec
            info = b.reader_info("jobs")
            del info["oldest_item_age_msec"]
            return info, b.statistics(), len(b.queues["jobs"].readers)

        before = state()
        for _ in range(3):
            status, d = await doc(port, "/api/queues/jobs")
            assert status == 200
            assert [i["text"] for i in d["items"]] == [  # type: ignore[union-attr]
                f"item {i}" for i in range(1, HEAD_ITEMS + 1)]
        assert state() == before
        assert (await b.get("jobs")).data == b"item 1"  # type: ignore[union-attr]
        # a fanout reader's head; a queue whose default reader was taken over has none
        await b.get("other", "r")
        await b.put("other", [b"fan"])
        status, d = await doc(port, "/api/queues/other+r")
        assert [i["text"] for i in d["items"]] == ["fan"]  # type: ignore[union-attr]
        status, d = await doc(port, "/api/queues/other")
        assert status == 200 and d["reader"] is False and d["items"] == []
        assert set(b.queues["other"].readers) == {"r"}  # looking created no default reader


async def test_the_queue_view_pages_through_the_queue_with_browse(tmp_path: Path) -> None:
    """`?after=<id>` pages past the head: every item once, in delivery order, those read
    back from disk included (a small max_memory_size), with `more` on every page but the
    last; nothing is opened, taken or counted."""
    toml = '[queues.jobs]\nmax_memory_size = "1KiB"\n'
    async with running(cfg(tmp_path, toml)) as server:
        port, b = server.ports["http"], server.broker
        n = 3 * HEAD_ITEMS + 5
        await b.put("jobs", [b"item %03d " % i + b"x" * 90 for i in range(n)])
        assert b.reader_info("jobs")["mem_items"] < n  # most wait on disk

        def state() -> object:
            info = b.reader_info("jobs")
            del info["oldest_item_age_msec"]
            return info, b.statistics()

        before = state()
        seen: list[str] = []
        after, pages = 0, 0
        while True:
            status, d = await doc(port, f"/api/queues/jobs?after={after}")
            assert status == 200 and d["after"] == after and d["limit"] == HEAD_ITEMS
            items: list[dict[str, object]] = d["items"]  # type: ignore[assignment]
            seen += [str(i["text"])[:8] for i in items]
            pages += 1
            if not d["more"]:
                break
            assert len(items) == HEAD_ITEMS
            after = int(items[-1]["id"])  # type: ignore[call-overload]
            assert pages < 10
        assert pages == 4 and seen == [f"item {i:03d}" for i in range(n)]
        assert state() == before  # nothing opened, taken, read back or counted
        first = await b.get("jobs")
        assert first is not None and first.data.startswith(b"item 000")
        before = state()
        # a page after an item no longer there goes on with the items after it by id
        status, d = await doc(port, f"/api/queues/jobs?after={first.id}")
        assert [str(i["text"])[:8] for i in d["items"]] == [  # type: ignore[union-attr]
            f"item {i:03d}" for i in range(1, HEAD_ITEMS + 1)]
        status, d = await doc(port, "/api/queues/jobs?after=999999")
        assert status == 200 and d["items"] == [] and d["more"] is False
        # no `after` (the page the console opens first) is the head, as `after=0` is
        status, d = await doc(port, "/api/queues/jobs?other=1")
        assert status == 200 and d["after"] == 0 and len(d["items"]) == HEAD_ITEMS  # type: ignore[arg-type]
        for bad in ("after=-1", "after=x", "after=", "after=1&after=2", "after=1e3",
                    "after=%EF%BC%91", "after=" + "9" * 20, "&".join(["a=1"] * 9)):
            status, d = await doc(port, f"/api/queues/jobs?{bad}")
            assert status == 400 and "after" in str(d["error"]), bad
        assert state() == before


async def test_paging_needs_get_and_shows_only_what_one_may_see(
        tmp_path: Path, users: Path) -> None:
    async with running(cfg(tmp_path, users_file=str(users))) as server:
        port, b = server.ports["http"], server.broker
        await b.put("jobs-1", [f"j{i}".encode() for i in range(HEAD_ITEMS + 3)])
        await b.put("orders", [b"o"])
        status, d = await doc(port, "/api/queues/jobs-1?after=1", as_("alice"))  # put only
        assert status == 403 and "items" not in d
        status, d = await doc(port, "/api/queues/jobs-1?after=1", as_("ops"))  # admin, no get
        assert status == 403 and "items" not in d
        status, d = await doc(port, "/api/queues/jobs-1?after=10", as_("bob"))
        assert status == 200 and [i["text"] for i in d["items"]] == [  # type: ignore[union-attr]
            "j10", "j11", "j12"]
        status, _ = await doc(port, "/api/queues/orders?after=0", as_("bob"))
        assert status == 404  # not bob's: as if it did not exist
        assert (await get(port, "/api/queues/jobs-1?after=1"))[0] == 401
        assert b.reader_info("jobs-1")["items"] == HEAD_ITEMS + 3


def test_preview_shows_bytes_safely() -> None:
    assert preview(b"hello") == {"text": "hello", "binary": False, "size": 5,
                                 "truncated": False}
    p = preview(b"<script>alert(1)</script>")
    assert p["text"] == "<script>alert(1)</script>" and not p["binary"]  # text, as text
    p = preview(b"\x00\x01ab\xff\x7f")
    assert p["binary"] and p["text"] == "\\x00\\x01ab\ufffd\\x7f"
    assert p["hex"] == "00 01 61 62 ff 7f"
    p = preview("é".encode() * PREVIEW_BYTES)  # a character cut by the limit is no binary
    assert not p["binary"] and p["truncated"] and p["size"] == 2 * PREVIEW_BYTES
    assert p["text"] == "é" * (PREVIEW_BYTES // 2)
    p = preview(b"line\nnext\ttab\rcr")
    assert p["text"] == "line\\x0anext\\x09tab\\x0dcr" and p["binary"]
    assert preview(b"line\nnext\ttab")["text"] == "line\nnext\ttab"  # text keeps its layout
    assert len(preview(bytes(range(256)) * 40)["hex"]) == 3 * PREVIEW_BYTES - 1  # type: ignore


async def test_head_items_come_as_json_strings(tmp_path: Path) -> None:
    hostile = b'<img src=x onerror="window.pwned=1"></td>\x00\xfe"\\'
    async with running(cfg(tmp_path)) as server:
        await server.broker.put("jobs", [hostile])
        status, headers, body = await get(server.ports["http"], "/api/queues/jobs")
        assert status == 200 and headers["content-type"] == "application/json"
        item = json.loads(body)["items"][0]
        assert item["binary"] and item["hex"] == hostile.hex(" ")
        assert item["text"] == '<img src=x onerror="window.pwned=1"></td>\\x00\ufffd"\\'


# -- admin actions and CSRF ---------------------------------------------------------------------


async def test_admin_actions(tmp_path: Path, users: Path) -> None:
    async with running(cfg(tmp_path, users_file=str(users))) as server:
        port, b = server.ports["http"], server.broker
        await b.put("jobs-1", [b"a", b"b", b"c"])
        await b.put("orders", [b"o"])
        origin = {"Origin": f"http://{HOST}:{port}", "Sec-Fetch-Site": "same-origin"}
        for user in ("alice", "bob"):  # not admins
            status, d = await doc(port, "/api/queues/jobs-1/flush",
                                  {**ACTION, **origin, **as_(user)}, "POST")
            assert status == 403 and "not an admin" in str(d["error"])
        assert (await get(port, "/api/queues/jobs-1/flush", method="POST"))[0] == 401
        assert b.reader_info("jobs-1")["items"] == 3
        status, d = await doc(port, "/api/queues/jobs-1/flush",
                              {**ACTION, **origin, **as_("root")}, "POST")
        assert (status, d) == (200, {"flushed": 3})
        assert b.reader_info("jobs-1")["items"] == 0
        status, d = await doc(port, "/api/queues/orders/delete", {**ACTION, **as_("ops")},
                              "POST")
        assert (status, d) == (200, {"deleted": True})
        assert "orders" not in b.queues
        assert (await get(port, "/queues/orders", as_("root")))[0] == 404
        # GET never acts
        status, _, _ = await get(port, "/api/queues/jobs-1/delete", as_("root"))
        assert status == 405 and "jobs-1" in b.queues


async def test_admin_pause_resume_and_redrive_actions(tmp_path: Path, users: Path) -> None:
    async with running(cfg(tmp_path, users_file=str(users))) as server:
        port, b = server.ports["http"], server.broker
        await b.put("jobs-dead", [b"a", b"b"])
        status, d = await doc(port, "/api/queues/jobs-dead/pause", {**ACTION, **as_("alice")},
                              "POST")
        assert status == 403 and "not an admin" in str(d["error"])
        assert "jobs-dead" not in b.paused
        status, d = await doc(port, "/api/queues/jobs-dead/pause", {**ACTION, **as_("root")},
                              "POST")
        assert (status, d) == (200, {"paused": True}) and "jobs-dead" in b.paused
        status, d = await doc(port, "/api/queues/jobs-dead/resume", {**ACTION, **as_("ops")},
                              "POST")
        assert (status, d) == (200, {"paused": False}) and "jobs-dead" not in b.paused
        status, d = await doc(port, "/api/queues/jobs-dead/move/jobs-1",
                              {**ACTION, **as_("root")}, "POST")
        assert (status, d) == (200, {"moved": 2, "limit": 10_000})
        assert b.reader_info("jobs-1")["items"] == 2
        status, d = await doc(port, "/api/queues/jobs-1/move/jobs-1", {**ACTION, **as_("root")},
                              "POST")
        assert status == 400 and "the destination is the source" in str(d["error"])
        status, _ = await doc(port, "/api/queues/jobs-1/move/a.b", {**ACTION, **as_("root")},
                              "POST")
        assert status == 400
        for bad in ("/api/queues/jobs-1/move", "/api/queues/jobs-1/pause/x"):
            status, _ = await doc(port, bad, {**ACTION, **as_("root")}, "POST")
            assert status == 404
        status, d = await doc(port, "/api/queues/jobs-1/move/jobs-2", {**as_("root")}, "POST")
        assert status == 403 and b.reader_info("jobs-1")["items"] == 2  # no console header


@pytest.mark.parametrize("headers", [
    {"Content-Type": "application/x-www-form-urlencoded"},  # what a cross-site form sends
    {"X-Queued-Console": "yes"},
    {"X-Queued-Console": "1", "Origin": "http://evil.example"},
    {"X-Queued-Console": "1", "Origin": "null"},
    {"X-Queued-Console": "1", "Sec-Fetch-Site": "cross-site"},
    {"X-Queued-Console": "1", "Sec-Fetch-Site": "same-site"},
])
async def test_cross_site_actions_are_refused_and_change_nothing(
        tmp_path: Path, users: Path, headers: dict[str, str]) -> None:
    async with running(cfg(tmp_path, users_file=str(users))) as server:
        port, b = server.ports["http"], server.broker
        await b.put("jobs-1", [b"a", b"b"])
        for action in ("flush", "delete"):
            status, d = await doc(port, f"/api/queues/jobs-1/{action}",
                                  {**headers, **as_("root")}, "POST")
            assert status == 403 and str(d["error"]).startswith("refused"), d
        assert b.reader_info("jobs-1")["items"] == 2 and "jobs-1" in b.queues


async def test_console_requests_keep_the_port_limits(tmp_path: Path) -> None:
    """A console POST with an oversized body is refused (413) before anything runs."""
    async with running(cfg(tmp_path)) as server:
        port = server.ports["http"]
        await put(server, "jobs", b"a")

        def big_post() -> int:
            conn = http.client.HTTPConnection(HOST, port, timeout=10)
            try:
                conn.request("POST", "/api/queues/jobs/flush",
                             body=b"x" * (qhttp.MAX_BODY_BYTES + 1), headers=ACTION)
                return conn.getresponse().status
            finally:
                conn.close()

        assert await trio.to_thread.run_sync(big_post) == 413
        assert server.broker.reader_info("jobs")["items"] == 1


async def test_head_items_leave_out_delayed_items_until_due(tmp_path: Path) -> None:
    """The head view lists items in delivery order: an item delayed and not yet due is
    not there; once due it is, before items put without a delay after it."""
    async with running(cfg(tmp_path)) as server:
        port, b = server.ports["http"], server.broker
        await b.put("jobs", [b"later"], delay_ms=300)
        await b.put("jobs", [b"now"])
        status, d = await doc(port, "/api/queues/jobs")
        assert status == 200 and [i["text"] for i in d["items"]] == ["now"]  # type: ignore
        assert await b.get("jobs", peek=True, timeout_ms=2000) is not None  # "now"
        # due by the wall clock: the peek shows it at the head once it is
        await wait_for(lambda: b.get("jobs", peek=True),
                       lambda head: head is not None and head.data == b"later")
        status, d = await doc(port, "/api/queues/jobs")
        assert [i["text"] for i in d["items"]] == ["later", "now"]  # type: ignore


async def test_the_chart_history_shows_each_user_its_queues_up_to_now(
        tmp_path: Path, users: Path) -> None:
    async with running(cfg(tmp_path, users_file=str(users))) as server:
        port, b = server.ports["http"], server.broker
        await b.put("jobs-1", [b"a", b"b", b"c"])
        await b.put("orders", [b"o"])
        status, d = await doc(port, "/api/history", as_("bob"))  # get jobs-*: not orders
        assert status == 200 and d["interval_s"] == 10.0 and d["window_s"] == 900
        queues: dict[str, dict[str, list[float]]] = d["queues"]  # type: ignore[assignment]
        assert set(queues) == {"jobs-1"} and queues["jobs-1"]["items"][-1] == 3  # (now)
        status, d = await doc(port, "/api/history", as_("root"))
        assert status == 200 and set(d["queues"]) == {"jobs-1", "orders"}  # type: ignore[arg-type]
        assert (await get(port, "/api/history", method="POST"))[0] in (401, 405)
        assert (await get(port, "/api/history"))[0] == 401
