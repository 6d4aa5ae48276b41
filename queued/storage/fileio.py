"""The one seam between the storage layer and the file system: every call that changes
something on disk (create, write, sync, truncate, rename, link, remove, make a directory).

Storage modules call the functions here, never `os` directly, for anything that writes;
reads (opening a file for reading, listing, stat) go straight to the OS. `FileIO` is the
real thing, thin wrappers of `os`; a test installs another (`use`) that, say, fails an
fsync, or keeps every byte not yet fsynced and drops it on a simulated power cut. Never
buffers, retries or interprets anything: the callers own the durability logic.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

StrPath = str | os.PathLike[str]


def _find_syncfs() -> Callable[[int], int] | None:
    """Linux's syncfs(2) from the C library (Python's os has none); None elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.syncfs
    except (OSError, AttributeError):  # pragma: no cover (not Linux)
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_SYNCFS = _find_syncfs()


def _syncfs(directory: StrPath) -> None:
    """syncfs(2) on `directory`'s file system (Linux)."""
    assert _SYNCFS is not None
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _SYNCFS(dfd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        os.close(dfd)


class FileIO:
    """The file system calls the storage layer makes; see the module docstring."""

    def open(self, path: StrPath, flags: int, mode: int = 0o644) -> int:
        """os.open for writing (any O_CREAT, O_EXCL, O_TRUNC, O_APPEND)."""
        return os.open(path, flags, mode)

    def write(self, fd: int, data: bytes | bytearray | memoryview) -> int:
        return os.write(fd, data)

    def writev(self, fd: int, buffers: Sequence[bytes | bytearray | memoryview]) -> int:
        return os.writev(fd, buffers)

    def pwrite(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        """The file's data (and what reading it back needs: its size) made durable."""
        os.fdatasync(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def close(self, fd: int) -> None:
        os.close(fd)

    def sync_files(self, fds: Sequence[int], directory: StrPath) -> None:
        """Make the data of `fds` (files in `directory`) and the directory's entries
        durable, in one call where the system has one: syncfs(2) on the directory's file
        system (one journal commit for them all, rather than one fsync each in turn;
        since Linux 5.8 it reports a write-back error of any file of that file system),
        else an fsync of each and of the directory."""
        if _SYNCFS is None:  # pragma: no cover (not Linux)
            for fd in fds:
                os.fsync(fd)
            self.fsync_dir(directory)
            return
        _syncfs(directory)

    def sync_all(self, directory: StrPath) -> None:
        """Make every file of `directory`'s file system durable, open or not, with the
        directory's entries: syncfs(2) (else sync(2))."""
        if _SYNCFS is None:  # pragma: no cover (not Linux)
            os.sync()
            return
        _syncfs(directory)

    def fsync_dir(self, path: StrPath) -> None:
        """Make the directory's entries (files created, renamed, removed) durable."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def replace(self, src: StrPath, dst: StrPath) -> None:
        os.replace(src, dst)

    def link(self, src: StrPath, dst: StrPath) -> None:
        os.link(src, dst)

    def unlink(self, path: StrPath) -> None:
        os.unlink(path)

    def mkdir(self, path: StrPath) -> None:
        """The directory and its parents, if missing."""
        Path(path).mkdir(parents=True, exist_ok=True)

    def copy_file(self, src: StrPath, dst: StrPath) -> None:
        """A copy of src at dst with its data fsynced (its entry is the caller's business)."""
        shutil.copyfile(src, dst)
        fd = os.open(dst, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_current = FileIO()


def use(io: FileIO) -> FileIO:
    """Route the storage layer's file calls through `io` from now on; returns the one it
    replaces (put it back when done)."""
    global _current
    previous, _current = _current, io
    _bind_hot_calls(io)
    return previous


def current() -> FileIO:
    return _current


def open_fd(path: StrPath, flags: int, mode: int = 0o644) -> int:
    return _current.open(path, flags, mode)


def write(fd: int, data: bytes | bytearray | memoryview) -> int:
    return _current.write(fd, data)


def writev(fd: int, buffers: Sequence[bytes | bytearray | memoryview]) -> int:
    return _current.writev(fd, buffers)


def pwrite(fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
    return _current.pwrite(fd, data, offset)


def fsync(fd: int) -> None:
    _current.fsync(fd)


def fdatasync(fd: int) -> None:
    _current.fdatasync(fd)


def ftruncate(fd: int, length: int) -> None:
    _current.ftruncate(fd, length)


def close(fd: int) -> None:
    _current.close(fd)


def sync_files(fds: Sequence[int], directory: StrPath) -> None:
    _current.sync_files(fds, directory)


def sync_all(directory: StrPath) -> None:
    _current.sync_all(directory)


def fsync_dir(path: StrPath) -> None:
    _current.fsync_dir(path)


def replace(src: StrPath, dst: StrPath) -> None:
    _current.replace(src, dst)


def link(src: StrPath, dst: StrPath) -> None:
    _current.link(src, dst)


def unlink(path: StrPath, *, missing_ok: bool = False) -> None:
    try:
        _current.unlink(path)
    except FileNotFoundError:
        if not missing_ok:
            raise


def mkdir(path: StrPath) -> None:
    _current.mkdir(path)


def copy_file(src: StrPath, dst: StrPath) -> None:
    _current.copy_file(src, dst)


#: The calls made per round or per write (a journal's writev and fsync, a file's write):
#: while the real FileIO is in use these module names are the `os` functions themselves,
#: so a call reaches the system without two Python frames (which cost a compiled writer
#: ~1 µs each); with any other FileIO they go through it, as every other call does.
#: `use` rebinds them, and so does assigning `_current` (see `_Seam`).
_VIA_CURRENT: Final = {"write": write, "writev": writev, "fsync": fsync}


def _bind_hot_calls(io: FileIO) -> None:
    names = globals()
    if type(io) is FileIO:
        names.update(write=os.write, writev=os.writev, fsync=os.fsync)
    else:
        names.update(_VIA_CURRENT)


class _Seam(types.ModuleType):
    """This module's type: assigning `_current` from outside (a test's monkeypatch of it,
    and the monkeypatch's undo) routes the hot calls as `use` does."""

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name == "_current":
            _bind_hot_calls(value)  # type: ignore[arg-type]


_bind_hot_calls(_current)
sys.modules[__name__].__class__ = _Seam


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write every byte of `data` (os.write may write less than asked)."""
    view = memoryview(data)
    while view:
        view = view[write(fd, view):]
