"""Fixtures shared by several test files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from disk_util import tmpfs_mount


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A fresh 2 MiB tmpfs (skips the test where it cannot be mounted)."""
    yield from tmpfs_mount(tmp_path)
