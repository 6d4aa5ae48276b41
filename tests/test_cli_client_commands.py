"""The `queued` client subcommands (queued.cli.client_commands, with the options and exit
codes of queued.cli.client_options), run as subprocesses against a real server subprocess.

One server serves the module (each test uses its own queue names); every command has a
timeout and the server is killed by PID at the end. Checks output, exit codes (0 ok,
1 error reply, 2 usage, 3 cannot connect) and that the progress bar is shown only on a
terminal.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_util import HOST, QUEUED, WAIT, ServerProcess
from wait_util import wait_until_blocking

from queued.client import Client


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base = tmp_path_factory.mktemp("cli")
    proc = ServerProcess(base / "data", base / "server.log")
    try:
        proc.start()
        yield f"{HOST}:{proc.rpc}"
    finally:
        proc.kill()


def queued(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([str(QUEUED), *args], input=stdin, capture_output=True,
                          timeout=WAIT * 2, check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def test_put_args_then_get(server: str) -> None:
    r = queued("put", "--server", server, "args", "a", "b b", "c")
    assert (r.returncode, r.stderr) == (0, b"stored 3 items\n")
    r = queued("get", "--server", server, "args", "-n", "2")
    assert (r.returncode, r.stdout) == (0, b"a\nb b\n")
    r = queued("get", "--server", server, "args", "-n", "5")
    assert (r.returncode, r.stdout) == (0, b"c\n")
    r = queued("get", "--server", server, "args")  # empty: nothing, still ok
    assert (r.returncode, r.stdout) == (0, b"")


def test_put_from_stdin_and_get_many(server: str) -> None:
    lines = [b"line %d" % i for i in range(10_000)]
    r = queued("put", "--server", server, "stdin", stdin=b"\n".join(lines) + b"\n")
    assert (r.returncode, r.stderr) == (0, b"stored 10000 items\n")  # no bar: not a tty
    with Client(server) as c:
        assert c.peek("stdin").items == 10_000
    r = queued("get", "--server", server, "stdin", "-n", "10000")
    assert r.returncode == 0 and r.stderr == b""
    assert r.stdout.split(b"\n")[:-1] == lines


def test_binary_items_round_trip(server: str) -> None:
    data = bytes(range(256)).replace(b"\n", b"")
    r = queued("put", "--server", server, "bin", stdin=data + b"\n" + b"\x00\xff\n")
    assert r.returncode == 0
    r = queued("get", "--server", server, "bin", "-n", "2")
    assert r.stdout == data + b"\n" + b"\x00\xff\n"


def test_get_open_confirms_after_writing(server: str) -> None:
    queued("put", "--server", server, "open", "x", "y")
    r = queued("get", "--server", server, "open", "-n", "2", "--open")
    assert (r.returncode, r.stdout) == (0, b"x\ny\n")
    with Client(server) as c:
        info = c.peek("open")
        assert (info.items, info.open_transactions) == (0, 0)


def to_closed_pipe(*args: str) -> subprocess.CompletedProcess[bytes]:
    """Run `queued ARGS` with a stdout whose reader is gone (as after `| head -3`)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody reads: the first write fails (EPIPE)
    try:
        return subprocess.run([str(QUEUED), *args], stdout=write_end, stderr=subprocess.PIPE,
                              timeout=WAIT * 2, check=False)
    finally:
        os.close(write_end)


def test_get_open_returns_items_when_stdout_fails(server: str) -> None:
    queued("put", "--server", server, "gone", "p", "q")
    r = to_closed_pipe("get", "--server", server, "gone", "-n", "2", "--open")
    assert (r.returncode, r.stderr) == (0, b"")  # nothing lost: a quiet exit, as `| head`
    # not confirmed: back in the queue once the client is gone
    assert settled(server, "gone") == (2, 0)


def settled(server: str, queue: str) -> tuple[int, int]:
    """(items, open reads) of `queue` once the open reads of a client that is gone are back."""
    with Client(server) as c:
        wait_until_blocking(lambda: not c.peek(queue).open_transactions)
        info = c.peek(queue)
        return info.items, info.open_transactions


def test_plain_get_returns_items_when_stdout_fails(server: str) -> None:
    queued("put", "--server", server, "notlost", "p", "q")
    r = to_closed_pipe("get", "--server", server, "notlost", "-n", "2")
    assert (r.returncode, r.stderr) == (0, b"")
    assert settled(server, "notlost") == (2, 0)


