"""A small real file system for disk-full tests: a tmpfs mounted per test (needs root).

`tmpfs` is a fixture (registered in conftest.py); the helpers fill it up.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

KiB = 1024


def tmpfs_mount(tmp_path: Path) -> Iterator[Path]:
    """A fresh 2 MiB tmpfs under `tmp_path`, unmounted afterwards whatever happens."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
            capture_output=True, text=True, timeout=20, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
    try:
        yield mnt
    finally:
        done = subprocess.run(["umount", str(mnt)], capture_output=True, timeout=20, check=False)
        if done.returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=20,
                           check=False)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave: int = 0) -> int:
    """Write a filler file taking all but about `leave` bytes; returns its size."""
    target = max(0, free_bytes(path.parent) - leave)
    block = b"\xa5" * (64 * KiB)
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while written < target:
            try:
                written += os.write(fd, block[: min(len(block), target - written)])
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    finally:
        os.close(fd)
    return written


def fill_completely(path: Path) -> None:
    """Fill the filesystem to the last byte: no page left, the filler's last page full."""
    fill(path, leave=0)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        for size in (4096, 512, 64, 8, 1):
            try:
                while os.write(fd, b"\xa5" * size):
                    pass
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)
    assert free_bytes(path.parent) == 0


