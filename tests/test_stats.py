"""Counters and histograms for statistics() and /metrics (queued.stats), pure: histogram
buckets (upper bounds inclusive, as Prometheus's `le`), snapshots that stay put, command
names for the metrics, and a listener's command counts. The exposition of these figures:
test_server_metrics.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queued.stats import FSYNC_BUCKETS, LATENCY_BUCKETS, Histogram, ProtocolStats, command_name
from queued.wire import commands as c


def test_a_bound_counts_in_its_own_bucket_and_the_rest_above_every_bound() -> None:
    h = Histogram((0.001, 0.01, 0.1))
    for seconds in (0.0005, 0.001, 0.001000001, 0.05, 5.0):
        h.observe(seconds)
    snap = h.snapshot()
    assert snap.bounds == (0.001, 0.01, 0.1)
    assert snap.cumulative == (2, 3, 4)  # 0.001 itself is "<= 0.001"
    assert snap.count == 5  # the +Inf bucket
    assert snap.sum == pytest.approx(5.052500001)


@given(st.lists(st.floats(min_value=0, max_value=10, allow_nan=False), max_size=50))
def test_cumulative_counts_are_what_a_plain_count_says(values: list[float]) -> None:
    h = Histogram(LATENCY_BUCKETS)
    for v in values:
        h.observe(v)
    snap = h.snapshot()
    assert snap.cumulative == tuple(sum(v <= b for v in values) for b in LATENCY_BUCKETS)
    assert list(snap.cumulative) == sorted(snap.cumulative)
    assert snap.count == len(values) and snap.sum == pytest.approx(sum(values))


def test_a_snapshot_does_not_move_with_later_observations() -> None:
    h = Histogram(FSYNC_BUCKETS)
    h.observe(0.003)
    before = h.snapshot()
    h.observe(0.003)
    assert before.count == 1 and before.cumulative[-1] == 1
    assert h.snapshot().count == 2


@pytest.mark.parametrize("bounds", [(1.0, 0.5), (0.5, 0.5), (0.1, 0.3, 0.2)])
def test_bounds_must_strictly_increase(bounds: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        Histogram(bounds)


def test_command_names_are_the_event_class_in_snake_case() -> None:
    assert command_name(c.FlushAllExpired()) == "flush_all_expired"
    assert command_name(c.Version()) == "version"
    assert command_name(c.FlushAllExpired()) == "flush_all_expired"  # (cached: the same)


def test_protocol_stats_count_commands_by_name() -> None:
    stats = ProtocolStats()
    stats.count("get")
    stats.count("get", 3)
    stats.count("set")
    assert stats.commands == {"get": 4, "set": 1}
