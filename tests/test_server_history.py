"""The console charts' samples (queued.server.history): a ring of the last 15 minutes per
queue, rates from counters, the cap on names, and what each user may see."""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path

import pytest
from server_util import WAIT, ServerProcess, http_get, send_lines

from queued.server.history import SAMPLES, History
from queued.storage.datadir import HISTORY_FILE


def fields(items: int, puts: int, gets: int) -> dict[str, int]:
    return {"items": items, "total_items": puts, "gets": gets}


def test_samples_give_depth_and_rates_per_second() -> None:
    h = History()
    h.sample(1000.0, [("q", fields(0, 0, 0))])
    h.sample(1010.0, [("q", fields(50, 100, 50))])
    h.sample(1020.0, [("q", fields(20, 100, 80))])
    q = h.view(lambda _: True)["queues"]["q"]  # type: ignore[index]
    assert q == {"t": [1000.0, 1010.0, 1020.0], "items": [0, 50, 20],
                 "puts": [10.0, 0.0], "gets": [5.0, 3.0]}


def test_a_point_taken_now_ends_the_series() -> None:
    h = History()
    h.sample(1000.0, [("q", fields(1, 10, 0))])
    view = h.view(lambda _: True, 1005.0, {"q": fields(6, 20, 5)})
    assert view["queues"] == {"q": {"t": [1000.0, 1005.0], "items": [1, 6],  # type: ignore[comparison-overlap]
                                    "puts": [2.0], "gets": [1.0]}}


def test_the_window_is_fifteen_minutes_and_new_queues_align_to_the_end() -> None:
    h = History()
    for k in range(SAMPLES + 20):
        stats = [("old", fields(k, k, 0))] + ([("new", fields(k, 0, 0))] if k >= 100 else [])
        h.sample(10.0 * k, stats)
    view = h.view(lambda _: True)
    old, new = view["queues"]["old"], view["queues"]["new"]  # type: ignore[index]
    assert len(old["t"]) == SAMPLES == 90 and old["items"][-1] == SAMPLES + 19
    assert new["t"] == [1000.0, 1010.0, 1020.0, 1030.0, 1040.0, 1050.0, 1060.0, 1070.0,
                        1080.0, 1090.0] and new["items"] == list(range(100, 110))


def test_a_counter_that_went_back_counts_zero_and_deleted_queues_go() -> None:
    h = History()
    h.sample(0.0, [("q", fields(5, 500, 0)), ("gone", fields(1, 1, 1))])
    h.sample(10.0, [("q", fields(0, 3, 0))])  # deleted and made again meanwhile
    view = h.view(lambda _: True)
    assert view["queues"]["q"]["puts"] == [0.0]  # type: ignore[index]
    assert "gone" not in view["queues"]  # type: ignore[operator]


def test_names_past_the_cap_are_not_kept_and_a_user_sees_only_its_own() -> None:
    h = History(max_queues=2)
    h.sample(0.0, [(n, fields(1, 1, 1)) for n in ("a", "b", "c")])
    assert set(h.series) == {"a", "b"}
    assert set(h.view(lambda n: n == "b")["queues"]) == {"b"}  # type: ignore[arg-type]


def test_a_queue_made_since_the_last_sample_has_its_point_of_now() -> None:
    h = History(max_queues=2)
    h.sample(0.0, [("a", fields(1, 1, 1))])
    now = {"a": fields(2, 2, 1), "b": fields(7, 7, 0), "c": fields(1, 1, 0)}
    view = h.view(lambda _: True, 5.0, now)["queues"]
    assert view["b"] == {"t": [5.0], "items": [7], "puts": [], "gets": []}  # type: ignore[index]
    assert "c" not in view  # type: ignore[operator]  # past the cap


# -- kept across a clean restart ------------------------------------------------------------


def test_a_snapshot_restores_what_is_still_within_the_window() -> None:
    h = History()
    for k in range(30):  # 0 .. 290 s
        h.sample(10.0 * k, [("q", fields(k, 2 * k, k)),
                            *([("young", fields(1, k, 0))] if k >= 25 else []),
                            ("deleted", fields(0, 0, 0))])
    doc = json.loads(json.dumps(h.snapshot()))  # as the file holds it
    back = History()
    # 700 s later (down for 410 s): samples from 0 to 290 s are < 900 s old but 0..70 s
    assert back.restore(doc, 990.0, {"q", "young", "new"}) == 2
    view = back.view(lambda _: True)["queues"]
    q = view["q"]  # type: ignore[index]
    assert q["t"] == [10.0 * k for k in range(10, 30)] and q["items"] == list(range(10, 30))
    assert view["young"]["items"] == [1] * 5  # type: ignore[index]
    assert view["young"]["t"] == [250.0, 260.0, 270.0, 280.0, 290.0]  # type: ignore[index]
    assert "deleted" not in view  # type: ignore[operator]  # (not in the data dir now)
    back.sample(1000.0, [("q", fields(3, 4, 5))])  # this run's samples go on after them
    assert back.view(lambda _: True)["queues"]["q"]["t"][-2:] == [290.0, 1000.0]  # type: ignore[index]


