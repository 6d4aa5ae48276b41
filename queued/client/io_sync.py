"""The blocking side of the clients' I/O: one socket per server, one call at a time on it.

The generated `Client` (queued.client.sync) is written against these names; io_trio has
the same names for `AsyncClient`. Owns sockets, timeouts and the lock that serializes a
Client's calls; never chooses servers or fails over (that is the client's, in aio.py).
"""

from __future__ import annotations

import concurrent.futures
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from queued.client.common import (
    ClientError,
    ConnectionFailed,
    call_error,
)
from queued.client.credentials import TlsChannel, handshake_failure
from queued.client.framing import RECV, ClientConnection, closes
from queued.client.servers import ServerState
from queued.wire.rpc_protocol import Response

Lock = threading.Lock
TableLock = threading.Lock  # (see io_trio)
now = time.monotonic
sleep = time.sleep


def call_gate() -> AbstractContextManager[Any]:
    """Serializes a Client's calls: threads may share one, a long-polling get holds the rest."""
    return threading.RLock()


def checkpoint() -> None:
    """Blocking code has no other task to let run."""


def wait_for(lookups: Collection[concurrent.futures.Future[Any]],
             patience: float | None) -> None:
    """Until every look-up (discovery.resolve_soon) is done, or `patience` seconds (None:
    no limit) have passed."""
    concurrent.futures.wait(lookups, patience)


@contextmanager
def repeating(interval: float, fn: Callable[..., None], *args: Any) -> Iterator[None]:
    """Call `fn(*args)` every `interval` seconds while the body runs (a daemon thread;
    the Client's gate serializes its calls with the body's), at the multiples of
    `interval` on the monotonic clock: loops with the same interval fall due together
    (the first call comes within `interval`, not after exactly that)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval - time.monotonic() % interval):
            fn(*args)

    thread = threading.Thread(target=loop, name="queued-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextmanager
def shielded(timeout: float) -> Iterator[None]:
    """Nothing cancels blocking code; each call is bounded by its own read timeout."""
    yield


class Network:
    """Opens a Client's connections (TLS ones with `tls`); there are no reader tasks: a call
    reads its own reply."""

    def __init__(self, tls: ssl.SSLContext | None) -> None:
        self._tls = tls

    def open(self, closed: bool) -> None:
        """A blocking Client needs no `with`, and may enter one even after close()."""

    def close(self) -> None:
        pass

    def connect(self, server: ServerState, timeout: float, max_frame: int,
                max_batch: int) -> Connection:
        return Connection(server, timeout, max_frame, max_batch, self._tls)


class Connection(ClientConnection):
    """One socket (TCP, or TLS over it): one request at a time, replies matched by msgid."""

    def __init__(self, server: ServerState, connect_timeout: float, max_frame: int,
                 max_batch: int, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(server.address, max_frame, max_batch, tls=tls is not None)
        deadline = time.monotonic() + connect_timeout
        try:
            sock = socket.create_connection((server.host, server.port), connect_timeout)
        except OSError as exc:  # refused, unreachable, timed out, name not found
            raise ConnectionFailed(f"{server.address}: cannot connect: {exc}",
                                   server.address) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.tcp = sock
        self.sock = sock if tls is None else _handshake(sock, tls, server, deadline)

    #: A blocking connection holds no call between calls (the client's gate serializes them).
    busy = False

    def close(self, error: ClientError) -> None:
        self.end(error)
        self.sock.close()

    def _still_open(self) -> None:
        """ConnectionFailed if the server closed (or reset) this idle connection before
        this call: then nothing sent now can reach it (the trio client's reader task
        notices the same by itself)."""
        try:
            if not select.select([self.tcp], [], [], 0)[0]:
                return  # (nothing to read: open; a recv would wait out the socket's timeout)
            peeked = self.tcp.recv(1, socket.MSG_PEEK)
        except OSError as exc:
            peeked = b""
            why = str(exc)
        else:
            why = "closed by the server"
        if not peeked:
            error = self.lost(f"{self.address}: connection {why} while idle")
            self.close(error)
            raise error

    def call(self, method: str, params: list[Any], wait: float,
             prepare: Callable[[list[Any]], None] | None = None) -> Any:
        """The call's result; `prepare(params)` runs just before the frame is encoded
        (not at all when the call fails before that)."""
        if self.closed:
            raise ConnectionFailed(f"{self.address}: connection closed", self.address)
        if prepare is not None:
            self._still_open()
            prepare(params)
        msgid, frame = self.request(method, params)
        deadline = time.monotonic() + wait
        try:
            self.sock.settimeout(wait)
            self.sock.sendall(frame)
            while True:
                response = self._next_response(deadline)
                if response.msgid == msgid:
                    break
                # Any other msgid belongs to a call nobody waits for any more.
        except TimeoutError:
            error: ClientError = self.no_reply(method, wait)
            self.close(error)
            raise error from None
        except OSError as exc:
            error = self.lost(f"{self.address}: connection broke during {method}: {exc}")
            self.close(error)
            raise error from exc
        except ClientError as exc:
            self.close(exc)
            raise
        if response.error is not None:
            failed = call_error(response.error, self.address)
            if closes(response):
                self.close(failed)
            raise failed
        return response.result

    def _next_response(self, deadline: float) -> Response:
        while (response := self.next_reply()) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            self.sock.settimeout(remaining)
            self.receive_data(self.sock.recv(RECV))
        return response


def _handshake(sock: socket.socket, context: ssl.SSLContext, server: ServerState,
               deadline: float) -> TlsSocket:
    """`sock` after a client handshake (the connect timeout covers both); closed if it fails."""
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        tls = TlsSocket(sock, context, server.tls_name or server.host)
        tls.handshake()
        return tls
    except TimeoutError as exc:
        sock.close()
        raise ConnectionFailed(f"{server.address}: TLS handshake timed out (is the server's "
                               "port TLS?)", server.address) from exc
    except OSError as exc:  # ssl.SSLError, a reset, EOF in violation of the protocol
        sock.close()
        raise ConnectionFailed(handshake_failure(server.address, exc), server.address) from exc
    except BaseException:
        sock.close()
        raise


class TlsSocket:
    """A TlsChannel on a blocking socket, with the few socket calls `Connection` makes."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, host: str) -> None:
        self.sock = sock
        self.channel = TlsChannel(context, host)
        self.raw = bytearray(RECV)  # ciphertext, as the socket gives it
        self.deadline: float | None = None
        timeout = sock.gettimeout()
        if timeout is not None:
            self.deadline = time.monotonic() + timeout

    def handshake(self) -> None:
        """The client handshake; raises ssl.SSLError, TimeoutError or another OSError."""
        while not self.channel.handshake():
            self._send_owed()
            self._fill()
        self._send_owed()

    def settimeout(self, timeout: float | None) -> None:
        """As ssl.SSLSocket: one deadline for each later call, however many reads it takes."""
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.sock.settimeout(timeout)

    def close(self) -> None:
        self.sock.close()

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(self.channel.encrypt(data))

    def recv(self, max_bytes: int) -> bytes:
        """Everything decrypted so far (`max_bytes` is the channel's own); b"" at the end."""
        while True:
            data = self.channel.decrypt()
            self._send_owed()
            if data is not None:
                return data
            self._fill()

    def _fill(self) -> None:
        if self.deadline is not None:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("TLS read timed out")
            self.sock.settimeout(remaining)
        with memoryview(self.raw) as view:
            got = self.sock.recv_into(view)
            self.channel.feed(view[:got])

    def _send_owed(self) -> None:
        owed = self.channel.to_send()
        if owed:
            self.sock.sendall(owed)
