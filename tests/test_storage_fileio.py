"""The storage layer's one seam to the file system (queued.storage.fileio)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from queued.storage import fileio


def test_the_hot_file_calls_follow_the_installed_fileio(tmp_path: Path) -> None:
    """`fileio.use` routes write, writev and fsync too: the real FileIO's are the os
    functions themselves (no Python frames between a writer and the system), any
    other's go through it."""
    assert (fileio.write, fileio.writev, fileio.fsync) == (os.write, os.writev, os.fsync)
    calls: list[str] = []

    class Counting(fileio.FileIO):
        def writev(self, fd: int, buffers: Any) -> int:
            calls.append("writev")
            return super().writev(fd, buffers)

        def fsync(self, fd: int) -> None:
            calls.append("fsync")
            super().fsync(fd)

    previous = fileio.use(Counting())
    try:
        fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
        try:
            assert fileio.writev(fd, [b"ab", b"c"]) == 3
            fileio.fsync(fd)
            fileio.write_all(fd, b"d")
        finally:
            os.close(fd)
    finally:
        fileio.use(previous)
    assert calls == ["writev", "fsync"]
    assert (tmp_path / "f").read_bytes() == b"abcd"
    assert fileio.writev is os.writev


def test_a_monkeypatched_fileio_gets_the_hot_calls_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests install fakes by assigning `fileio._current` (monkeypatch.setattr) as well as
    with `use`: the hot calls follow either way, and the undo puts the os functions back."""
    class NoFsync(fileio.FileIO):
        def fsync(self, fd: int) -> None:
            raise OSError(5, "no fsync here")

    monkeypatch.setattr(fileio, "_current", NoFsync())
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError, match="no fsync here"):
            fileio.fsync(fd)
    finally:
        os.close(fd)
    monkeypatch.undo()
    assert fileio.fsync is os.fsync and type(fileio.current()) is fileio.FileIO


def test_pwrite_writes_at_its_offset_and_sync_all_syncs_the_file_system(
        tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    fd = fileio.open_fd(path, os.O_WRONLY)
    try:
        assert fileio.pwrite(fd, b"ab", 3) == 2
        assert fileio.pwrite(fd, memoryview(b"xyz"), 12) == 3  # past the end: a hole
    finally:
        fileio.close(fd)
    assert path.read_bytes() == b"012ab56789\0\0xyz"
    fileio.sync_all(tmp_path)  # (syncfs: what it made durable a power cut would show)
    with pytest.raises(OSError):
        fileio.sync_all(tmp_path / "missing")
