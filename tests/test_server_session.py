"""The one session (queued.server.session): every protocol through one core.

Real servers on 127.0.0.1 port 0 for the socket behaviours (half-close, hang-ups), and a
session's synchronous core fed by hand over a real socket pair.
"""

from __future__ import annotations

import io
import logging
import socket
import struct
from pathlib import Path

import msgpack
import pytest
import trio
import trio.testing
from server_util import WAIT, Conn, make_config, running
from wait_util import wait_until

from queued import __version__
from queued.broker.broker import Broker
from queued.broker.upkeep import open_broker
from queued.config import ServerConfig
from queued.server.listeners import Server
from queued.server.session import Session
from queued.server.task_base import ServerCounters
from queued.server.transport import SocketTransport
from queued.stats import ProtocolStats
from queued.wire import commands as c
from queued.wire.memcache_commands import MemcacheCodec
from queued.wire.rpc_commands import RpcCodec
from queued.wire.text_commands import TextCodec


async def read_to_eof(conn: Conn) -> bytes:
    """Everything the server sends until it closes the connection."""
    return await conn.expect_closed()


# -- D1: every complete command sent before a FIN gets its reply ------------------------------


@pytest.mark.parametrize(("proto", "request_bytes", "reply"), [
    ("memcache", b"get a/t=300\r\nget a/t=300\r\nversion\r\n",
     b"END\r\nEND\r\nVERSION %s\r\n" % __version__.encode()),
    ("text", b"get a 300\nget a 300\nversion\n",
     b"*\n*\n:%s\n" % __version__.encode()),
])
async def test_pipelined_long_polls_then_half_close_answer_every_command(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, proto: str, request_bytes: bytes,
    reply: bytes,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with running(make_config(tmp_path / "data")) as server:
        conn = await Conn.open(server.ports[proto])
        await conn.send(request_bytes)
        await conn.stream.send_eof()  # shutdown(SHUT_WR): the client still reads
        assert await read_to_eof(conn) == reply
        await conn.aclose()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


async def test_rpc_calls_before_a_half_close_are_answered(tmp_path: Path) -> None:
    """A get waiting in a task of its own is answered (empty) when the peer ends its side,
    as a long poll is on the other protocols; its item stays queued."""
    async with running(make_config(tmp_path / "data")) as server:
        conn = await Conn.open(server.ports["rpc"])
        await conn.send(msgpack.packb([0, 1, "put", ["q", [b"x"]]])
                        + msgpack.packb([0, 3, "get", ["empty", 1, 60_000]])
                        + msgpack.packb([0, 2, "version", []]))
        await wait_until(lambda: server.broker.reader_info("empty").get("waiters") == 1)
        await conn.stream.send_eof()
        with trio.fail_after(WAIT / 2):  # well before the get's own 60 s
            replies = list(msgpack.Unpacker(io.BytesIO(await read_to_eof(conn))))
        assert sorted(replies) == [[1, 1, None, 1], [1, 2, None, __version__], [1, 3, None, []]]
        await conn.aclose()


@pytest.mark.parametrize(("proto", "line"), [
    ("memcache", b"get q/t=10000\r\n"), ("text", b"get q 10000\n"),
])
async def test_hang_up_during_a_long_poll_is_an_ordinary_event(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, proto: str, line: bytes,
) -> None:
    """A client that disconnects while its get waits: debug log, no traceback, and the
    item put afterwards is not taken by the dead connection."""
    caplog.set_level(logging.DEBUG)
    async with running(make_config(tmp_path / "data")) as server:
        conn = await Conn.open(server.ports[proto])
        await conn.send(line)
        await wait_until(lambda: server.broker.queue_stats() != []
                         and server.broker.reader_info("q").get("waiters") == 1)
        # SO_LINGER 0: the close sends RST, not FIN (the rudest hang-up)
        conn.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                      struct.pack("ii", 1, 0))
        await conn.stream.aclose()
        await wait_until(lambda: not server.connections())
        other = await Conn.open(server.ports["memcache"])
        assert await other.set("q", b"item") == b"STORED"
        assert await other.get("q") == b"item"
        await other.aclose()
    assert "session failed" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


