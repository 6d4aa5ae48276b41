"""`queued check DIR` (queued.cli.journal_tools): safe next to a running server, and still
exact on a damaged directory. (`queued dump` on each kind of record: test_storage_journal,
test_flags, test_delay, test_producers, test_headers.)

Exit codes: 0 healthy, 1 damage found, 2 usage error or cannot check. The live test runs
check over and over (bounded in count and time) while a real server subprocess writes,
rotates, checkpoints and compacts in that directory; the others build damaged or unfinished
segments with real files. `check`'s `pause` (its wait between two looks at an unfinished
tail) is where a test plays the writer, deterministically.
"""

from __future__ import annotations

import io
import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from journal_util import T0, segments
from server_util import HOST, QUEUED, WAIT, ServerProcess

from queued import cli
from queued.cli import check
from queued.client import Client
from queued.journal import format as jf
from queued.storage.opening import open_data_dir

#: Small segments and frequent checkpoints: files are created, grown, retired and
#: compacted all the time. fsync "never" keeps the writes coming without pauses.
LIVE_CONFIG = """\
[server]
checkpoint_interval = "50ms"

[default]
journal_size = "4MiB"
fsync = "never"
"""
NEGATIVE = re.compile(r"-\d")
#: Bounds of the live test: check runs for LIVE_SECONDS (at most LIVE_RUNS runs), and at
#: least MIN_RUNS times however slow the machine (but never past MAX_SECONDS).
LIVE_RUNS, LIVE_SECONDS, MIN_RUNS, MAX_SECONDS = 2000, 3.0, 20, 60.0


def queued(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(QUEUED), *args], capture_output=True, text=True,
                          timeout=WAIT * 3, check=False)


def _load(port: int, queue: str, stop: threading.Event, errors: list[BaseException],
          puts: list[int]) -> None:
    """Put 50 items of 3000 bytes, take 40 and confirm them, until `stop`."""
    try:
        with Client(f"{HOST}:{port}", connect_timeout=WAIT, read_timeout=WAIT) as c:
            while not stop.is_set():
                puts[0] += c.put(queue, [b"x" * 3000] * 50)
                c.confirm(c.get(queue, 40, 0, 30_000))
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def test_check_next_to_a_live_server_never_reports_damage(tmp_path: Path) -> None:
    conf = tmp_path / "queued.toml"
    conf.write_text(LIVE_CONFIG)
    data = tmp_path / "data"
    server = ServerProcess(data, tmp_path / "server.log", config=conf)
    stop = threading.Event()
    errors: list[BaseException] = []
    puts = [0]
    threads: list[threading.Thread] = []
    runs = 0
    try:
        server.start()
        threads = [threading.Thread(target=_load, args=(server.rpc, f"live{i}", stop, errors,
                                                        puts)) for i in range(2)]
        for t in threads:
            t.start()
        started = time.monotonic()
        while not errors and runs < LIVE_RUNS and (
                time.monotonic() - started < (LIVE_SECONDS if runs >= MIN_RUNS else MAX_SECONDS)):
            out = io.StringIO()
            code = check(data, out)
            text = out.getvalue()
            assert code == 0, text
            assert "BAD" not in text and not NEGATIVE.search(text), text
            runs += 1
        for _ in range(2):  # the command line too, exit code included
            r = queued("check", str(data))
            assert r.returncode == 0, r.stdout + r.stderr
            assert "BAD" not in r.stdout and not NEGATIVE.search(r.stdout), r.stdout
    finally:
        stop.set()
        for t in threads:
            t.join(WAIT)
        server.kill()
    assert not errors, errors
    assert runs >= MIN_RUNS and puts[0] > 0, (runs, puts)
    # Stopped, the directory is healthy (SIGKILL may leave a torn tail: recovery's to cut,
    # and check's to report, which the tests below cover).


