"""The console charts' samples (queued.server.history): a ring of the last 15 minutes per
queue, rates from counters, the cap on names, and what each user may see."""

from __future__ import annotations

from queued.server.history import SAMPLES, History


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