@pytest.mark.parametrize(("proto", "line"), [
    ("memcache", b"monitor m 20\r\n"), ("text", b"monitor m 20000\n"),
])
async def test_a_monitor_stops_taking_items_once_its_peer_is_lost(
    tmp_path: Path, proto: str, line: bytes,
) -> None:
    """Once a send fails the monitor ends: it must not go on taking (and, at the hang-up,
    returning with an error count) the rest of the queue."""
    toml = '[queues.m]\nerror_queue = "merr"\nmax_errors = 1\n'
    async with running(make_config(tmp_path / "data", toml, fsync="never")) as server:
        port = server.ports[proto]
        producer = await Conn.open(server.ports["memcache"])
        for _ in range(300):
            assert await producer.set("m", b"x" * 30_000) == b"STORED"
        conn = await Conn.open(port)
        await conn.send(line)
        await conn.exactly(100)
        conn.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                      struct.pack("ii", 1, 0))
        await conn.stream.aclose()
        await wait_until(lambda: server.connections() <= 1)
        # What the dead monitor held went back (with an error count: to merr); the rest
        # of the queue was never taken.
        await wait_until(lambda: server.broker.reader_info("merr").get("items", 0)
                         + server.broker.reader_info("m")["items"] >= 300)
        moved = server.broker.reader_info("merr").get("items", 0)
        assert moved < 150, moved
        await producer.aclose()


# -- the reactor's synchronous core ---------------------------------------------------------------


def core_session(broker: Broker, config: ServerConfig,
                 codec: type[MemcacheCodec | TextCodec | RpcCodec], stats: ProtocolStats,
                 ) -> Session:
    """A Session speaking `codec` over one end of a socket pair, its reads registered
    with the broker, for its synchronous core to be fed by hand (no reactor runs it)."""
    ours, _ = trio.socket.socketpair()
    stream = trio.SocketStream(ours)
    limits = c.Limits(config.max_line, config.max_item_size, config.rpc_max_frame,
                      config.rpc_max_batch)
    session = Session(Server(broker, config), broker, stream, codec(limits), name="core",
                      max_item_size=config.max_item_size, counters=ServerCounters(),
                      stats=stats, transport=SocketTransport(stream))
    broker.register(session.reads)
    return session


@pytest.mark.parametrize(("codec", "touch", "reply", "refused"), [
    (MemcacheCodec, b"touch q 5000\r\n", b"TOUCHED\r\n", b"touch none 5000\r\n"),
    (TextCodec, b"touch q 5000\n", b"+1\n", b"touch none 5000\n"),
    (RpcCodec, msgpack.packb([0, 3, "extend", ["q", [1], 5000]]),
     msgpack.packb([1, 3, None, 1]), msgpack.packb([0, 4, "extend", ["q", [99], 5000]])),
])
async def test_touch_and_extend_run_in_the_pass_without_a_hand_off(
    tmp_path: Path, codec: type[MemcacheCodec | TextCodec | RpcCodec], touch: bytes,
    reply: bytes, refused: bytes,
) -> None:
    """A lease extension needs no wait: `run_nowait` answers it in the reactor's pass (it
    returns past it), as it does a confirm, instead of handing the connection to its task;
    the read's deadline moves. One it cannot do is answered there too, with its error."""
    config = make_config(tmp_path / "data", fsync="never")
    async with open_broker(config) as broker:
        session = core_session(broker, config, codec, ProtocolStats())
        await broker.put("q", [b"job"])
        item = await broker.get("q", client=session.reads, open=True,
                                open_timeout_ms=1000)
        assert item is not None and item.id == 1
        before = session.reads.open[("q", "")][1]
        assert before is not None and before <= trio.current_time() + 1.0
        session.codec.receive_data(touch + refused)
        requests = session.codec.next_requests(10)
        assert len(requests) == 2
        assert session.run_nowait(requests) == 2  # both ran: nothing left for the task
        out = bytes(session.out)
        assert out.startswith(reply)
        after = session.reads.open[("q", "")][1]
        assert after is not None and after >= trio.current_time() + 4.9
        rest = out[len(reply):]
        if codec is RpcCodec:
            [kind, msgid, error, _] = msgpack.unpackb(rest)
            assert (kind, msgid) == (1, 4) and error[0] == 17  # NOT_OPEN
        else:
            assert rest in (b"NOT_FOUND\r\n", b"+0\n")
        assert not session.done and session.reads.open_total == 1