async def _torn_segment(tmp_path: Path, cut: int = 7) -> tuple[Path, bytes]:
    """Queue "q" with two one-item batches; the second batch's last `cut` bytes are
    taken off. Returns the segment and the bytes cut."""
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        await q.append([b"first" * 20], T0)
        await q.append([b"second" * 20], T0)
    seg = segments(tmp_path)[0]
    whole = seg.read_bytes()
    seg.write_bytes(whole[:-cut])
    return seg, whole[-cut:]


def _append(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


async def test_unfinished_batch_that_completes_while_checked_is_not_damage(
    tmp_path: Path,
) -> None:
    seg, rest = await _torn_segment(tmp_path)
    pauses: list[float] = []

    def writer_finishes(seconds: float) -> None:  # the server completes its write meanwhile
        pauses.append(seconds)
        if len(pauses) == 1:
            _append(seg, rest)

    out = io.StringIO()
    assert check(tmp_path, out, pause=writer_finishes) == 0, out.getvalue()
    assert len(pauses) == 1
    assert f"ok    {seg.name}: 2 items" in out.getvalue()


async def test_tail_that_keeps_growing_is_busy_not_damage(tmp_path: Path) -> None:
    seg, _ = await _torn_segment(tmp_path)
    garbage_growing: Callable[[float], None] = lambda _s: _append(seg, b"\x86")  # noqa: E731
    out = io.StringIO()
    assert check(tmp_path, out, pause=garbage_growing) == 0, out.getvalue()
    text = out.getvalue()
    assert f"busy  {seg.name}: a batch is being written at offset" in text, text
    assert "a running server is using it): 1 segments were being written" in text


async def test_file_removed_while_checked_is_skipped(tmp_path: Path) -> None:
    seg, _ = await _torn_segment(tmp_path)
    out = io.StringIO()
    assert check(tmp_path, out, pause=lambda _s: seg.unlink(missing_ok=True)) == 0
    assert f"gone  {seg.name}: removed while checking" in out.getvalue()


async def test_torn_tail_that_stays_is_damage_with_its_positive_size(tmp_path: Path) -> None:
    seg, rest = await _torn_segment(tmp_path)
    pauses: list[float] = []
    out = io.StringIO()
    assert check(tmp_path, out, pause=pauses.append) == 1
    assert len(pauses) == cli.CHECK_STABLE_LOOKS  # looked again, nothing moved
    size = seg.stat().st_size
    good = size - (jf.PUT_HEADER_SIZE + len(b"second" * 20) + jf.CHECK_RECORD_SIZE - len(rest))
    assert (f"BAD   {seg.name}: torn tail: an unfinished batch at offset {good}; recovery cuts "
            f"{size - good} bytes at offset {good}") in out.getvalue()
    r = queued("check", str(tmp_path))  # the command line: exit 1, the same report
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"recovery cuts {size - good} bytes" in r.stdout


async def test_corruption_in_the_middle_exits_1(tmp_path: Path) -> None:
    seg, rest = await _torn_segment(tmp_path)
    _append(seg, rest)
    data = bytearray(seg.read_bytes())
    data[jf.MAGIC_SIZE + jf.CHECK_RECORD_SIZE + jf.PUT_HEADER_SIZE + 3] ^= 0xFF  # batch 1
    seg.write_bytes(bytes(data))
    r = queued("check", str(tmp_path))
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"BAD   {seg.name}: CORRUPT at offset" in r.stdout


def test_exit_2_for_usage_errors_and_directories_that_cannot_be_checked(
    tmp_path: Path,
) -> None:
    r = queued("check")
    assert r.returncode == 2 and "usage: queued check" in r.stderr, r.stderr
    r = queued("check", str(tmp_path / "missing"))
    assert r.returncode == 2 and "is not a directory" in r.stderr, r.stderr
    (tmp_path / "file").write_text("x")
    r = queued("check", str(tmp_path / "file"))
    assert r.returncode == 2, r.stderr
    r = queued("check", "--help")
    assert r.returncode == 0
    assert "0 healthy; 1 damage found; 2 usage error" in " ".join(r.stdout.split())
