"""A simulated power cut under the real storage code: `PowerLossFS` replaces the storage
layer's file calls (queued.storage.fileio) and keeps what a disk would still hold after
the power goes out, the way LazyFS's `lose-unfsynced-writes` fault does.

Every call goes to the real files in a temp dir (the page cache, as the running server
sees it); beside them the layer keeps the durable state: a file's content as of its last
fsync, and a directory's entries as of its last directory fsync (a file created, renamed
or removed is only durable after its directory is fsynced, as on ext4 without
assumptions; a file never fsynced is empty). `cut()` takes that durable state at one
instant; once the server that was running is gone, `restore(cut)` turns the directory
into it. Directories themselves are assumed to exist (the data dir is made before).
"""

from __future__ import annotations

import os
import random
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from queued.storage import fileio


@dataclass(eq=False)
class Node:
    """One file (an inode): what an fsync last made durable; `dirty`: written since."""

    durable: bytes = b""
    dirty: bool = False


#: directory -> {entry name: content}: what the disk holds after a power cut
Cut = dict[str, dict[str, bytes]]


class PowerLossFS(fileio.FileIO):
    """See the module docstring. Tracks files in `root` (and directories made under it)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.abspath(root))
        self._lock = threading.Lock()
        self.names: dict[str, Node] = {}  # path -> file, as the running server sees it
        self.fds: dict[int, Node] = {}
        self.durable_names: dict[str, dict[str, Node]] = {}  # dir -> entries at its fsync
        self.fsyncs = 0
        #: the files each sync_files call was given, by number, in order
        self.sync_files_calls: list[int] = []
        self.bypasses: list[str] = []  # files changed without going through this layer
        self.adopt()

    # -- bookkeeping ------------------------------------------------------------------

    def adopt(self) -> None:
        """Everything in the tracked directories now is durable (a fresh start)."""
        with self._lock:
            self.names.clear()
            self.fds.clear()
            dirs = {str(self.root), *self.durable_names}
            self.durable_names = {}
            for d in dirs:
                if not os.path.isdir(d):
                    continue
                entries: dict[str, Node] = {}
                for name in os.listdir(d):
                    path = os.path.join(d, name)
                    if os.path.isfile(path):
                        with open(path, "rb") as f:
                            node = Node(f.read())
                        self.names[path] = node
                        entries[name] = node
                self.durable_names[d] = entries

    def _tracked(self, path: fileio.StrPath) -> str | None:
        p = os.path.abspath(os.fspath(path))
        return p if os.path.dirname(p) in self.durable_names else None

    def dirty(self) -> bool:
        """Bytes or directory entries that a power cut would lose."""
        with self._lock:
            if any(n.dirty for n in self.names.values()) or any(
                    n.dirty for n in self.fds.values()):
                return True
            for d, entries in self.durable_names.items():
                now = {os.path.basename(p): n for p, n in self.names.items()
                       if os.path.dirname(p) == d}
                if now.keys() != entries.keys() or any(
                        now[k] is not entries[k] for k in now):
                    return True
            return False

    def cut(self, tear: random.Random | None = None) -> Cut:
        """The power goes out now: what the disk holds. With `tear`, a file written past
        its last fsync keeps a random part of what was appended since (pages written
        back before the power went out), so torn batches reach recovery too."""
        with self._lock:
            return {d: {name: self._after_cut(node, tear) for name, node in entries.items()}
                    for d, entries in self.durable_names.items()}

    def _after_cut(self, node: Node, tear: random.Random | None) -> bytes:
        if tear is None or not node.dirty:
            return node.durable
        now = self._content(node)
        if now is None or not now.startswith(node.durable) or len(now) == len(node.durable):
            return node.durable
        return now[: tear.randint(len(node.durable), len(now))]

    def _content(self, node: Node) -> bytes | None:
        """What the file holds now (through a name or an open fd), if it can be read."""
        for fd, n in self.fds.items():
            if n is node:
                with open(f"/proc/self/fd/{fd}", "rb") as f:
                    return f.read()
        for path, n in self.names.items():
            if n is node:
                with open(path, "rb") as f:
                    return f.read()
        return None

    def restore(self, cut: Cut) -> None:
        """Make the tracked directories hold exactly `cut` (call it once nothing runs on
        them any more), then start afresh from it."""
        for d, entries in cut.items():
            for name in os.listdir(d):
                path = os.path.join(d, name)
                if os.path.isfile(path) or os.path.islink(path):
                    os.unlink(path)
            for name, data in entries.items():
                with open(os.path.join(d, name), "wb") as f:
                    f.write(data)
        self.adopt()

    # -- the file calls ---------------------------------------------------------------

    def open(self, path: fileio.StrPath, flags: int, mode: int = 0o644) -> int:
        p = self._tracked(path)
        existed = os.path.exists(path)
        fd = super().open(path, flags, mode)
        if p is not None:
            with self._lock:
                node = self.names.get(p)
                if node is None:
                    if existed:  # a file made behind this layer's back
                        self.bypasses.append(p)
                    node = self.names[p] = Node()
                if flags & os.O_TRUNC:
                    node.dirty = True
                self.fds[fd] = node
        return fd

    def _wrote(self, fd: int) -> None:
        node = self.fds.get(fd)
        if node is not None:
            node.dirty = True

    def write(self, fd: int, data: bytes | bytearray | memoryview) -> int:
        with self._lock:
            self._wrote(fd)
        return super().write(fd, data)

    def writev(self, fd: int, buffers: Sequence[bytes | bytearray | memoryview]) -> int:
        with self._lock:
            self._wrote(fd)
        return super().writev(fd, buffers)

    def pwrite(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        with self._lock:
            self._wrote(fd)
        return super().pwrite(fd, data, offset)

    def ftruncate(self, fd: int, length: int) -> None:
        with self._lock:
            self._wrote(fd)
        super().ftruncate(fd, length)

    def fsync(self, fd: int) -> None:
        # No real fsync: the real files are the page cache here; durability is ours.
        with self._lock:
            node = self.fds.get(fd)
            if node is not None:
                with open(f"/proc/self/fd/{fd}", "rb") as f:
                    node.durable = f.read()
                node.dirty = False
            self.fsyncs += 1

    def fdatasync(self, fd: int) -> None:
        self.fsync(fd)  # (the model keeps contents only: the size is a part of them)

    def close(self, fd: int) -> None:
        with self._lock:
            self.fds.pop(fd, None)
        super().close(fd)

    def sync_files(self, fds: Sequence[int], directory: fileio.StrPath) -> None:
        # What the storage layer may rely on of syncfs: these files and the directory
        # (a real syncfs makes more durable: every file of the file system).
        self.sync_files_calls.append(len(fds))
        for fd in fds:
            self.fsync(fd)
        self.fsync_dir(directory)

    def sync_all(self, directory: fileio.StrPath) -> None:
        # syncfs: every file of the file system, open or not, and every directory.
        with self._lock:
            nodes = {id(n): n for n in (*self.names.values(), *self.fds.values())}
            for node in nodes.values():
                content = self._content(node)
                if content is not None:
                    node.durable = content
                node.dirty = False
            for d in self.durable_names:
                self.durable_names[d] = {os.path.basename(p): n for p, n in self.names.items()
                                         if os.path.dirname(p) == d}
            self.fsyncs += 1

    def fsync_dir(self, path: fileio.StrPath) -> None:
        d = os.path.abspath(os.fspath(path))
        with self._lock:
            if d in self.durable_names:
                self.durable_names[d] = {os.path.basename(p): n for p, n in self.names.items()
                                         if os.path.dirname(p) == d}

    def replace(self, src: fileio.StrPath, dst: fileio.StrPath) -> None:
        super().replace(src, dst)
        s, t = self._tracked(src), self._tracked(dst)
        with self._lock:
            node = self.names.pop(s, None) if s is not None else None
            if t is not None:
                if node is None:
                    self.bypasses.append(t)
                    node = Node(dirty=True)
                self.names[t] = node

    def link(self, src: fileio.StrPath, dst: fileio.StrPath) -> None:
        super().link(src, dst)
        s, t = self._tracked(src), self._tracked(dst)
        with self._lock:
            if s is not None and t is not None and s in self.names:
                self.names[t] = self.names[s]

    def unlink(self, path: fileio.StrPath) -> None:
        super().unlink(path)
        p = self._tracked(path)
        if p is not None:
            with self._lock:
                self.names.pop(p, None)

    def mkdir(self, path: fileio.StrPath) -> None:
        super().mkdir(path)
        d = os.path.abspath(os.fspath(path))
        if d.startswith(str(self.root)):
            with self._lock:
                self.durable_names.setdefault(d, {})

    def copy_file(self, src: fileio.StrPath, dst: fileio.StrPath) -> None:
        shutil.copyfile(src, dst)  # and its data fsynced, as the real one does
        t = self._tracked(dst)
        if t is not None:
            with self._lock, open(t, "rb") as f:
                self.names[t] = Node(f.read())
