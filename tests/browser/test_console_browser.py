"""The web console in a real headless Chromium (Debian's, through Selenium and its
chromedriver) against a real `queued serve` subprocess fed by the real Python client.

Run by `make test-browser` (`pytest -m browser tests/browser`); plain `make test`
deselects the `browser` marker. tests/browser/setup.sh first installs chromium and
chromium-driver when missing; the tests skip only when they are absent (setup.sh could
not install them). QUEUED_CONSOLE_SCREENSHOT=<dir> makes test_screenshots save the
screenshots of the docs (console.png, console-queue.png) there: docs/operations.md
and the README's tour show them.

Every wait is bounded (browser_util.WAIT); the page polls /stats.json every 1.5 s, so
"updates without a reload" is checked by a marker set on `window` that a reload would
lose.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from served import USERS, Served

pytestmark = pytest.mark.browser

NONE = "\u2013"  # what the page shows for a figure it has no value for yet (a rate)

HOSTILE = [
    b"<script>window.pwned=1</script>",
    b'<img src=x onerror="window.pwned=2">',
    b'"><svg onload="window.pwned=3"></td></tr></table>',
    b"\x00\x01\xfe\xff binary <b>bold</b>",
]


def no_csp_violations(browser: Any) -> None:
    assert browser.csp_violations() == []
    severe = [e for e in browser.console_log() if e["level"] == "SEVERE"]
    assert severe == [], severe  # no failed loads, no script errors either


def test_the_page_loads_and_shows_a_queue_a_client_just_created(
        server: Served, browser: Any) -> None:
    browser.open(server.url + "/")
    assert browser.find("h1").text == "queued"
    browser.wait("the first poll", lambda: "updated" in browser.find("#status").text)
    assert browser.find("#empty").is_displayed()  # no queues yet
    assert "version" in browser.find("#server").text
    server.client.put("fresh", [b"one", b"two"])
    assert browser.wait("the new queue's row", lambda: browser.cell("queues", "fresh", "items")
                        ) == "2"
    assert not browser.find("#empty").is_displayed()
    assert browser.cell("queues", "fresh", "delayed") == "0"
    assert browser.cell("queues", "fresh", "readers") == "1"
    link = browser.find('#queues tr[data-name="fresh"] a')
    assert link.get_attribute("href") == server.url + "/queues/fresh"
    no_csp_violations(browser)


def test_the_list_updates_when_items_arrive_without_a_reload(
        server: Served, browser: Any) -> None:
    server.client.put("live", [b"x"])
    browser.open(server.url + "/")
    browser.wait("the queue's row", lambda: browser.cell("queues", "live", "items") == "1")
    browser.js("window.notReloaded = true;")
    server.client.put("live", [b"y"] * 500)
    browser.wait("the new count", lambda: browser.cell("queues", "live", "items") == "501")
    assert browser.js("return window.notReloaded === true;")  # the same page, redrawn
    # the put rate is computed from /stats.json's counters between two polls
    rate = browser.wait("a put rate", lambda: (browser.cell("queues", "live", "puts")
                                                 .replace(",", "") or NONE))
    assert rate == NONE or float(rate) >= 0
    items = server.client.get("live", 200)
    server.client.confirm(items)
    browser.wait("the count after gets", lambda: browser.cell("queues", "live", "items")
                 == "301")
    assert browser.js("return window.notReloaded === true;")
    no_csp_violations(browser)


def test_the_head_view_shows_hostile_bytes_as_text(server: Served, browser: Any) -> None:
    server.client.put("evil", HOSTILE)
    browser.open(server.url + "/queues/evil")
    rows = browser.wait("the head items", lambda: (
        lambda r: r if len(r) == len(HOSTILE) else None)(browser.all("#peek tbody tr")))
    texts = [row.find_elements("css selector", "td.data")[0].text for row in rows]
    assert texts[0] == "<script>window.pwned=1</script>"
    assert texts[1] == '<img src=x onerror="window.pwned=2">'
    assert texts[2] == '"><svg onload="window.pwned=3"></td></tr></table>'
    assert texts[3].startswith("binary")
    assert "\\x00\\x01\ufffd\ufffd binary <b>bold</b>" in texts[3]
    assert "00 01 fe ff 20 62 69 6e" in texts[3]  # and its hex
    # nothing became markup: no element the items named exists, nothing ran
    assert browser.all("#peek script, #peek img, #peek svg, #peek b") == []
    assert browser.js("return document.scripts.length;") == 1  # console.js only
    browser.settle(2.0)  # two more polls redraw the items; still nothing runs
    assert browser.js("return typeof window.pwned;") == "undefined"
    assert len(browser.all("#peek tbody tr")) == len(HOSTILE)
    # looking removed nothing
    assert [it.data for it in server.client.get("evil", 10)] == HOSTILE
    no_csp_violations(browser)


def test_csp_violations_would_be_seen(server: Served, browser: Any) -> None:
    """The check above is not vacuous: an inline script added to the page is refused by
    the Content-Security-Policy, does not run, and the refusal shows in the console log."""
    browser.open(server.url + "/")
    browser.wait("the first poll", lambda: "updated" in browser.find("#status").text)
    browser.js("const s = document.createElement('script');"
               "s.textContent = 'window.inlineRan = 1;'; document.body.appendChild(s);")
    browser.wait("a CSP violation in the log", lambda: browser.csp_violations())
    assert browser.js("return typeof window.inlineRan;") == "undefined"


def test_admin_buttons_only_for_admins_and_a_flush_through_the_confirmation(
        secured: Served, browser: Any) -> None:
    secured.client.put("work", [b"a", b"b", b"c"])
    browser.login("viewer", USERS["viewer"]["password"])
    browser.open(secured.url + "/queues/work")
    browser.wait("the head items", lambda: len(browser.all("#peek tbody tr")) == 3)
    browser.settle(1.6)  # a second poll: the buttons stay hidden
    assert not browser.find("#admin").is_displayed()
    assert not browser.find("#flush").is_displayed()
    assert not browser.find("#delete").is_displayed()

    browser.login("root", USERS["root"]["password"])
    browser.open(secured.url + "/queues/work")
    browser.wait("the admin buttons", lambda: browser.find("#flush").is_displayed())
    assert browser.find("#delete").is_displayed()
    assert not browser.find("#confirm").is_displayed()
    browser.find("#flush").click()  # asks first: nothing flushed yet
    assert browser.find("#confirm").is_displayed()
    assert "Flush work?" in browser.find("#confirm-text").text
    browser.find("#confirm-no").click()
    assert not browser.find("#confirm").is_displayed()
    browser.settle(0.5)
    assert secured.client.peek("work").items == 3
    browser.find("#flush").click()
    browser.find("#confirm-yes").click()
    browser.wait("the flush's result", lambda: browser.find("#action-result").text
                 == "Flushed 3 items.")
    assert secured.client.peek("work").items == 0
    browser.wait("the emptied head", lambda: browser.find("#peek-empty").is_displayed())
    # delete, confirmed, goes back to the list, where the queue is gone
    browser.find("#delete").click()
    browser.find("#confirm-yes").click()
    browser.wait("the queue list", lambda: browser.driver.current_url == secured.url + "/")
    browser.wait("the first poll", lambda: "updated" in browser.find("#status").text)
    assert browser.cell("queues", "work", "items") == ""
    assert "work" not in secured.client.stats()[f"127.0.0.1:{secured.proc.rpc}"]["queues"]
    no_csp_violations(browser)


def test_a_login_typed_into_the_url_reaches_every_request(
        secured: Served, browser: Any) -> None:
    """HTTP Basic as a person uses it (no header set by the test): without credentials
    the page is refused; credentials in the URL log the page in, and its fetches (made
    against location.origin, which holds no credentials) reuse the browser's login."""
    secured.client.put("work", [b"a"])
    browser.open(secured.url + "/")
    assert "queued" not in browser.driver.title  # the 401 page, not the console
    host = secured.url.removeprefix("http://")
    browser.open(f"http://viewer:viewer%20pw@{host}/queues/work")
    browser.wait("the head items", lambda: len(browser.all("#peek tbody tr")) == 1)
    browser.wait("the readers", lambda: browser.cell("readers", "work", "items") == "1")
    assert not browser.find("#admin").is_displayed()
    assert browser.csp_violations() == []


