"""The intent log: one durable point for a pass that appended to many segment files under
fsync "always", or few bytes to one or a few (`writer.LOG_SMALL_PASS`).

Such a pass writes its batches to their segment files (the files of record, in the
seed's format) without an fsync each; the same bytes, with each file's name and offset,
are written to this one log in the data directory, and one fdatasync of the log makes
the whole pass durable, where an fsync of each file in turn costs one each, `syncfs`
writes back every dirty file of the file system on the server's thread, and even one
appended file's fsync writes its new size as well as its data. The log's file
is zeros ahead of its records (grown in GROW_BYTES steps, on a thread of its own while
GROW_AHEAD of zeros are left), so a record is written over blocks the file has and its
fdatasync writes that data alone, not the file's size too.
After a power cut, `replay` writes the log's records back into their files at their
offsets before recovery reads a segment, so every byte the log holds is where the pass
put it (a file the pass created and whose directory entry the cut took is made again).

A record stands for bytes of a file by its name and offset, so it must never outlive a
change of that file other than an append: before a segment is removed, renamed over or
moved (retiring, compaction, deleting a queue), at a clean shutdown and once the log
holds `SETTLE_BYTES`, the log is settled (`IntentLog.settle`): the file system synced
(every file the log names is durable then), and a new head with a new epoch written over
the old one; the next records are written from the head's end again. Segments are only
ever appended to between those points (a partial batch trimmed after a failed write was
never logged).

The file: a head (`MAGIC`, a random u64 epoch), then records, each `crc u32, epoch u32,
data length u32, offset u64, name length u16, name, data` (big-endian; the record's
epoch is the low 32 bits of the head's). The crc covers everything after it, seeded with
the head's crc. Replay stops at the first record that does not check, or names another
epoch: the zeros after the last record, a record of an earlier epoch written over, or
the tear of an append whose pass was never answered. The name has no "." (never a
journal file name: our recovery and libkestrel pass it by).
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from queued.journal import format as jf
from queued.storage import fileio

log = logging.getLogger("queued.journal")

#: The log's file name in the data directory (no ".": never a journal file name).
INTENT_FILE: Final = "queued-intents"
MAGIC: Final = b"QDINTENT"
_HEAD: Final = struct.Struct(">8sQ")  # magic, epoch
_CRC: Final = struct.Struct(">I")
_CRC_SIZE: Final = 4  # (_CRC.size, a constant: no look-up at each use)
_pack_crc: Final = _CRC.pack_into
#: after the crc: the epoch's low 32 bits, data length, offset, name length
_FIXED: Final = struct.Struct(">IIQH")
RECORD_OVERHEAD: Final = _CRC_SIZE + _FIXED.size
#: Once the log holds this much, the next pass settles it first.
SETTLE_BYTES: Final = 64 * 1024 * 1024
#: After this many bytes appended, the file system is synced on a thread of its own
#: (`IntentLog._flush`): the segments the log stands for are then mostly written back
#: when it settles, whose syncfs holds up a pass (64 MiB left to it: ~0.3 s here).
FLUSH_BYTES: Final = 4 * 1024 * 1024
#: The file grows by zeros in steps of this (records are written over them).
GROW_BYTES: Final = 4 * 1024 * 1024
#: Once fewer zeros than this are left ahead of the records, the next step is written and
#: fsynced on a thread of its own (`IntentLog._grow_ahead`) while passes go on: on the
#: pass's thread each step held a pass 2-3 ms here (an idle disk; 5-25 ms under load),
#: 16 times after each start.
GROW_AHEAD: Final = GROW_BYTES // 2
ZERO_CHUNK: Final = 1024 * 1024
#: A pass with more bytes than this syncs its files instead (`fileio.sync_files`): a
#: second copy of big batches costs more than the commits it saves.
PASS_BYTES: Final = 1024 * 1024
#: write() errors after which the log is used again (a full disk: its zeros trimmed off).
RECOVERABLE_WRITE_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
crc32: Final = zlib.crc32

#: One file's bytes of a pass: the file's name in the directory (encoded once, when the
#: segment is opened), the offset they were written at, the pieces written there in order.
Intent = tuple[bytes, int, Sequence[bytes | bytearray]]


class IntentLog:
    """A data directory's intent log, writer side; see the module docstring.

    `append` is called by the pass (the event loop's thread), `settle` by whoever is
    about to remove or replace a segment (a worker thread, too): a lock orders them, so
    a record appended while a settle runs lands after the log is emptied."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / INTENT_FILE
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._seed = 0
        #: what each record's head starts with: its crc (0 until the record is whole),
        #: the epoch's low 32 bits
        self._prefix = bytes(8)
        self._pos = 0  # where the next record goes (the head's end at first)
        self._allocated = 0  # the file's size: zeros from _pos on
        self._records = 0  # since the log was last begun
        self._unflushed = 0  # bytes appended since the last sync of the file system began
        self._flusher: threading.Thread | None = None  # that sync, on its thread
        self._grower: threading.Thread | None = None  # a step of zeros, on its thread
        self._grow_failed = False  # that step failed: the next one is a pass's (`_grow`)
        #: why the log is no longer used (a write or fsync of it failed); passes sync
        #: their files instead from then on, and settles still empty it
        self.failed: str | None = None
        self.appends = 0
        self.settles = 0

    @property
    def usable(self) -> bool:
        return self.failed is None

    @property
    def size(self) -> int:
        """Bytes of the log in use now (its head included)."""
        return self._pos

    def append(self, intents: Sequence[Intent]) -> None:
        """Make `intents` durable: written into the log and the log fdatasynced. OSError:
        nothing of `intents` may be taken as durable. After a full disk (the zeros that
        grow the file refused, and trimmed off) the log takes appends again; after any
        other failure (a failed fdatasync above all: the page cache may have dropped
        what it held) it takes none (`failed` says why). Settles the log first when it
        holds `SETTLE_BYTES`."""
        with self._lock:
            if self.failed is not None:
                raise OSError(f"intent log unusable: {self.failed}")
            if self._fd is None:
                self._begin()
            elif self._pos >= SETTLE_BYTES:
                self._settle()
            fd = self._fd
            assert fd is not None
            # every record of the pass in one buffer (its parts joined once), each crc
            # filled in once the buffer is whole
            parts: list[bytes | bytearray] = []
            ends: list[int] = []
            prefix = self._prefix
            total = 0
            for encoded, offset, pieces in intents:
                length = 0
                for piece in pieces:
                    length += len(piece)
                # (int.to_bytes is mypyc's own op where a struct's pack is a method call;
                # with the parts joined once rather than added to a bytearray one by one:
                # about 1,000 instructions fewer a record at fan-in, callgrind)
                parts.append(prefix + length.to_bytes(4, "big") + offset.to_bytes(8, "big")
                             + len(encoded).to_bytes(2, "big"))
                parts.append(encoded)
                parts += pieces
                total += RECORD_OVERHEAD + len(encoded) + length
                ends.append(total)
            out = bytearray().join(parts)  # (a bytearray: the crcs are packed into it)
            seed = self._seed
            start = 0
            with memoryview(out) as view:
                for end in ends:
                    _pack_crc(out, start, crc32(view[start + _CRC_SIZE : end], seed))
                    start = end
            if self._pos + total > self._allocated:
                self._join_grower()  # (a step it was writing may be enough)
                if self._pos + total > self._allocated:
                    self._grow(fd, self._pos + total)
            try:
                _pwrite_all(fd, out, self._pos)
            except OSError as exc:
                # (in place, over zeros: what part of it was written never checks)
                self._fail(f"write failed: {exc.strerror or exc}")
                raise
            try:
                fileio.fdatasync(fd)
            except OSError as exc:
                self._fail(f"fdatasync failed: {exc.strerror or exc}")
                raise
            self._pos += total
            self._records += len(intents)
            self.appends += 1
            self._unflushed += total
            if self._unflushed >= FLUSH_BYTES and not (
                    self._flusher is not None and self._flusher.is_alive()):
                self._unflushed = 0
                self._flusher = threading.Thread(target=self._flush, daemon=True,
                                                 name="queued-intent-flush")
                self._flusher.start()
            if (self._allocated - self._pos < GROW_AHEAD and self._allocated <= SETTLE_BYTES
                    and not self._grow_failed
                    and not (self._grower is not None and self._grower.is_alive())):
                # (up to the size a settle leaves it at: the next records reuse its blocks)
                self._grower = threading.Thread(
                    target=self._grow_ahead, args=(fd, self._allocated), daemon=True,
                    name="queued-intent-grow")
                self._grower.start()

    def _flush(self) -> None:
        """Write back the file system (the segments the log stands for with it) while
        passes go on: a settle then has little left to write. What it makes durable is
        not relied on (the log still stands for it until it settles); a failure is only
        logged: the settle's own sync meets it again and says so."""
        try:
            fileio.sync_all(self.directory)
        except OSError as exc:
            log.warning("intent log %s: syncing the file system ahead of a settle failed: "
                        "%s", self.path, exc.strerror or exc)

    def wait_flushed(self) -> None:
        """Wait for a sync that `_flush` began and a step that `_grow_ahead` is writing
        (before the log's file closes, and in tests)."""
        flusher = self._flusher
        if flusher is not None:
            flusher.join()
        self._join_grower()

    def _grow_ahead(self, fd: int, end: int) -> None:
        """`_grow`'s next step (zeros from `end`, the file's size, fsynced) on a thread
        of its own: a pass writes below `end` meanwhile, and one that needs the step
        joins this thread first. Only the step's completion is published (`_allocated`,
        once its zeros are durable); a failure is logged and trimmed off, and the pass
        that needs the room grows the file itself, meeting the failure as `_grow` says
        (no thread tries again before a pass's step succeeds: not one a pass on a full
        disk)."""
        target = end + GROW_BYTES
        try:
            _write_zeros(fd, end, target)
            fileio.fsync(fd)
        except OSError as exc:
            log.warning("intent log %s: growing it ahead failed: %s", self.path,
                        exc.strerror or exc)
            try:
                fileio.ftruncate(fd, end)
            except OSError as trim_exc:
                log.warning("intent log %s: trimming a step that failed: %s", self.path,
                            trim_exc.strerror or trim_exc)
            self._grow_failed = True
            return
        self._allocated = target

    def _join_grower(self) -> None:
        grower = self._grower
        if grower is not None:
            grower.join()
            self._grower = None

    def settle(self) -> None:
        """Make every file the log names durable and empty the log; nothing to do when it
        holds no record. OSError: not settled (what it names is still there to replay),
        so the caller must not remove or replace a segment."""
        with self._lock:
            if self._records:
                self._settle()

    def close(self) -> None:
        """Settle the log and remove its file (a clean shutdown); OSError if that fails
        (the log is kept: the next start replays it)."""
        self.wait_flushed()
        with self._lock:
            if self._records:
                self._settle()
            if self._fd is None:  # (none begun, or a failed log's settle removed it)
                return
            fileio.close(self._fd)
            self._fd = None
            fileio.unlink(self.path, missing_ok=True)
            fileio.fsync_dir(self.directory)

    def release(self) -> None:
        """Close the log's file as it is (after `close`, or when that failed: the next
        start replays what it holds)."""
        self.wait_flushed()
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                try:
                    fileio.close(fd)
                except OSError as exc:
                    log.error("intent log %s: closing: %s", self.path, exc)

    def _begin(self) -> None:
        """Create the log afresh: its head and GROW_BYTES of zeros, fsynced, and its
        directory entry durable. OSError: no log (after a full disk the next append
        tries again; after anything else none does)."""
        try:
            fd = fileio.open_fd(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as exc:
            if exc.errno not in RECOVERABLE_WRITE_ERRNOS:
                self._fail(f"cannot create it: {exc.strerror or exc}")
            raise
        head, epoch = _new_head()
        try:
            fileio.write_all(fd, head)
            self._allocated = len(head)
            self._grow(fd, len(head))
            fileio.fsync_dir(self.directory)
        except OSError as exc:
            fileio.close(fd)
            if self.failed is None and exc.errno not in RECOVERABLE_WRITE_ERRNOS:
                self._fail(f"cannot make it: {exc.strerror or exc}")
            raise
        self._fd = fd
        self._headed(head, epoch)

    def _headed(self, head: bytes, epoch: int) -> None:
        """`head` (of `epoch`) is the log's, durable: the next records go after it."""
        self._seed = crc32(head)
        self._prefix = bytes(_CRC_SIZE) + epoch.to_bytes(4, "big")
        self._pos = len(head)
        self._records = 0

    def _grow(self, fd: int, need: int) -> None:
        """Zeros from the file's end to past `need` (a GROW_BYTES step), fsynced: a
        record is then written over blocks the file has, and its fdatasync writes that
        data alone, where an append would write the file's new size too (half the time
        and CPU here: docs/benchmarks.md). A full disk trims the zeros off again."""
        end = self._allocated
        target = (need // GROW_BYTES + 1) * GROW_BYTES
        try:
            _write_zeros(fd, end, target)
            fileio.fsync(fd)
        except OSError as exc:
            try:
                fileio.ftruncate(fd, end)
            except OSError as trim_exc:
                self._fail(f"growing it failed ({exc.strerror or exc}) and could not be "
                           f"undone ({trim_exc.strerror or trim_exc})")
                raise exc from None
            if exc.errno not in RECOVERABLE_WRITE_ERRNOS:
                self._fail(f"growing it failed: {exc.strerror or exc}")
            raise
        self._allocated = target
        self._grow_failed = False

    def _settle(self) -> None:
        if self.failed is not None:
            self._settle_failed()
            return
        fd = self._fd
        assert fd is not None
        try:
            # Every file of the file system written back: those the log names with them.
            fileio.sync_all(self.directory)
            # A new epoch in the head: the records after it, of the one before, no
            # longer check (the file keeps its blocks for the next records).
            head, epoch = _new_head()
            fileio.pwrite(fd, head, 0)
            fileio.fdatasync(fd)
        except OSError as exc:
            self._fail(f"settling failed: {exc.strerror or exc}")
            raise
        self._headed(head, epoch)
        self._unflushed = 0
        self.settles += 1

    def _settle_failed(self) -> None:
        """Settle a log that takes no more passes: once the file system is synced, what
        it holds stands for nothing that is not durable, so its file is removed rather
        than given a new head (whose write or fdatasync may be what failed: a settle
        that kept failing so would keep every segment from being retired)."""
        fileio.sync_all(self.directory)
        self._join_grower()  # (before its file closes)
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                fileio.close(fd)
            except OSError as exc:
                log.warning("intent log %s: closing: %s", self.path, exc)
        fileio.unlink(self.path, missing_ok=True)
        fileio.fsync_dir(self.directory)
        self._records = 0
        self.settles += 1

    def _fail(self, why: str) -> None:
        if self.failed is None:
            log.error("intent log %s: %s; passes sync their files instead from now on",
                      self.path, why)
        self.failed = why


def _new_head() -> tuple[bytes, int]:
    """A head with a new random epoch, and the epoch's low 32 bits."""
    epoch = int.from_bytes(os.urandom(8), "big")
    return _HEAD.pack(MAGIC, epoch), epoch & 0xFFFFFFFF


def _write_zeros(fd: int, at: int, end: int) -> None:
    zeros = memoryview(bytes(min(end - at, ZERO_CHUNK)))
    while at < end:
        at += fileio.pwrite(fd, zeros[: min(len(zeros), end - at)], at)


def _pwrite_all(fd: int, data: bytearray, at: int) -> None:
    """Every byte of `data` from offset `at` (short writes finished)."""
    wrote = fileio.pwrite(fd, data, at)
    if wrote < len(data):
        with memoryview(data) as view:
            while wrote < len(data):
                wrote += fileio.pwrite(fd, view[wrote:], at + wrote)


def read_intents(data: bytes) -> list[tuple[str, int, memoryview]]:
    """The records of a log's content, in order, up to the first that does not check
    (or that names anything but a segment file)."""
    if len(data) < _HEAD.size or data[: len(MAGIC)] != MAGIC:
        return []
    seed = crc32(data[: _HEAD.size])
    epoch = _HEAD.unpack_from(data)[1] & 0xFFFFFFFF
    view = memoryview(data)
    records: list[tuple[str, int, memoryview]] = []
    pos = _HEAD.size
    while pos + RECORD_OVERHEAD <= len(data):
        (crc,) = _CRC.unpack_from(data, pos)
        record_epoch, length, offset, name_len = _FIXED.unpack_from(data, pos + _CRC_SIZE)
        start = pos + RECORD_OVERHEAD
        end = start + name_len + length
        if record_epoch != epoch or end > len(data):
            break
        if crc32(view[pos + _CRC_SIZE : end], seed) != crc:
            break
        try:
            name = bytes(view[start : start + name_len]).decode()
        except UnicodeDecodeError:
            break
        parsed = jf.parse_file_name(name)
        if parsed is None or parsed.role is not jf.FileRole.SEGMENT or "/" in name:
            break
        records.append((name, offset, view[start + name_len : end]))
        pos = end
    return records


def replay(directory: Path) -> tuple[int, int]:
    """At start-up, before any segment is read: every record of the log written into its
    file at its offset, those files fsynced (and the directory), then the log removed.
    A file that is missing is made again only from a record at offset 0 (the pass that
    created it); a record for another missing file is skipped with a warning (its file
    was removed behind the server's back). Returns (records written, bytes)."""
    path = directory / INTENT_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0, 0
    records = read_intents(data)
    fds: dict[str, int] = {}
    missing: set[str] = set()
    written = nbytes = 0
    try:
        for name, offset, payload in records:
            fd = fds.get(name)
            if fd is None:
                target = directory / name
                if name in missing or (offset and not target.exists()):
                    if name not in missing:
                        missing.add(name)
                        log.warning("intent log: %s is missing: its records from offset "
                                    "%d on are not written back", name, offset)
                    continue
                fd = fds[name] = fileio.open_fd(target, os.O_WRONLY | os.O_CREAT, 0o644)
            view = payload
            at = offset
            while view:
                wrote = fileio.pwrite(fd, view, at)
                view = view[wrote:]
                at += wrote
            written += 1
            nbytes += len(payload)
        for fd in fds.values():
            fileio.fsync(fd)
    finally:
        for fd in fds.values():
            fileio.close(fd)
    if fds:
        fileio.fsync_dir(directory)
    fileio.unlink(path)
    fileio.fsync_dir(directory)
    if records:
        log.info("intent log: %d records (%d bytes) written back into %d segment files",
                 written, nbytes, len(fds))
    return written, nbytes
