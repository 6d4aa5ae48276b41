"""The settings (queued.config.settings): the per-queue inheritance default ->
[queues.q] -> [queues."q+reader"], typed read-only overrides, the storage policies a
queue's settings make, and the retry back-off by error count."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from config_util import INHERIT, load_file, write

from queued import config as cfg
from queued.config import (
    FsyncMode,
    FsyncPolicy,
    FullPolicy,
    JournalConfig,
    MiB,
    QueueConfig,
)


def test_inheritance_default_queue_reader(tmp_path: Path) -> None:
    config = load_file(write(tmp_path, INHERIT))
    unconfigured = config.queue_config("nothing")
    assert unconfigured == dataclasses.replace(
        QueueConfig(), max_items=100, max_age=60_000, fsync=FsyncPolicy(FsyncMode.NEVER)
    )
    jobs = config.queue_config("jobs")
    assert jobs == dataclasses.replace(
        unconfigured,
        max_items=1000,
        fsync=FsyncPolicy(FsyncMode.PERIODIC, 20),
        journal_size=MiB,
    )
    audit = config.reader_config("jobs", "audit")
    assert audit == dataclasses.replace(jobs, max_age=3_600_000, error_queue="audit_errors")
    assert config.queue_config("jobs+audit") == audit
    # a reader without a section, and the default reader, are their queue
    assert config.reader_config("jobs", "other") == jobs
    assert config.reader_config("jobs", "") == jobs
    # a reader section of an unconfigured queue inherits from the default
    assert config.reader_config("other", "r1") == dataclasses.replace(unconfigured, max_items=1)
    # a reader section does not leak into its queue
    assert config.queue_config("other") == unconfigured


def test_queue_overrides_are_typed_and_read_only(tmp_path: Path) -> None:
    config = load_file(write(tmp_path, INHERIT))
    assert dict(config.queues["jobs"]) == {
        "max_items": 1000,
        "fsync": FsyncPolicy(FsyncMode.PERIODIC, 20),
        "journal_size": MiB,
    }
    with pytest.raises(TypeError):
        config.queues["new"] = {}  # type: ignore[index]
    with pytest.raises(TypeError):
        config.queues["jobs"]["max_items"] = 1  # type: ignore[index]


def test_names_with_colons_and_dashes(tmp_path: Path) -> None:
    text = '[queues."a:b-c_D9"]\nmax_items = 1\n[queues."a:b-c_D9+x:y"]\nmax_items = 2\n'
    config = load_file(write(tmp_path, text))
    assert config.reader_config("a:b-c_D9", "x:y").max_items == 2


def test_journal_config_mapping() -> None:
    queue = QueueConfig(
        journal_size=3 * MiB,
        max_journal_size=30 * MiB,
        journal_full_policy=FullPolicy.DROP_OLDEST,
        fsync=FsyncPolicy(FsyncMode.PERIODIC, 5),
        max_items=9,
    )
    assert queue.journal_config() == JournalConfig(
        journal_size=3 * MiB,
        max_journal_size=30 * MiB,
        full_policy=FullPolicy.DROP_OLDEST,
        fsync=FsyncPolicy(FsyncMode.PERIODIC, 5),
    )
    assert QueueConfig().journal_config() == JournalConfig()


def test_retry_backoff_steps_by_error_count() -> None:
    config = cfg.load_config({}, env={"QUEUED_CONFIG": ""})
    assert config.default.retry_backoff == () and config.default.backoff_ms(3) == 0
    q = dataclasses.replace(config.default, retry_backoff=(1000, 10_000, 60_000))
    assert [q.backoff_ms(n) for n in (1, 2, 3, 4, 50)] == [1000, 10_000, 60_000, 60_000, 60_000]
    assert cfg.QUEUE_KEYS["retry_backoff"](["1s", "10s", "1m"], False) == (1000, 10_000, 60_000)
    assert cfg.QUEUE_KEYS["retry_backoff"]("1s, 2s", True) == (1000, 2000)  # the environment
    for bad in (["0s"], "1s", [["1s"]], ["1s"] * 65):
        with pytest.raises(ValueError):
            cfg.QUEUE_KEYS["retry_backoff"](bad, False)
