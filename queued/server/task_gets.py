"""A connection's task's gets that wait: a get answered in place that, while it waits,
watches the stream for a hang-up (`take`), a get matched by id that waits in a task of its
own while later requests go on (`get_later`), and `monitor`, which sends items as they
arrive. The handlers call them (`handlers.Conn`).

A layer of `queued.server.session.Session`'s chain (`TaskBase` -> `TaskGets` ->
`TaskPath` -> `PassGets` -> `Session`). Never parses bytes itself and never touches
the journal but through the broker.
"""

from __future__ import annotations

from contextlib import suppress

import trio

from queued.reader.state import Item
from queued.server.task_base import RECEIVE_SIZE, TaskBase
from queued.wire import commands as c

#: Gets waiting at once in tasks of their own (RPC) on one connection; more are refused.
MAX_WAITING = 1024


class TaskGets(TaskBase):
    """The gets that wait, of a `Session` (see the module docstring)."""

    async def take(self, cmd: c.Get) -> list[Item]:
        """A get answered in place. A long poll also watches the stream, so a client that
        hangs up while waiting is noticed at once and takes no item with it; after the
        peer's end of stream a get does not wait (its reply still goes out)."""
        timeout = 0 if self.eof else cmd.timeout_ms
        item: Item | None = None
        error: Exception | None = None
        if timeout <= 0:
            if cmd.max_items > 1:  # pipelined gets joined (Request.count): each wants one
                return await self.broker.get_many(
                    cmd.queue, cmd.reader, cmd.max_items, client=self.reads, open=cmd.open,
                    open_timeout_ms=cmd.open_timeout_ms, separate=True)
            item = await self.broker.get(cmd.queue, cmd.reader, client=self.reads,
                                         open=cmd.open, peek=cmd.peek,
                                         open_timeout_ms=cmd.open_timeout_ms)
            return [] if item is None else [item]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_for_eof, nursery.cancel_scope)
            try:
                item = await self.broker.get(cmd.queue, cmd.reader, timeout_ms=timeout,
                                             client=self.reads, open=cmd.open, peek=cmd.peek,
                                             open_timeout_ms=cmd.open_timeout_ms)
            except Exception as exc:  # re-raised bare, not wrapped in an ExceptionGroup
                error = exc
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error
        return [] if item is None else [item]

    async def _watch_for_eof(self, scope: trio.CancelScope) -> None:
        # Bytes that arrive meanwhile are pipelined requests: hand them to the parser
        # (its caps bound them) and stop reading once a batch's worth is buffered.
        while self.codec.buffered_bytes() < RECEIVE_SIZE:
            if not await self._receive():
                scope.cancel()
                return
        await trio.sleep_forever()

    async def _receive(self) -> bytes | bytearray:
        data = await self.transport.receive(RECEIVE_SIZE)
        self.counters.bytes_read += len(data)
        if data:
            self.codec.receive_data(data)
        elif not self.eof:  # the end of the stream is fed once, however often it is seen
            self.eof = True
            self.codec.receive_data(b"")
        return data

    async def get_later(self, cmd: c.Get, req: c.Request) -> c.Reply | None:
        """A get whose reply is matched by id: if it has to wait, it moves to a task of
        its own (started when it answers or begins to wait) and later requests go on."""
        if cmd.timeout_ms <= 0:
            return c.Items(await self._get_many(cmd))
        if self.waiting >= MAX_WAITING:
            return c.Failure(c.ErrorKind.BUSY,
                             f"{MAX_WAITING} gets are already waiting on this connection")
        assert self.nursery is not None
        await self.nursery.start(self._waiting_get, cmd, req)
        return None

    async def _get_many(self, cmd: c.Get,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
                        ) -> list[Item]:
        return await self.broker.get_many(
            cmd.queue, cmd.reader, cmd.max_items, timeout_ms=cmd.timeout_ms,
            client=self.reads, open=cmd.open, open_timeout_ms=cmd.open_timeout_ms,
            max_bytes=cmd.max_bytes, task_status=task_status)

    async def _waiting_get(self, cmd: c.Get, req: c.Request,
                           task_status: trio.TaskStatus[None]) -> None:
        batch = self.batches
        self.waiting += 1
        reply: c.Reply
        items: list[Item] = []
        scope = trio.CancelScope()  # cancelled: answered empty (see `TaskPath._end`)
        self.waits.add(scope)
        try:
            with scope:
                items = await self._get_many(cmd, task_status)
            reply = c.Items(items)
        except Exception as exc:
            reply = self.failure(req, exc)
            with suppress(RuntimeError):  # failed before it started: report started now
                task_status.started()
        finally:
            self.waiting -= 1
            self.waits.discard(scope)
        self.answer(req, reply)
        if batch != self.batches or not self.busy:
            await self.flush()  # answered after its batch went out: send it now

    async def monitor(self, cmd: c.Monitor, req: c.Request) -> c.Reply:
        """Send items as they arrive (open reads, confirmed with `confirm`) until time is up."""
        deadline = trio.current_time() + cmd.timeout_ms / 1000
        sent = 0
        while cmd.max_items is None or sent < cmd.max_items:
            left = deadline - trio.current_time()
            if left <= 0 or self.server.closing or self.done:  # done: the peer is lost
                break
            items = await self.take(c.Get(cmd.queue, cmd.reader,
                                          timeout_ms=max(1, int(left * 1000)), open=True))
            if not items:
                break
            self.out += self.codec.encode_item(req, items[0])
            sent += 1
            await self.flush()
        return c.Done()