def test_an_old_or_future_snapshot_restores_nothing() -> None:
    h = History()
    h.sample(100.0, [("q", fields(1, 1, 1))])
    doc = h.snapshot()
    for now in (100.0 + 900.0, 50.0):  # all too old; the clock went back
        back = History()
        assert back.restore(doc, now, {"q"}) == 0 and back.view(lambda _: True)["queues"] == {}


@pytest.mark.parametrize("doc", [
    None, [], {"version": 2, "times": [], "series": {}}, {"version": 1},
    {"version": 1, "times": [2.0, 1.0], "series": {}},
    {"version": 1, "times": ["x"], "series": {}},
    {"version": 1, "times": [1.0], "series": {"q": {"items": [1], "puts": [1]}}},
    {"version": 1, "times": [1.0], "series": {"q": {"items": [1], "puts": [1], "gets": [1.5]}}},
    {"version": 1, "times": [1.0], "series": {"q": {"items": [1, 2], "puts": [1, 2],
                                                    "gets": [1, 2]}}},
    {"version": 1, "times": [1.0], "series": {"q": {"items": [1 << 64], "puts": [1],
                                                    "gets": [1]}}},
])
def test_a_document_that_is_no_snapshot_is_refused_and_changes_nothing(doc: object) -> None:
    h = History()
    h.sample(5.0, [("q", fields(1, 1, 1))])
    before = h.snapshot()
    with pytest.raises(ValueError):
        h.restore(doc, 10.0, {"q"})
    assert h.snapshot() == before


def test_save_and_load_through_the_data_dir(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                            ) -> None:
    h = History()
    h.sample(100.0, [("q", fields(4, 4, 0))])
    h.save(tmp_path)
    assert (tmp_path / HISTORY_FILE).exists()
    back = History()
    back.load(tmp_path, 110.0, {"q"})
    assert back.view(lambda _: True)["queues"]["q"]["items"] == [4]  # type: ignore[index]
    assert not (tmp_path / HISTORY_FILE).exists()  # read once: a crash later starts empty
    back.load(tmp_path, 120.0, {"q"})  # no file: nothing happens
    (tmp_path / HISTORY_FILE).write_bytes(b'{"version": 1, "times": [')
    empty = History()
    with caplog.at_level(logging.WARNING, logger="queued.console"):
        empty.load(tmp_path, 120.0, {"q"})
    assert empty.view(lambda _: True)["queues"] == {}
    assert "chart history" in caplog.text and "not read" in caplog.text
    assert not (tmp_path / HISTORY_FILE).exists()


def history_when_ready(server: ServerProcess) -> dict[str, dict[str, list[float]]]:
    """/api/history of a server once recovery has finished (it answers 503 before)."""
    deadline = time.monotonic() + WAIT
    while (reply := http_get(server.http, "/api/history"))[0] == 503:
        assert time.monotonic() < deadline, "not ready in time"
        time.sleep(0.02)
    assert reply[0] == 200
    return json.loads(reply[2])["queues"]  # type: ignore[no-any-return]


def test_a_clean_restart_keeps_the_charts_and_a_crash_does_not(tmp_path: Path) -> None:
    """`queued serve` stopped by SIGTERM writes the history; the next start serves it
    (samples from before the restart) and removes the file; a SIGKILL writes nothing."""
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log")
    server.start()
    try:
        for i in range(7):
            assert send_lines(server.memcache, b"set q 0 0 1\r\n%d\r\n" % i,
                              until=b"\r\n") == b"STORED\r\n"
        server.signal(signal.SIGTERM)
        assert server.wait() == 0
        assert (tmp_path / "data" / HISTORY_FILE).exists()
        restarted = time.time()
        server.start()
        q = history_when_ready(server)["q"]
        before = [t for t in q["t"] if t < restarted]
        assert before and q["items"][:len(before)][-1] == 7  # the last point of the last run
        assert not (tmp_path / "data" / HISTORY_FILE).exists()
        server.kill()  # a crash: nothing written
        assert not (tmp_path / "data" / HISTORY_FILE).exists()
        server.start()
        q = history_when_ready(server)["q"]
        assert all(t >= restarted for t in q["t"]) and q["items"][-1] == 7
        assert b"data dir: ignoring" not in server.log()
    finally:
        server.kill()