def test_get_into_a_reader_that_stops_early_takes_only_what_it_read(server: str) -> None:
    # `queued get q -n 3000 | head -1`: head reads one line and exits; the other 2,999 stay.
    lines = [b"item %04d" % i for i in range(3000)]
    assert queued("put", "--server", server, "early", stdin=b"\n".join(lines) + b"\n"
                  ).returncode == 0
    get = subprocess.Popen([str(QUEUED), "get", "--server", server, "early", "-n", "3000"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert get.stdout is not None and get.stderr is not None
    head = subprocess.Popen(["head", "-1"], stdin=get.stdout, stdout=subprocess.PIPE)
    get.stdout.close()  # head holds the only read end: when it exits, the pipe's reader is gone
    try:
        out, _ = head.communicate(timeout=WAIT * 2)
        assert get.wait(WAIT * 2) == 0
        assert get.stderr.read() == b""
    finally:
        get.kill()
        head.kill()
        get.stderr.close()
    assert out == b"item 0000\n"
    assert settled(server, "early") == (2999, 0)
    r = queued("get", "--server", server, "early", "-n", "2")  # the order is kept
    assert r.stdout == b"item 0001\nitem 0002\n"


def test_closed_stdout_is_a_quiet_exit_0(server: str, tmp_path: Path) -> None:
    # `queued peek q | head -3`: the reader has what it wanted; no "stdout closed", exit 0.
    queued("put", "--server", server, "piped", "x")
    for args in (["peek", "--server", server, "piped"], ["stats", "--server", server],
                 ["check", str(tmp_path)]):
        r = to_closed_pipe(*args)
        assert (r.returncode, r.stderr) == (0, b""), (args, r)
    # ... but check's exit code still says what it found
    (tmp_path / "q.1").write_bytes(b"garbage!")
    r = to_closed_pipe("check", str(tmp_path))
    assert (r.returncode, r.stderr) == (1, b""), r


def test_argument_errors_name_the_argument_and_the_rule() -> None:
    for args, want in (
        (["get", "q", "-n", "abc"], b"queued get: error: argument -n: 'abc' is not a whole "
                                    b"number, 1 or more\n"),
        (["get", "q", "-n", "0"], b"queued get: error: argument -n: 0 is too small: it must be "
                                  b"a whole number, 1 or more\n"),
        (["put", "q", "--expiration", "1.5"], b"queued put: error: argument --expiration: "
                                              b"'1.5' is not a whole number, 0 or more\n"),
    ):
        r = queued(*args)
        assert r.returncode == 2 and r.stderr.endswith(want), (args, r.stderr)
        assert r.stderr.startswith(b"usage: queued %s " % args[0].encode()), r.stderr


def test_a_subcommand_mistake_prints_the_subcommand_usage() -> None:
    r = queued("serve", "--memcache-prot", "1")
    assert r.returncode == 2
    assert r.stderr.startswith(b"usage: queued serve [-h]"), r.stderr
    assert r.stderr.endswith(b"queued serve: error: unrecognized arguments: --memcache-prot "
                             b"(did you mean --memcache-port?) 1\n"), r.stderr
    r = queued("peek", "q", "--bogus")
    assert r.returncode == 2 and r.stderr.startswith(b"usage: queued peek "), r.stderr
    assert r.stderr.endswith(b"queued peek: error: unrecognized arguments: --bogus\n")
    r = queued("--bogus", "peek", "q")  # before the subcommand: the top level's mistake
    assert r.returncode == 2 and r.stderr.startswith(b"usage: queued [-h]"), r.stderr


def test_get_timeout_waits(server: str) -> None:
    started = time.monotonic()
    r = queued("get", "--server", server, "empty", "--timeout", "300")
    assert (r.returncode, r.stdout) == (0, b"")
    assert time.monotonic() - started >= 0.3


def test_peek_stats_flush_delete(server: str) -> None:
    queued("put", "--server", server, "misc", "head-item", "second")
    r = queued("peek", "--server", server, "misc")
    assert r.returncode == 0
    out = r.stdout.decode()
    assert "items: 2\n" in out and "data=b'head-item'" in out

    r = queued("stats", "--server", server, "--json")
    assert r.returncode == 0
    stats = json.loads(r.stdout)
    assert stats[server]["queues"]["misc"]["items"] == 2
    r = queued("stats", "--server", server)
    assert r.returncode == 0
    table = r.stdout.decode()
    assert f"== {server}" in table
    assert any(line.split()[:2] == ["misc", "2"] for line in table.splitlines())

    r = queued("flush", "--server", server, "misc")
    assert (r.returncode, r.stdout) == (0, b"flushed 2 items\n")
    r = queued("delete", "--server", server, "misc")
    assert (r.returncode, r.stdout) == (0, b"deleted\n")
    r = queued("delete", "--server", server, "misc")
    assert (r.returncode, r.stdout) == (0, b"no such queue\n")


def test_exit_codes(server: str) -> None:
    nobody = f"{HOST}:{free_port()}"
    r = queued("peek", "--server", nobody, "q")
    assert r.returncode == 3 and b"cannot connect" in r.stderr
    r = queued("put", "--server", server, "bad name", "x")
    assert r.returncode == 1 and b"BAD_QUEUE_NAME" in r.stderr
    r = queued("get", "--server", "host:notaport", "q")
    assert r.returncode == 2
    r = queued("get", "--server", server)  # no queue
    assert r.returncode == 2
    r = queued("get", "--help")
    assert r.returncode == 0 and b"exit codes: 0 ok" in r.stdout and b"--open" in r.stdout


def test_several_servers_skip_one_that_is_down(server: str) -> None:
    nobody = f"{HOST}:{free_port()}"
    r = queued("put", "--server", f"{nobody},{server}", "multi", "a", "b")
    assert r.returncode == 0
    r = queued("get", "--server", nobody, "--server", server, "multi", "-n", "2")
    assert (r.returncode, r.stdout) == (0, b"a\nb\n")


def test_progress_bar_only_on_a_terminal(server: str) -> None:
    main, child = os.openpty()
    proc = subprocess.Popen([str(QUEUED), "put", "--server", server, "tty"],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=child)
    os.close(child)
    try:
        assert proc.stdin is not None
        proc.stdin.write(b"x\n" * 2000)
        proc.stdin.flush()
        time.sleep(0.7)  # real time is the point: the bar shows after 0.5 s
        proc.stdin.write(b"y\n" * 2000)
        proc.stdin.close()
        assert proc.wait(WAIT) == 0
        shown = b""
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the child's side is closed
                break
            if not chunk:
                break
            shown += chunk
    finally:
        proc.kill()
        os.close(main)
    assert b"item" in shown and b"stored 4000 items" in shown
