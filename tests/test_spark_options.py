"""Options of the `queued` Spark source and sink (queued.spark.options), pure (no
SparkSession): names by any case and their older aliases, unknown names refused with the
valid ones listed, one option given twice under two names, and each kind of value
(durations, positive integers, booleans, queue lists and patterns, JSON offsets) with the
error a bad one raises. Through a real SparkSession: test_spark_stream.py."""

from __future__ import annotations

import re

import pytest

from queued.spark.options import (
    READ_OPTIONS,
    STREAM_OPTIONS,
    Options,
    QueuedDataSourceError,
    bool_option,
    duration_option,
    int_option,
    offsets_option,
    optional_int,
    pattern_option,
    pending_reader_option,
    queues_option,
)


def test_names_by_any_case_and_their_older_aliases() -> None:
    o = Options({"MAXOFFSETSPERTRIGGER": "5", "queues": "a,b", "path": "/x"},
                STREAM_OPTIONS, "spark.readStream")
    assert o.get("maxOffsetsPerTrigger") == "5" and o.get("max_items_per_trigger") == "5"
    assert o.get("subscribe") == "a,b" and "subscribe" in o and "subscribePattern" not in o
    assert o.get("minPartitions", 7) == 7


def test_an_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(QueuedDataSourceError) as info:
        Options({"pendng": "true"}, READ_OPTIONS, "spark.read")
    message = str(info.value)
    assert message.startswith("unknown option pendng for spark.read of the queued source")
    assert all(name in message for name in READ_OPTIONS)
    assert "subscribe (or queues, queue)" in message
    Options({"path": "/x", "paths": "[]"}, READ_OPTIONS, "spark.read")  # Spark adds these


def test_one_option_under_two_names_must_agree() -> None:
    Options({"maxOffsetsPerTrigger": "5", "max_items_per_trigger": "5"}, STREAM_OPTIONS, "s")
    with pytest.raises(QueuedDataSourceError, match="mean the same; give one"):
        Options({"maxOffsetsPerTrigger": "5", "max_items_per_trigger": "6"},
                STREAM_OPTIONS, "s")


@pytest.mark.parametrize(("raw", "seconds"), [
    ("15m", 900.0), ("30s", 30.0), ("500ms", 0.5), ("1h", 3600.0), ("2", 2.0), ("1.5 S", 1.5),
    (None, 9.0), ("", 9.0),
])
def test_durations(raw: str | None, seconds: float) -> None:
    assert duration_option({"d": raw}, "d", 9.0) == seconds


@pytest.mark.parametrize("raw", ["soon", "5 weeks", "-1s", "1e3s"])
def test_bad_durations(raw: str) -> None:
    with pytest.raises(QueuedDataSourceError, match="must be a duration"):
        duration_option({"d": raw}, "d", 1.0)


def test_integers_and_booleans() -> None:
    assert int_option({"n": "12"}, "n", 3) == 12 and int_option({}, "n", 3) == 3
    assert optional_int({}, "n") == 0 and optional_int({"n": "4"}, "n") == 4
    for bad, why in (("x", "must be an integer"), ("0", "must be positive"),
                     ("-2", "must be positive")):
        with pytest.raises(QueuedDataSourceError, match=why):
            int_option({"n": bad}, "n", 3)
    assert bool_option({"b": "TRUE"}, "b") and bool_option({"b": "yes"}, "b")
    assert not bool_option({}, "b") and not bool_option({"b": "0"}, "b")
    with pytest.raises(QueuedDataSourceError, match="must be true or false"):
        bool_option({"b": "maybe"}, "b")


def test_queues_patterns_and_the_pending_reader() -> None:
    assert queues_option({"subscribe": "a, b,a"}) == frozenset({"a", "b"})
    assert queues_option({}) is None
    with pytest.raises(QueuedDataSourceError, match="bad queue names"):
        queues_option({"subscribe": "ok,not/ok"})
    pattern = pattern_option({"subscribePattern": "jobs-.*"})
    assert pattern is not None and pattern.fullmatch("jobs-1") and not pattern.fullmatch("x")
    with pytest.raises(QueuedDataSourceError, match="not both"):
        pattern_option({"subscribePattern": "a.*", "subscribe": "b"})
    with pytest.raises(QueuedDataSourceError, match=re.escape("option subscribePattern '('")):
        pattern_option({"subscribePattern": "("})
    assert pending_reader_option({}) is None
    assert pending_reader_option({"pending": "true"}) == ""
    assert pending_reader_option({"reader": "audit"}) == "audit"
    with pytest.raises(QueuedDataSourceError, match="bad reader name"):
        pending_reader_option({"reader": "a/b"})


def test_offsets_are_earliest_latest_or_json_per_queue() -> None:
    assert offsets_option({}, "startingOffsets", "earliest") == "earliest"
    assert offsets_option({"startingOffsets": "LATEST"}, "startingOffsets", "x") == "latest"
    assert offsets_option({"startingOffsets": '{"q": 5, "r": -1}'}, "startingOffsets",
                          "earliest") == {"q": 5, "r": -1}
    for bad in ("sometime", '{"q": "five"}', '{"bad name": 1}', "[1, 2]"):
        with pytest.raises(QueuedDataSourceError):
            offsets_option({"startingOffsets": bad}, "startingOffsets", "earliest")
