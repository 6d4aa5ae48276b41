"""Regression tests for the review of the pipelined rounds (issue 15), each failing
before its fix:

1. hand-backs reach the loop in start order even when a round's thread is descheduled
   between finishing and handing back (else a later round is acknowledged first and
   compaction can drop an acknowledged put);
2. work the writer loop took keeps its place on the writer's lock: a queue deletion asked
   for meanwhile comes after it (else the deleted queue's files come back);
3. slot fds: no more than one fd per open segment once the pipeline drains, and a slot
   fd that cannot be opened (EMFILE) makes the round run alone, not the queue fail.
"""
from __future__ import annotations

import dataclasses
import os
import resource
import time
from pathlib import Path

import trio
import trio.testing
from test_pipelined_rounds import ALWAYS, T0, HeldFsync, held, puts_in, until  # noqa: F401

from queued.config import DataDirConfig
from queued.storage import writer as w
from queued.storage.compaction import plan_compaction
from queued.storage.datadir import DataDir, open_data_dir


def late_first_hand_back(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The first pipelined round's thread is "descheduled" for 0.3 s just before it
    hands the round back (a loaded 2-core box): the next round must still come after."""
    orig_init = w.PipelinedRound.__init__
    made: list[w.PipelinedRound] = []

    def init(self, work, slot, prev, finish):  # type: ignore[no-untyped-def]
        orig_init(self, work, slot, prev, finish)
        made.append(self)
        if len(made) == 1:
            def late(rnd, finish=finish):  # type: ignore[no-untyped-def]
                time.sleep(0.3)
                finish(rnd)
            self.finish = late

    monkeypatch.setattr(w.PipelinedRound, "__init__", init)


async def test_hand_backs_in_start_order(tmp_path: Path, held: HeldFsync, monkeypatch) -> None:  # noqa: F811
    late_first_hand_back(monkeypatch)
    order: list[str] = []
    async with open_data_dir(tmp_path, DataDirConfig(), lambda _: ALWAYS) as dd:
        j = dd.queue("q")
        await j.append([b"a"], T0)  # opens the segment (a round of its own)

        async def append(data: bytes) -> None:
            await j.append([data], T0)
            order.append(data.decode())

        async with trio.open_nursery() as nursery:
            held.hold()
            nursery.start_soon(append, b"b")
            await until(held.held.is_set, "b's fsync began")
            nursery.start_soon(append, b"c")
            await until(lambda: b"c" in puts_in(tmp_path), "c written")
            held.release()
        seg = j.segments[-1]
        print("ack order:", order, "segment first/last/count:", seg.first_id, seg.last_id,
              seg.count)
        plan = plan_compaction([seg, seg], {"": type(j.readers[""])(head=2)}, 0.5)
        print("with reader head 2, once rotated the segment is dead:", plan.dead == (seg,))
        assert order == ["b", "c"], "acknowledged out of order"
        assert seg.last_id == 3, f"segment says last id {seg.last_id}, holds id 3"


async def test_out_of_order_hand_back_then_compaction_loses_an_acked_put(
        tmp_path: Path, held: HeldFsync, monkeypatch) -> None:  # noqa: F811
    late_first_hand_back(monkeypatch)
    async with open_data_dir(tmp_path, DataDirConfig(), lambda _: ALWAYS) as dd:
        j = dd.queue("q")
        await j.append([b"a"], T0)
        async with trio.open_nursery() as nursery:
            held.hold()
            nursery.start_soon(j.append, [b"b"], T0)
            await until(held.held.is_set, "b's fsync began")
            nursery.start_soon(j.append, [b"c"], T0)  # acknowledged: id 3
            await until(lambda: b"c" in puts_in(tmp_path), "c written")
            held.release()
        j.config = dataclasses.replace(ALWAYS, journal_size=64)  # the next put rotates
        await j.append([b"d" * 100], T0)
        assert len(j.segments) == 2
        await j.write_checkpoint("", 2)  # a and b consumed, c (id 3) not yet
        await j.compact()
    ids = [p.id for p in DataDir.open(tmp_path).queues["q"].iter_puts(3)]
    assert 3 in ids, f"acknowledged id 3 lost after compaction; left: {ids}"


async def test_put_to_a_queue_deleted_meanwhile_leaves_no_file(tmp_path: Path) -> None:
    outcome: list[str] = []
    async with open_data_dir(tmp_path, DataDirConfig(), lambda _: ALWAYS) as dd:
        y = dd.queue("y")
        await y.append([b"first"], T0)  # y's segment is open: its next put may pipeline
        go = trio.Event()

        async def pause() -> None:  # another pause under way (deleting queue x, say)
            async with dd._writer.paused():
                await go.wait()

        async def put() -> None:
            try:
                await y.append([b"late"], T0)
                outcome.append("acknowledged")
            except Exception as exc:
                outcome.append(f"refused: {exc}")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(pause)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(put)  # taken by the writer loop; start_round waits
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(dd.delete_queue, "y")
            await trio.testing.wait_all_tasks_blocked()
            go.set()
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("y."))
    print("put:", outcome, "files of deleted queue y left:", left)
    assert not left, f"deleted queue y has files again: {left} (put {outcome})"
    assert "y" not in DataDir.open(tmp_path).queues


QUEUES = 30


def segment_fds(where: Path) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(where)) and ".read." not in target:
            n += 1
    return n


async def load(js, rounds: int) -> list[BaseException]:  # type: ignore[no-untyped-def]
    errors: list[BaseException] = []

    async def appender(j, k: int) -> None:  # type: ignore[no-untyped-def]
        for n in range(rounds):
            try:
                await j.append([b"%d-%d" % (k, n)], T0)
            except Exception as exc:
                errors.append(exc)
                return

    async with trio.open_nursery() as nursery:
        for j in js:
            for k in range(3):
                nursery.start_soon(appender, j, k)
    return errors


async def test_slot_fds_per_queue(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path, DataDirConfig(), lambda _: ALWAYS) as dd:
        js = [dd.queue(f"q{i}") for i in range(QUEUES)]
        for j in js:
            await j.append([b"first"], T0)
        before = segment_fds(tmp_path)
        errors = await load(js, 30)
        after = segment_fds(tmp_path)
        print(f"segment fds for {QUEUES} queues: {before} before load, {after} after")
        assert not errors
        assert after <= QUEUES, f"{after} fds held for {QUEUES} open segments"


async def test_emfile_in_sync_slot_fails_the_queue_for_good(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    async with open_data_dir(tmp_path, DataDirConfig(), lambda _: ALWAYS) as dd:
        js = [dd.queue(f"q{i}") for i in range(QUEUES)]
        for j in js:
            await j.append([b"first"], T0)
        await load(js, 1)  # warm up threads and pools
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
        try:
            errors = await load(js, 10)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        failed = [j.name for j in js if j.failed is not None]
        print("errors:", len(errors), {str(e)[:110] for e in errors} if errors else "")
        print("queues refusing writes for good:", len(failed))
        assert not failed, f"{len(failed)} queues refuse writes after EMFILE: {js[0].failed}"


async def test_a_failed_file_writes_nothing_more_in_a_pipelined_round(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path, DataDirConfig(), lambda _: ALWAYS) as dd:
        j = dd.queue("q")
        await j.append([b"a"], T0)
        before = puts_in(tmp_path)
        j.file.set_failed("fsync failed: a test")
        chunk = w.Chunk(rotate=False)
        chunk.add(b"head", b"more")
        size = os.fstat(j.file._fd).st_size  # type: ignore[arg-type]
        result = j.file.append([chunk])
        assert os.fstat(j.file._fd).st_size == size  # type: ignore[arg-type]
        assert result.written == [] and result.error is j.file.failed
        assert puts_in(tmp_path) == before
