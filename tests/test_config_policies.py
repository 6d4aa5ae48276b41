"""The storage policies (queued.config.policies): fsync's spellings."""

from __future__ import annotations

import pytest

from queued.config import (
    FsyncPolicy,
)


def test_fsync_policy_parse() -> None:
    assert str(FsyncPolicy.parse("always")) == "always"
    assert str(FsyncPolicy.parse("never")) == "never"
    assert FsyncPolicy.parse("200ms").interval_ms == 200
    assert FsyncPolicy.parse(15).interval_ms == 15
    with pytest.raises(ValueError):
        FsyncPolicy.parse("sometimes")
