"""Honest start-up and shutdown on a data directory that cannot be written.

Real unwritable directories, no mocks: a tmpfs mounted read-only, and a directory made
immutable with `chattr +i` (root ignores mode bits, but not these). Each skips with the
reason where this machine cannot make one. The server runs as a subprocess: start-up
must refuse before it opens any port, and a stop that could not write its checkpoints
must say which, not "stopped cleanly".
"""

from __future__ import annotations

import errno
import logging
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from ops_util import get, put
from server_util import HOST, QUEUED, WAIT, ServerProcess, make_config, running

from queued.client import Client
from queued.config import FsyncPolicy, JournalConfig
from queued.errors import NotSavedError
from queued.storage import fileio
from queued.storage.files import PROBE_NAME, probe_writable
from queued.storage.opening import open_data_dir

T0 = 1_700_000_000_000


def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)


@pytest.fixture
def read_only_mount(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs mounted read-only (needs root)."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    done = run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)])
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        if run(["umount", str(mnt)]).returncode != 0:
            run(["umount", "-l", str(mnt)])


def make_immutable(path: Path) -> None:
    """chattr +i: no file can be created in `path`, by root either."""
    try:
        done = run(["chattr", "+i", str(path)])
    except OSError as exc:
        pytest.skip(f"no chattr here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot make a directory immutable here: {done.stderr.strip()}")


def make_mutable(path: Path) -> None:
    run(["chattr", "-i", str(path)])


@pytest.fixture
def immutable_dir(tmp_path: Path) -> Iterator[Path]:
    data = tmp_path / "data"
    data.mkdir()
    make_immutable(data)
    try:
        yield data
    finally:
        make_mutable(data)


def serve_until_exit(data: Path) -> tuple[int, str]:
    """`queued serve` on `data`; (exit code, log). A server that keeps running is a
    failure of the test (it was meant to refuse), not a hang: it is killed."""
    proc = subprocess.Popen(
        [str(QUEUED), "serve", "--data-dir", str(data), "--host", HOST, "--memcache-port", "0",
         "--text-port", "0", "--rpc-port", "0", "--http-port", "0"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, log = proc.communicate(timeout=WAIT * 2)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, log = proc.communicate(timeout=WAIT)
        raise AssertionError(
            f"the server did not refuse an unwritable data dir:\n{log}") from None
    return proc.returncode, log


@pytest.mark.parametrize("kind", ["read-only mount", "immutable directory"])
def test_start_up_refuses_an_unwritable_data_dir_before_any_listener(
    kind: str, request: pytest.FixtureRequest
) -> None:
    data: Path = request.getfixturevalue(
        "read_only_mount" if kind == "read-only mount" else "immutable_dir")
    code, log = serve_until_exit(data)
    why = "Read-only file system" if kind == "read-only mount" else "Operation not permitted"
    assert code == 1, log
    assert (f"ERROR queued: cannot start: data dir {data} is not writable: cannot create "
            f"{PROBE_NAME}: {why}") in log, log
    assert "listening for" not in log and "ready" not in log, log


def test_probe_makes_a_missing_dir_and_leaves_nothing(tmp_path: Path) -> None:
    data = tmp_path / "a" / "b"
    probe_writable(data)
    assert data.is_dir() and list(data.iterdir()) == []


def test_shutdown_says_which_checkpoints_it_could_not_write(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = ServerProcess(data, tmp_path / "server.log")
    immutable = False
    try:
        server.start()
        with Client(f"{HOST}:{server.rpc}", connect_timeout=WAIT, read_timeout=WAIT) as c:
            for queue in ("alpha", "beta+audit", "beta"):
                c.get(queue, 1)  # creates the queue and the reader
            c.put("alpha", [b"1", b"2"])
            c.put("beta", [b"1", b"2"])
            assert [i.data for i in c.get("alpha", 1)] == [b"1"]
            assert [i.data for i in c.get("beta+audit", 2)] == [b"1", b"2"]
        make_immutable(data)  # from now on no checkpoint can be written (a new file)
        immutable = True
        server.signal(signal.SIGTERM)
        code = server.wait(WAIT * 2)
    finally:
        if immutable:
            make_mutable(data)
        server.kill()
    log = server.log().decode()
    assert code == 1, log
    assert "stopped cleanly" not in log, log
    failed = ("checkpoint not written (Operation not permitted); what it read since its last "
              "checkpoint will be delivered again")
    assert ("ERROR queued: stopped, but could not save everything:\n"
            f"  - queue alpha, default reader: {failed}\n"
            f"  - queue beta, default reader: {failed}\n"
            f"  - queue beta, reader audit: {failed}\n") in log, log


class FsyncFails(fileio.FileIO):
    """The storage layer's file calls (queued.storage.fileio), but every fsync fails (as
    on a disk that went bad; the checkpoint tests above use real unwritable dirs)."""

    def fsync(self, fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")


async def test_journals_that_cannot_be_closed_are_each_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    never = JournalConfig(fsync=FsyncPolicy.parse("never"))  # puts leave unsynced bytes
    monkeypatch.setattr(logging.getLogger("queued.datadir"), "disabled", True)
    with pytest.raises(NotSavedError) as caught:
        async with open_data_dir(tmp_path, queue_config=lambda _: never) as dd:
            for name in ("q1", "q2"):
                await dd.queue(name).append([b"x"], T0)
            monkeypatch.setattr(fileio, "_current", FsyncFails())
    then = "; what it wrote since its last fsync may be lost"
    assert caught.value.unsaved == [
        f"queue q1: journal not fsynced and closed (Input/output error){then}",
        f"queue q2: journal not fsynced and closed (Input/output error){then}",
    ]


async def test_readyz_probes_with_a_real_write_not_a_mode_bit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A data dir that stops taking writes while the server runs (made immutable: root's
    mode bits would still say writable) makes /readyz say so after the next probe, and
    ready again once it takes writes."""
    data = tmp_path / "data"
    async with running(make_config(data)) as server:
        await put(server, "jobs", b"a")
        port = server.ports["http"]
        assert (await get(port, "/readyz"))[0] == 200
        make_immutable(data)
        try:
            with caplog.at_level(logging.INFO, logger="queued.server"):
                await server.probe_data_dir()
                status, _, body = await get(port, "/readyz")
                assert status == 503
                assert f"data dir {data} is not writable: cannot create {PROBE_NAME}".encode() \
                    in body and b"Operation not permitted" in body
                assert not (data / PROBE_NAME).exists()
        finally:
            make_mutable(data)
        with caplog.at_level(logging.INFO, logger="queued.server"):
            await server.probe_data_dir()
        assert (await get(port, "/readyz"))[0] == 200
        events = [getattr(r, "event", None) for r in caplog.records]
        assert events.count("data_dir_unwritable") == 1 and "data_dir_writable" in events
