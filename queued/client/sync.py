"""GENERATED from aio.py by tools/unasync.py: do not edit, regenerate.

The blocking `Client`: `AsyncClient`'s code with its I/O (io_trio) swapped for blocking
sockets (io_sync) and async/await removed, so both clients behave alike by construction.
Every behaviour and its documentation live in aio.py; import from queued.client.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Generator, Iterable, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from queued.client.common import (
    DEFAULT_PORT,
    FAILOVER,
    AmbiguousPut,
    BadResponse,
    ClientClosed,
    ClientError,
    ClientStatistics,
    ConnectionFailed,
    Data,
    Headers,
    Item,
    NotOpen,
    Prepare,
    ProducerGap,
    ProducerState,
    PutAnswer,
    QueueInfo,
    RpcCallError,
    Servers,
    Timeout,
    all_failed,
    check_delay,
    check_flags,
    check_get,
    check_timeouts,
    encode_items,
    headers_param,
    int_result,
    producer_result,
    queue_info,
    sequenced_result,
    settle_groups,
    to_items,
)
from queued.client.credentials import TlsOption, login, tls_context
from queued.client.discovery import Found, resolve_soon
from queued.client.io_sync import (
    Connection,
    Lock,
    Network,
    TableLock,
    call_gate,
    checkpoint,
    now,
    repeating,
    shielded,
    sleep,
    wait_for,
)
from queued.client.servers import LOOKUP_PATIENCE, Discovery, Pool, ServerState, lookup
from queued.wire.rpc_protocol import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_FRAME,
    MAX_PRODUCER_ID,
    MAX_SEQUENCE,
)

__all__ = ["Client", "Consumer"]

#: Seconds a `move` without both max_items and a rate may take before the client gives up.
MOVE_WAIT = 24 * 3600.0
#: Seconds a reserve's heartbeat waits for the others of its client due at the same moment.
BEAT_GATHER = 0.005


class Client:
    """A client of one or several servers (`"host:port"`, a list, or tuples).

    Timeouts are in seconds; the queue operations' `*_ms` arguments are milliseconds, as
    on the wire. A call waits for its reply at most `read_timeout` (plus a get's own
    timeout_ms). One connection per server, opened on first use; leaving
    `with Client(...) as client:` closes them (the servers return open reads).

    The trio client must be entered (it runs a reader task per connection); any number of
    tasks may share it: their calls are pipelined on each connection. Cancelling a get that
    is waiting closes its connection (other calls on it fail over or fail), because a reply
    carrying items could otherwise be lost: give get a timeout_ms instead. The blocking
    client runs one call at a time: threads may share one, but use one per thread for
    concurrency (a long-polling get holds the others up).

    Several servers (no cluster: the client chooses): each client takes its servers in its
    own random order, so many short-lived clients spread their puts as one long-lived
    client does; each put goes to the next server in that round robin; a get asks each
    server with timeout 0 starting at its own rotating cursor, then long-polls one in
    turn for at most `poll_slice` seconds until its timeout runs out. A server whose
    connection fails (refused, reset, timed out) or that answers SHUTTING_DOWN or BUSY is
    skipped for `backoff` seconds, doubling per failure up to `max_backoff`, and the call
    goes on to the next server (failover; the caller sees nothing); when every server
    fails, the call raises (ConnectionFailed, or the one server's own error). A put that
    a server acknowledged is never sent again; one whose reply never came (the
    connection broke, or read_timeout passed, after it was sent) is ambiguous: it is
    re-sent once on a fresh connection if the broken one was reused, then to the next
    server, so delivery is at-least-once: such a put may be stored twice. Open reads
    stay with the connection that got them: confirm and abort go there.

    Idempotent puts (`idempotent=True`, the default): each put carries a producer id
    (random, one per server and queue) and the next sequence, so a server stores it
    once however often it arrives. A put whose reply never came is re-sent to the SAME
    server (on a new connection, as often as needed) until `delivery_timeout` seconds
    from its first send, then fails with AmbiguousPut (stored once or not at all, never
    twice); a put certainly not stored (the connection refused before it was sent,
    SHUTTING_DOWN, BUSY) still fails over at once. A refused put makes the client start
    a new producer id for that server and queue.

    Discovery: a server `dns://NAME:PORT` stands for every address NAME resolves to (A
    and AAAA: a Kubernetes headless Service), `dns+srv://_service._proto.NAME` for its SRV
    records; `?refresh=SECONDS` (default 30) and `?nameserver=HOST:PORT` (default: the
    system's resolver). Names are resolved on first use, again every refresh seconds
    and soon after a connection to one of their servers fails (a put whose servers all
    failed looks again at once and tries any new ones); servers that appear join
    the rotation, servers that disappear leave it, their connection closed once its open
    reads are settled (or their auto-abort time has passed). A name that fails
    to resolve keeps the servers it gave last; one that gives none is asked again after
    backoff. Look-ups run in threads: while the client has servers, only the call that
    starts one waits for it, at most LOOKUP_PATIENCE (0.25 s), so a DNS outage stalls no
    call. Over TLS, a discovered server's
    certificate must carry the name (the SRV target's name for dns+srv).
    peek/flush/delete/flush_all/stats ask every server and raise if any fails.
    max_frame and max_batch cap what the client accepts from a server (a get's reply,
    a stats map); keep them at least the servers' rpc_max_frame and rpc_max_batch.

    TLS: `tls=True` verifies the servers' certificates with the system's CAs; an
    `ssl.SSLContext` is used as given (`ssl.create_default_context(cafile=...)` for your
    own CA, plus `load_cert_chain(...)` for a client certificate when the servers want
    one); the name checked is the host of each server address. The handshake counts
    towards connect_timeout; one that fails (an untrusted certificate, a plaintext
    server) is a ConnectionFailed saying so. `user=` and `password=` log every new
    connection in (the `auth` call, before any other) on servers with a users file:
    wrong ones raise AuthFailed at once, never failed over or retried (the server
    closes that connection); a call without them there raises Unauthenticated, and
    one the user may not do PermissionDenied (the connection stays usable).
    """

    def __init__(self, servers: Servers = f"127.0.0.1:{DEFAULT_PORT}", *,
                 connect_timeout: float = 5.0, read_timeout: float = 10.0,
                 backoff: float = 1.0, max_backoff: float = 30.0, poll_slice: float = 0.5,
                 max_frame: int = DEFAULT_MAX_FRAME, max_batch: int = DEFAULT_MAX_BATCH,
                 tls: TlsOption = None, user: str | None = None,
                 password: str | None = None, idempotent: bool = True,
                 delivery_timeout: float = 120.0) -> None:
        check_timeouts(connect_timeout, read_timeout, poll_slice)
        if not delivery_timeout > 0:
            raise ValueError("delivery_timeout must be > 0 seconds")
        self.idempotent = idempotent
        self.delivery_timeout = delivery_timeout
        #: (server address, queue) -> this client's producer there (idempotent puts)
        self._producers: dict[tuple[str, str], ProducerState] = {}
        self._login = login(user, password)
        self._pool = Pool(servers, backoff, max_backoff)
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.poll_slice = poll_slice
        self._max_frame = max_frame
        self._max_batch = max_batch
        self._conns: dict[str, Connection] = {}
        self._net = Network(tls_context(tls))
        # Held by each public call: the blocking client's serializes threads, the trio
        # client's is always open (its calls are pipelined).
        self._gate = call_gate()
        self._connect_locks: dict[str, Lock] = {}
        # reserve's heartbeats due now, by lease (ms), gathered to go out together
        self._beating: dict[int, list[Item]] = {}
        # reserve's reads found lost by a heartbeat (NotOpen): no more beats for them
        self._lost_reads: set[Item] = set()
        self._beat_lock = TableLock()
        # Per server: the last failed connect (its number in _connect_failures, why), so
        # the calls that waited for that connect fail over at once instead of each
        # paying connect_timeout in turn.
        self._connect_failed: dict[str, tuple[int, str]] = {}
        self._connect_failures = 0
        # DNS look-ups under way (discovery.resolve_soon), one per name at a time.
        self._lookups: dict[str, tuple[Discovery, Future[Found]]] = {}
        # Servers DNS no longer gives, by address: their connections close once idle.
        self._leaving: set[str] = set()
        # Per server: open reads got and not yet settled, and when the last of them
        # auto-aborts (a count the server changed on its own is over by then).
        self._held: dict[str, tuple[int, float]] = {}
        self._closed = False
        self._calls = self._connects = self._retries = self._unconfirmed = 0

    @property
    def servers(self) -> tuple[str, ...]:
        """The servers now, "host:port" each, in this client's (random) order; dns://
        names add theirs once resolved (on the first call)."""
        return tuple(s.address for s in self._pool.servers)

    # -- lifetime

    def __enter__(self) -> Client:
        self._net.open(self._closed)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self._close_all()  # not awaited: nothing may stop the network below from closing
        finally:
            self._net.close()

    def close(self) -> None:
        """Close every connection (the servers return their open reads). Idempotent."""
        self._close_all()
        checkpoint()

    def _close_all(self) -> None:
        with self._gate:
            self._closed = True
            for conn in self._conns.values():
                conn.close(ClientClosed("the client is closed"))
            self._conns.clear()

    def statistics(self) -> ClientStatistics:
        def connected(address: str) -> bool:
            conn = self._conns.get(address)
            return conn is not None and not conn.closed

        return ClientStatistics(self._calls, self._connects, self._retries, self._unconfirmed,
                                tuple(self._pool.statistics(connected, now())))

    # -- plumbing

    def _connection(self, server: ServerState) -> tuple[Connection, bool]:
        """The server's connection and whether it is fresh (opened now)."""
        if self._closed:
            raise ClientClosed("the client is closed")
        seen = self._connect_failures
        with self._connect_locks.setdefault(server.address, Lock()):
            conn = self._conns.get(server.address)
            if conn is not None and not conn.closed:
                return conn, False
            number, why = self._connect_failed.get(server.address, (0, ""))
            if number > seen:  # a connect failed while this call waited: fail over now
                raise ConnectionFailed(why, server.address)
            try:
                conn = self._net.connect(server, self.connect_timeout, self._max_frame,
                                         self._max_batch)
            except ConnectionFailed as exc:
                self._connect_failures += 1
                self._connect_failed[server.address] = (self._connect_failures, str(exc))
                raise
            self._connect_failed.pop(server.address, None)
            self._connects += 1
            if self._login is not None:
                self._log_in(conn)
            if self._closed:  # meanwhile
                conn.close(ClientClosed("the client is closed"))
                raise ClientClosed("the client is closed")
            self._conns[server.address] = conn
            return conn, True

    def _log_in(self, conn: Connection) -> None:
        """The `auth` call, first on a new connection; closes it if that fails."""
        assert self._login is not None
        self._calls += 1
        try:
            result = conn.call("auth", self._login.params(), self.read_timeout)
            if result is not True:
                raise BadResponse(f"{conn.address}: auth answered {result!r}, not true")
        except BaseException as exc:
            conn.close(exc if isinstance(exc, ClientError)
                       else ClientClosed("the login was interrupted"))
            raise

    def _on(self, server: ServerState, method: str, params: list[Any],
            wait: float, prepare: Prepare | None = None,
            ) -> tuple[int, Any]:
        """(connection serial, result) of one call on one server (`prepare`: see
        Connection.call)."""
        conn, fresh = self._connection(server)
        self._calls += 1
        try:
            return conn.serial, conn.call(method, params, wait, prepare)
        except ConnectionFailed:
            if fresh:
                raise
        self._retries += 1  # the server may have closed an idle connection: once more
        conn, _ = self._connection(server)
        self._calls += 1
        return conn.serial, conn.call(method, params, wait, prepare)

    def _order(self, kind: str) -> list[ServerState]:
        """The servers to try for a call of `kind` ("put" or "get"), names resolved first."""
        if self._pool.names:
            self._discover()
        return self._pool.order(kind, now())

    def _discover(self, *, wait: bool = False) -> None:
        """Resolve the DNS names that are due, each in a thread of its own (one look-up
        per name at a time). Calls wait for the look-ups when the client has no server
        (yet), or (`wait`) when every server they tried failed. Otherwise only the call
        that starts a look-up waits for it, at most LOOKUP_PATIENCE, then goes on with
        the servers it has; a later call takes the answer (a DNS outage stalls no call
        longer than that)."""
        started = [name for name in self._pool.due(now()) if name.spec not in self._lookups]
        for name in started:
            self._lookups[name.spec] = (name, resolve_soon(name, self.connect_timeout))
        if self._lookups and (wait or started or not self._pool.servers):
            patience = None if wait or not self._pool.servers else LOOKUP_PATIENCE
            wait_for([future for _, future in self._lookups.values()], patience)
        for spec, (name, future) in list(self._lookups.items()):
            if not future.done():
                continue
            del self._lookups[spec]
            try:
                found = future.result()
            except ConnectionFailed as exc:
                self._pool.resolve_failed(name, str(exc), now())
                continue
            self._pool.resolved(name, found, now())
        # Connections to servers no name gives any more (a task that chose its server
        # before a look-up may have opened one since) close once idle.
        self._leaving |= self._conns.keys() - self._pool.by_address.keys()
        for address in list(self._leaving):
            conn = self._conns.get(address)
            held, until = self._held.get(address, (0, 0.0))
            if address in self._pool.by_address:  # it came back
                self._leaving.discard(address)
            elif (conn is None or conn.closed
                  or (not conn.busy and (held <= 0 or until <= now()))):
                lock = self._connect_locks.get(address)
                if lock is not None and lock.locked():
                    continue  # a call is connecting to it: on a later look
                if conn is not None:
                    conn.close(ClientClosed(f"{address} left its DNS name"))
                    del self._conns[address]
                self._leaving.discard(address)
                self._connect_locks.pop(address, None)
                self._connect_failed.pop(address, None)
                self._held.pop(address, None)

    def _failover(self, order: list[ServerState], method: str, params: list[Any],
                  wait: float) -> tuple[ServerState, int, Any]:
        errors: list[ClientError] = []
        for server in order:
            started = now()
            try:
                serial, result = self._on(server, method, params, wait)
            except FAILOVER as exc:
                self._pool.failed(server, now(), started)
                errors.append(exc)
                if len(errors) < len(order):
                    self._retries += 1
                continue
            self._pool.ok(server)
            return server, serial, result
        raise all_failed(errors)

    def _everyone(self, method: str, params: list[Any]) -> list[tuple[str, Any]]:
        answers: list[tuple[str, Any]] = []
        errors: list[ClientError] = []
        with self._gate:
            if self._pool.names:
                self._discover()
            for server in list(self._pool.require()):
                started = now()
                try:
                    _, result = self._on(server, method, params, self.read_timeout)
                except FAILOVER as exc:
                    self._pool.failed(server, now(), started)
                    errors.append(exc)
                    continue
                self._pool.ok(server)
                answers.append((server.address, result))
        if errors:
            raise all_failed(errors)
        return answers

    # -- the protocol's methods

    def call(self, method: str, *params: Any, server: str | None = None) -> Any:
        """A raw call: the result as decoded, or the mapped RpcCallError.

        Goes to `server` ("host:port" as in `servers`) or to the next server in the put
        rotation, with failover.
        """
        with self._gate:
            if server is not None:
                order = [lookup(self._pool, server)]
                _, _, result = self._failover(order, method, list(params),
                                              self.read_timeout)
            else:
                result = self._put_rotation(method, list(params))
        return result

    def put(self, queue: str, items: Data | Iterable[Data], expiration_ms: int = 0,
            flags: int = 0, *, delay_ms: int = 0,
            headers: Headers | Sequence[Headers | None] | None = None) -> int:
        """Store items (bytes, or str as UTF-8; a single one or an iterable) on one server.

        Returns how many were stored. expiration_ms is relative; 0 = never. flags: every
        item's memcache flags (u32), what a memcache get answers with them. delay_ms: the
        items stay invisible that long (delayed delivery; 0 = none). headers: a map of
        string keys to bytes or string values that every item carries, or a list of one
        map (or None) per item; at most 64 headers and 16 KiB of keys and values an item
        (ValueError, nothing sent). A get with `with_headers=True` returns them.
        """
        batch = encode_items(items)
        check_flags(flags)
        check_delay(delay_ms)
        sent_headers = headers_param(headers, len(batch))
        params: list[Any] = [queue, batch, expiration_ms]
        if flags or delay_ms:  # (servers before flags take three params)
            params.append(flags)
        if delay_ms:  # (servers before delays take four)
            params.append(delay_ms)
        if sent_headers is not None:  # (servers before headers take eight: the ninth)
            params += [*[0, 0, 0][len(params) - 2:], None, 0, None, sent_headers]
        with self._gate:
            if self.idempotent:
                params += [0, 0, 0][len(params) - 2:]  # (expiration_ms, flags, delay_ms)
                params += [None, 0][len(params) - 5:]  # producer, sequence: set when sent
                result = self._put_rotation("put", params, queue)
                return producer_result(result, len(batch))
            result = self._put_rotation("put", params)
        return int_result(result, "put")

    def put_sequenced(self, queue: str, items: Data | Iterable[Data], producer: bytes,
                      sequence: int, expiration_ms: int = 0, flags: int = 0, *,
                      delay_ms: int = 0,
                      headers: Headers | Sequence[Headers | None] | None = None,
                      ) -> PutAnswer:
        """An exactly-once put under the caller's own producer id (1 to 64 bytes) and
        sequence (1, 2, ... one number per put; see the README's Exactly-once puts), for a
        caller that derives both from what it writes, so that writing it again meets the
        first time's answer (the Spark sink). `put` chooses them itself.

        It goes to one server, the one `producer` hashes to among the client's servers (by
        address), never another: the producer's table is that server's. A put whose reply
        never came, or that could not be sent (the server restarting), is sent again with
        the same producer and sequence until `delivery_timeout`, then raises AmbiguousPut
        (stored once or not at all). A sequence past the producer's next raises ProducerGap.
        `headers` as `put` takes them.
        """
        batch = encode_items(items)
        check_flags(flags)
        check_delay(delay_ms)
        sent_headers = headers_param(headers, len(batch))
        if not 0 < len(producer) <= MAX_PRODUCER_ID or not 0 < sequence <= MAX_SEQUENCE:
            raise ValueError(f"a producer id has 1 to {MAX_PRODUCER_ID} bytes and a sequence "
                             f"is 1 to {MAX_SEQUENCE}")
        params: list[Any] = [queue, batch, expiration_ms, flags, delay_ms, producer, sequence]
        if sent_headers is not None:  # (the ninth param; the eighth is a dedup key's)
            params += [None, sent_headers]
        with self._gate:
            self._order("put")  # (resolves DNS names)
            servers = sorted(self._pool.require(), key=lambda s: s.address)
            pick = int.from_bytes(hashlib.blake2b(producer, digest_size=8).digest(), "big")
            server = servers[pick % len(servers)]
            deadline = now() + self.delivery_timeout
            pause = 0.05
            while True:
                started = now()
                try:
                    _, result = self._on(server, "put", params, self.read_timeout)
                except FAILOVER as exc:
                    self._pool.failed(server, now(), started)
                    if now() >= deadline:
                        raise AmbiguousPut(
                            f"{server.address}: put to {queue!r} under a producer of the "
                            f"caller's, no reply to it or its re-sends within delivery_timeout "
                            f"({self.delivery_timeout} s): stored once or not at all ({exc})",
                            server.address) from exc
                    self._retries += 1
                    sleep(min(pause, max(0.0, deadline - now())))
                    pause = min(pause * 2, 1.0)
                    continue
                self._pool.ok(server)
                return sequenced_result(result)

    def _idempotent_failover(self, order: list[ServerState], queue: str,
                             params: list[Any]) -> Any:
        """put with a producer id and sequence (see the class docstring): the first server
        of `order` that takes it; once sent, that server only, until answered or
        delivery_timeout."""
        errors: list[ClientError] = []
        for server in order:
            key = (server.address, queue)
            state = self._producers.get(key)
            if state is None:
                state = self._producers[key] = ProducerState(secrets.token_bytes(16))
            taken: list[tuple[bytes, int]] = []

            def prepare(p: list[Any], state: ProducerState = state,
                        taken: list[tuple[bytes, int]] = taken) -> None:
                if not taken:  # the first send takes the sequence; re-sends repeat it
                    taken.append(state.take())
                p[5], p[6] = taken[0]

            started = now()
            deadline = started + self.delivery_timeout
            pause, gaps, ambiguous = 0.05, 0, False
            while True:
                try:
                    _, result = self._on(server, "put", params, self.read_timeout,
                                         prepare)
                except ProducerGap:
                    # A put before it was not stored: a new producer, and this one again.
                    state.renew(taken[0] if taken else None, secrets.token_bytes(16))
                    taken.clear()
                    gaps += 1
                    if gaps > 3:
                        raise
                    continue
                except FAILOVER as exc:
                    # Sent and unanswered: maybe stored. Refused (SHUTTING_DOWN, BUSY), or
                    # never sent: certainly not, so the next server may take it.
                    ambiguous = ambiguous or (bool(taken) and (isinstance(exc, Timeout) or (
                        isinstance(exc, ConnectionFailed) and not exc.refused)))
                    if not ambiguous:
                        if taken:
                            state.renew(taken[0], secrets.token_bytes(16))
                        if isinstance(exc, ConnectionFailed) and exc.refused:
                            raise  # (sent, but the server turned the connection down)
                        self._pool.failed(server, now(), started)
                        errors.append(exc)
                        if len(errors) < len(order):
                            self._retries += 1
                        break
                    if now() >= deadline:
                        state.renew(taken[0] if taken else None, secrets.token_bytes(16))
                        raise AmbiguousPut(
                            f"{server.address}: put to {queue!r} sent, and no reply to it or "
                            f"its re-sends within delivery_timeout ({self.delivery_timeout} s):"
                            f" stored once or not at all ({exc})", server.address) from exc
                    if pause == 0.05:  # (other calls skip it meanwhile)
                        self._pool.failed(server, now(), started)
                    self._retries += 1  # sent, unanswered: the same server, same sequence
                    sleep(min(pause, max(0.0, deadline - now())))
                    pause = min(pause * 2, 1.0)
                    continue
                except RpcCallError:
                    state.renew(taken[0] if taken else None, secrets.token_bytes(16))
                    raise
                self._pool.ok(server)
                return result
        raise all_failed(errors)

    def _put_rotation(self, method: str, params: list[Any],
                      idempotent: str | None = None) -> Any:
        """The call on the next server of the put rotation, with failover. When every
        server failed and a DNS name then gives servers not tried yet (the fleet moved:
        pods rescheduled to new addresses), those are tried too. `idempotent`: the queue
        of an idempotent put (`_idempotent_failover`)."""
        order = self._order("put")
        try:
            if idempotent is not None:
                return self._idempotent_failover(order, idempotent, params)
            return (self._failover(order, method, params, self.read_timeout))[2]
        except FAILOVER:
            if not self._pool.names:
                raise
            tried = {s.address for s in order}
            self._discover(wait=True)
            fresh = [s for s in self._pool.servers if s.address not in tried]
            if not fresh:
                raise
        if idempotent is not None:
            return self._idempotent_failover(fresh, idempotent, params)
        return (self._failover(fresh, method, params, self.read_timeout))[2]

    def get(self, queue: str, max_items: int = 1, timeout_ms: int = 0,
            auto_abort_ms: int = 0, *, with_flags: bool = False,
            with_deliveries: bool = False, with_headers: bool = False) -> list[Item]:
        """Up to max_items items, waiting up to timeout_ms for the first; [] if none came.

        auto_abort_ms > 0 makes each item an open read held by this client's connection
        to its server: confirm() it, or it returns to the queue after auto_abort_ms or
        when the connection closes. 0 removes the items at once (at most once).
        with_flags: fill each Item's flags (memcache flags) too. with_deliveries: fill
        its flags and `deliveries` (how many times it has been delivered, this time too).
        with_headers: fill all of those and its `headers` ({} for an item without).
        """
        check_get(max_items, timeout_ms, auto_abort_ms)
        if with_deliveries:
            with_flags = True
        with self._gate:
            deadline = now() + timeout_ms / 1000
            order = self._order("get")
            form = 3 if with_headers else 2 if with_deliveries else 1 if with_flags else 0
            if len(order) == 1:
                return self._get_from(order, queue, max_items, timeout_ms,
                                      auto_abort_ms, form, first_answer=True)
            while True:
                items = self._get_from(order, queue, max_items, 0, auto_abort_ms,
                                       form, first_answer=False)
                left_ms = int((deadline - now()) * 1000)
                if items or left_ms <= 0:
                    return items
                wait_ms = min(left_ms, int(self.poll_slice * 1000))
                order = self._order("get")  # skips any just failed
                items = self._get_from(order, queue, max_items, wait_ms, auto_abort_ms,
                                       form, first_answer=True)
                if items:
                    return items
                order = self._order("get")

    def _get_from(self, order: list[ServerState], queue: str, max_items: int,
                  timeout_ms: int, auto_abort_ms: int, form: int, *,
                  first_answer: bool) -> list[Item]:
        """Ask the servers in order until one has items (or, first_answer, until one
        answers). `form`: 0 [id, data], 1 with flags, 2 with flags and deliveries, 3 with
        headers too."""
        errors: list[ClientError] = []
        wait = timeout_ms / 1000 + self.read_timeout
        params: list[Any] = [queue, max_items, timeout_ms, auto_abort_ms]
        if form:  # (servers before flags take four params, before deliveries five, ...)
            params += [True] * form
        for server in order:
            started = now()
            try:
                serial, result = self._on(server, "get", params, wait)
            except FAILOVER as exc:
                self._pool.failed(server, now(), started)
                errors.append(exc)
                continue
            self._pool.ok(server)
            items = to_items(result, queue, server.address, serial if auto_abort_ms else 0,
                             self)
            if items and auto_abort_ms:
                held, until = self._held.get(server.address, (0, 0.0))
                self._held[server.address] = (held + len(items),
                                              max(until, now() + auto_abort_ms / 1000))
            if items or first_answer:
                return items
        if len(errors) == len(order):
            raise all_failed(errors)
        return []

    def confirm(self, items: Item | Iterable[Item]) -> int:
        """Confirm open reads (items from a get with auto_abort_ms); returns how many counted.

        Each item goes to the connection it came from. Items whose connection has closed
        since count 0: the server has already returned them to the queue.
        """
        return self._settle("confirm", items)

    def abort(self, items: Item | Iterable[Item], *, delay_ms: int = 0) -> int:
        """Return open reads to their queues; returns how many counted (see confirm).
        delay_ms: they stay invisible that long first (retry with back-off)."""
        check_delay(delay_ms)
        return self._settle("abort", items, [delay_ms] if delay_ms else [])

    def extend(self, items: Item | Iterable[Item], ms: int) -> int:
        """Extend open reads to `ms` from now (0: no timeout), past their first timeout
        if need be; returns how many counted (items whose connection has closed count 0:
        the server has returned them). NotOpen for a read its connection no longer holds."""
        if type(ms) is not int or ms < 0:
            raise ValueError(f"ms must be an integer >= 0, not {ms!r}")
        return self._settle("extend", items, [ms])

    def reject(self, items: Item | Iterable[Item]) -> int:
        """Give up on open reads now: each goes to its queue's error_queue, or is dropped
        when the queue has none; returns how many counted (see confirm)."""
        return self._settle("reject", items)

    def _settle(self, method: str, items: Item | Iterable[Item],
                extra: list[Any] | None = None) -> int:
        """Each (server, queue, connection) group in one call; a group whose connection
        fails meanwhile (or whose server is shutting down) counts 0, and the others go on:
        the server returns those items to the queue."""
        total = 0
        with self._gate:
            for (address, queue, serial), ids in settle_groups(items).items():
                if address in self._held:
                    held, until = self._held[address]
                    self._held[address] = (max(0, held - len(ids)), until)
                conn = self._conns.get(address)
                if serial == 0 or conn is None or conn.serial != serial or conn.closed:
                    continue
                self._calls += 1
                try:
                    result = conn.call(method, [queue, ids, *(extra or ())],
                                       self.read_timeout)
                except FAILOVER:
                    continue
                total += int_result(result, method)
        return total

    def pause(self, queue: str) -> None:
        """Pause the queue on every server (admin): puts go on, gets wait for resume."""
        self._everyone("pause", [queue])

    def resume(self, queue: str) -> None:
        """Resume a paused queue on every server (admin)."""
        self._everyone("resume", [queue])

    def move(self, source: str, destination: str, max_items: int = 0, rate: int = 0, *,
             server: str | None = None) -> int:
        """Move items from `source` to `destination` (admin; redrive a dead-letter queue):
        up to max_items (0: all), at most `rate` a second (0: no limit), each kept with its
        error count and flags; on `server`, else on every server. Returns how many moved."""
        params: list[Any] = [source, destination, max_items, rate]
        # The server answers once it has moved them all: wait as long as the rate needs.
        wait = self.read_timeout + (max_items / rate if max_items and rate else MOVE_WAIT)
        with self._gate:
            if server is None and self._pool.names:
                self._discover()
            order = ([lookup(self._pool, server)] if server is not None
                     else list(self._pool.require()))
            moved = 0
            for state in order:
                _, result = self._on(state, "move", params, wait)
                moved += int_result(result, "move")
        return moved

    def browse(self, queue: str, after_id: int = 0, n: int = 100, *,
               server: str | None = None, with_headers: bool = False) -> list[Item]:
        """Up to n items of the queue in delivery order after item `after_id` (0: from the
        head), taken from nobody (`deliveries`: so far); on `server`, else the first in
        the rotation. Page with the last item's id. with_headers: fill their headers."""
        params: list[Any] = [queue, after_id, n] + ([True] if with_headers else [])
        with self._gate:
            order = ([lookup(self._pool, server)] if server is not None
                     else self._order("get"))
            state, _, result = self._failover(order, "browse", params,
                                              self.read_timeout)
        return to_items(result, queue, state.address, 0)

    def peek(self, queue: str) -> QueueInfo:
        return queue_info(queue, self._everyone("peek", [queue]))

    def flush(self, queue: str) -> int:
        """Remove every item of the queue (or of one fanout reader) on every server."""
        return sum(int_result(r, "flush") for _, r in self._everyone("flush", [queue]))

    def delete(self, queue: str) -> bool:
        """Delete the queue on every server; True if any server had it."""
        return any(r is True for _, r in self._everyone("delete", [queue]))

    def flush_all(self) -> int:
        answers = self._everyone("flush_all", [])
        return sum(int_result(r, "flush_all") for _, r in answers)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Each server's `{"server": {...}, "queues": {...}}`, keyed by "host:port"."""
        return dict(self._everyone("stats", []))

    def version(self) -> str:
        """The version of the first server (in put rotation) that answers."""
        result = self.call("version")
        if not isinstance(result, str):
            raise BadResponse(f"version answered {result!r}")
        return result

    # -- reliable processing

    @contextmanager
    def reserve(self, queue: str, timeout_ms: int = 0, auto_abort_ms: int = 60_000, *,
                with_flags: bool = False, heartbeat: bool = False,
                with_headers: bool = False) -> Generator[Item | None, None, None]:
        """Get one item as an open read; confirm it if the body ends normally, abort if it raises.

        `with client.reserve(queue) as item:` yields None when no item came within
        timeout_ms: the body always runs, so check. A confirm or abort that cannot reach
        the server (the connection is gone) is not an error: the server returns the item
        to the queue, and it will be delivered again. The item carries its `deliveries`.
        heartbeat: while the body runs, the read is extended to auto_abort_ms from now
        every auto_abort_ms / 3, so a long job keeps its item (in a thread of its own
        for the blocking Client); the item still returns if this process dies.
        """
        if auto_abort_ms <= 0:
            raise ValueError("reserve needs auto_abort_ms > 0")
        got = self.get(queue, 1, timeout_ms, auto_abort_ms, with_flags=with_flags,
                       with_deliveries=True, with_headers=with_headers)
        item = got[0] if got else None
        try:
            if heartbeat and item is not None:
                try:
                    with repeating(auto_abort_ms / 3000, self._beat, item,
                                   auto_abort_ms):
                        yield item
                finally:
                    with self._beat_lock:
                        self._lost_reads.discard(item)
            else:
                yield item
        except BaseException:
            if item is not None:
                self._settle_quietly([], [item])
            raise
        if item is not None:
            self._settle_quietly([item], [])

    def _beat(self, item: Item, ms: int) -> None:
        """One heartbeat of `reserve`: the read extended, or left be if that fails (the
        body learns of a lost item when its confirm counts 0). The beats of this client's
        reserves with the same lease fall due together (`repeating` runs on a shared
        grid): the first gathers the others for BEAT_GATHER seconds, then sends them as
        one extend per connection and queue. A lost read among them (NotOpen refuses its
        extend whole: it timed out, or the body confirmed or aborted it) has the others of
        that batch sent again one by one, and is left out of its later beats."""
        with self._beat_lock:  # (held for these sets only: one lock serves both clients)
            if item in self._lost_reads:
                return
            batch = self._beating.get(ms)
            if batch is not None:
                batch.append(item)
                return
            self._beating[ms] = batch = [item]
        # The others' beats ride on this one: if its own block ends meanwhile, the beat
        # still goes out (the block's exit waits that long, at most read_timeout).
        with shielded(self.read_timeout):
            try:
                sleep(BEAT_GATHER)
            finally:
                with self._beat_lock:
                    del self._beating[ms]
            try:
                self.extend(batch, ms)
            except NotOpen:
                for one in batch:
                    try:
                        self.extend(one, ms)
                    except NotOpen:
                        with self._beat_lock:
                            self._lost_reads.add(one)
                    except ClientError:
                        pass
            except ClientError:
                pass

    def consume(self, queue: str, *, batch: int = 100, timeout_ms: int = 1000,
                auto_abort_ms: int = 0, max_items: int | None = None,
                stop_when_empty: bool = False, with_flags: bool = False,
                with_headers: bool = False) -> Consumer:
        """Items, fetched `batch` at a time, until max_items or (stop_when_empty) an empty
        get; otherwise forever. `with client.consume(queue) as items:`, then
        `for item in items:`; a bare `for` works too.

        Reliable mode (auto_abort_ms > 0): an item is confirmed once the loop asks for the
        next one after it. Confirms are sent per batch, before the next batch is fetched.
        When the loop stops early (break, or an exception in its body) the items it
        finished are confirmed and the current one and the rest of its batch are aborted,
        so they come back: on leaving the `with`, else once the iterator is garbage.
        auto_abort_ms must cover a whole batch's processing. Plain mode (0): items are
        removed when fetched; stopping early loses the rest of the batch (use batch=1).
        """
        if batch < 1 or (max_items is not None and max_items < 0):
            raise ValueError("want batch >= 1 and max_items >= 0")
        return Consumer(self._consume(queue, batch, timeout_ms, auto_abort_ms, max_items,
                                      stop_when_empty, with_flags, with_headers))

    def _consume(self, queue: str, batch: int, timeout_ms: int, auto_abort_ms: int,
                 max_items: int | None, stop_when_empty: bool,
                 with_flags: bool, with_headers: bool) -> Generator[Item, None, None]:
        got = 0
        while max_items is None or got < max_items:
            want = batch if max_items is None else min(batch, max_items - got)
            items = self.get(queue, want, timeout_ms, auto_abort_ms,
                             with_flags=with_flags, with_headers=with_headers)
            if not items:
                if stop_when_empty:
                    return
                continue
            got += len(items)
            done = 0
            try:
                for item in items:
                    yield item
                    done += 1
            finally:
                if auto_abort_ms:
                    self._settle_quietly(items[:done], items[done:])

    def _settle_quietly(self, confirm: list[Item], abort: list[Item]) -> None:
        with shielded(self.read_timeout):  # runs on the way out of cancelled code too
            for method, items in (("confirm", confirm), ("abort", abort)):
                if not items:
                    continue
                try:
                    n = self._settle(method, items)
                except FAILOVER:
                    n = 0
                if method == "confirm":
                    self._unconfirmed += len(items) - n


class Consumer:
    """What consume returns: its items, and a context that stops it (settling its batch)."""

    def __init__(self, items: Generator[Item, None, None]) -> None:
        self._items = items

    def __iter__(self) -> Consumer:
        return self

    def __next__(self) -> Item:
        return next(self._items)

    def close(self) -> None:
        """Stop: confirm the items finished, abort the current one and the rest of its batch."""
        self._items.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