def test_read_only_without_users(server: Served, browser: Any) -> None:
    server.client.put("ro", [b"a"])
    browser.open(server.url + "/queues/ro")
    browser.wait("the head items", lambda: len(browser.all("#peek tbody tr")) == 1)
    browser.settle(1.6)
    assert not browser.find("#admin").is_displayed()
    no_csp_violations(browser)


def test_screenshots(secured: Served, browser: Any) -> None:
    """A console with some traffic, seen by an admin; saved for the docs when
    QUEUED_CONSOLE_SCREENSHOT names a directory (else into the test's temp dir, and only
    checked)."""
    c = secured.client
    browser.login("root", USERS["root"]["password"])
    c.put("orders", [f'{{"order": {i}, "sku": "A-{i % 7}"}}'.encode() for i in range(40)])
    c.put("emails", [b"to: someone@example.com"] * 12)
    c.get("emails", 1, auto_abort_ms=600_000)  # an open read
    c.get("jobs+audit", timeout_ms=1)  # a fanout reader (it takes over the default one)
    c.get("jobs", timeout_ms=1)  # and a new default reader
    c.put("jobs", [b"resize image 1", b"\x89PNG\r\n\x1a\n binary", b"<b>not bold</b>"])
    c.put("thumbnails", [b"x" * 3000] * 250)
    browser.open(secured.url + "/")
    browser.wait("every queue", lambda: browser.cell("queues", "thumbnails", "items") == "250")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # some traffic, so the rates show numbers
        c.put("orders", [b'{"order": "more"}'] * 20)
        c.confirm(c.get("orders", 15, auto_abort_ms=60_000))
        time.sleep(0.3)
        if browser.cell("queues", "orders", "puts") not in ("", NONE, "0.0"):
            break
    target = os.environ.get("QUEUED_CONSOLE_SCREENSHOT")
    where = Path(target) if target else secured.proc.data_dir.parent / "screenshots"
    where.mkdir(parents=True, exist_ok=True)
    browser.driver.set_window_size(1400, 420)
    assert browser.driver.save_screenshot(str(where / "console.png"))
    browser.open(secured.url + "/queues/jobs")
    browser.wait("the head items", lambda: len(browser.all("#peek tbody tr")) == 3)
    browser.driver.set_window_size(1400, 820)
    assert browser.driver.save_screenshot(str(where / "console-queue.png"))
    for name in ("console.png", "console-queue.png"):
        assert (where / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    no_csp_violations(browser)


def test_a_paused_queue_shows_as_paused(server: Served, browser: Any) -> None:
    server.client.put("held", [b"x"])
    browser.open(server.url + "/")
    browser.wait("the queue's row", lambda: browser.cell("queues", "held", "items") == "1")
    assert browser.cell("queues", "held", "state") == ""
    server.client.pause("held")
    try:
        browser.wait("paused", lambda: browser.cell("queues", "held", "state") == "paused")
        browser.open(server.url + "/queues/held")
        browser.wait("the reader's state",
                     lambda: browser.cell("readers", "held", "state") == "paused")
    finally:
        server.client.resume("held")
    browser.wait("resumed", lambda: browser.cell("readers", "held", "state") == "")
    no_csp_violations(browser)


def test_pause_resume_and_redrive_through_the_confirmation(
        secured: Served, browser: Any) -> None:
    secured.client.put("dlq", [b"a", b"b"])
    [got] = secured.client.get("dlq", 1, 0, 30_000)
    secured.client.abort(got)  # one delivery so far: the head view says so
    browser.login("root", USERS["root"]["password"])
    browser.open(secured.url + "/queues/dlq")
    browser.wait("the head items", lambda: len(browser.all("#peek tbody tr")) == 2)
    assert [c.text for c in browser.all('#peek td[data-col="deliveries"]')] == ["1", "0"]
    browser.find("#pause").click()
    assert "Pause dlq?" in browser.find("#confirm-text").text
    browser.find("#confirm-no").click()
    browser.settle(0.5)
    assert secured.client.peek("dlq").stats["paused"] == 0  # cancelled: not paused
    browser.find("#pause").click()
    browser.find("#confirm-yes").click()
    browser.wait("paused", lambda: browser.find("#action-result").text == "Paused.")
    assert secured.client.peek("dlq").stats["paused"] == 1
    browser.wait("the state column", lambda: browser.cell("readers", "dlq", "state") == "paused")
    browser.find("#resume").click()
    browser.find("#confirm-yes").click()
    browser.wait("resumed", lambda: browser.find("#action-result").text == "Resumed.")
    assert secured.client.peek("dlq").stats["paused"] == 0
    browser.find("#move").click()  # no destination yet: nothing asked, nothing moved
    assert not browser.find("#confirm").is_displayed()
    browser.find("#move-to").send_keys("work")
    browser.find("#move").click()
    assert "Redrive dlq to work?" in browser.find("#confirm-text").text
    browser.find("#confirm-yes").click()
    browser.wait("moved", lambda: browser.find("#action-result").text == "Moved 2 items.")
    assert secured.client.peek("work").items == 2 and secured.client.peek("dlq").items == 0
    no_csp_violations(browser)


def test_charts_of_the_last_fifteen_minutes_on_both_pages(server: Served, browser: Any) -> None:
    server.client.put("charted", [b"x"] * 7)
    browser.open(server.url + "/")
    browser.wait("the depth chart", lambda: browser.all(
        '#queues tr[data-name="charted"] td[data-chart="depth"] svg'))
    depth = browser.find('#queues tr[data-name="charted"] td[data-chart="depth"] svg')
    assert depth.get_attribute("data-max") == "7"  # (the point of now, at least)
    assert browser.all('#queues tr[data-name="charted"] td[data-chart="rates"] svg')
    assert browser.js('return document.querySelector('
                      '\'#queues tr[data-name="charted"] svg polyline.depth\') !== null;')
    browser.open(server.url + "/queues/charted")
    browser.wait("the page's charts", lambda: len(browser.all("#charts svg")) == 2)
    assert browser.all("#charts svg")[0].get_attribute("data-max") == "7"
    no_csp_violations(browser)


def test_paging_through_a_queue_past_its_head_takes_nothing(
        small_memory: Served, browser: Any) -> None:
    """Next and Previous page through the queue with browse, 10 items a page in delivery
    order, the items waiting on disk included; the queue keeps every item."""
    c = small_memory.client
    c.put("paged", [b"item %02d " % i + b"x" * 100 for i in range(25)])
    assert c.peek("paged").stats["mem_items"] < 25  # the later pages come from disk
    browser.open(small_memory.url + "/queues/paged")

    def page(first: int, count: int) -> bool:
        rows = browser.all("#peek tbody td.data")
        return [r.text[:7] for r in rows] == [f"item {i:02d}" for i in range(first,
                                                                           first + count)]

    def buttons() -> tuple[bool, bool]:
        return (browser.find("#page-prev").is_enabled(),
                browser.find("#page-next").is_enabled())

    browser.wait("the first page", lambda: page(0, 10))
    assert buttons() == (False, True)
    assert browser.find("#page-label").text == "page 1 (the head)"
    browser.find("#page-next").click()
    browser.wait("the second page", lambda: page(10, 10))
    assert buttons() == (True, True)
    assert browser.find("#page-label").text.startswith("page 2 (after item ")
    browser.settle(1.6)  # a poll redraws the page it is on, not the head
    assert page(10, 10)
    browser.find("#page-next").click()
    browser.wait("the last page", lambda: page(20, 5))
    browser.wait("no next page", lambda: buttons() == (True, False))
    browser.find("#page-prev").click()
    browser.wait("the second page again", lambda: page(10, 10))
    browser.find("#page-prev").click()
    browser.wait("the head again", lambda: page(0, 10))
    assert buttons() == (False, True)
    info = c.peek("paged")
    assert (info.items, info.open_transactions) == (25, 0)  # nothing taken, nothing open
    assert [it.data[:7] for it in c.get("paged", 3)] == [b"item 00", b"item 01", b"item 02"]
    no_csp_violations(browser)


def test_a_chart_places_samples_by_time_and_breaks_at_a_gap(
        server: Served, browser: Any) -> None:
    """Samples kept across a clean restart leave a gap (the server was down): the chart
    places each sample by its time and draws no line across the gap."""
    browser.open(server.url + "/")
    browser.wait("the first poll", lambda: "updated" in browser.find("#status").text)
    lines = browser.js(
        "const svg = chart([{values: [1, 2, 3, 4, 5], times: [100, 110, 120, 990, 1000],"
        " cls: 'depth'}], 90, 20, 'test');"
        "return Array.from(svg.querySelectorAll('polyline'),"
        " (p) => p.getAttribute('points'));")
    assert len(lines) == 2  # 100-120 s, then 990-1000 s
    first = [float(p.split(",")[0]) for p in lines[0].split()]
    second = [float(p.split(",")[0]) for p in lines[1].split()]
    # 90 px for the 900 s from the first sample to the last: 10 s a pixel
    assert first == [0.0, 1.0, 2.0] and second == [89.0, 90.0]
    alone = browser.js(
        "return chart([{values: [7], times: [5], cls: 'depth'}], 90, 20, 'one')"
        ".querySelector('polyline').getAttribute('points');")
    assert [p.split(",")[0] for p in alone.split()] == ["0.0", "90.0"]  # across the chart
    no_csp_violations(browser)
