"""The pure open-read ledger and timeout heap (queued.reader.open_reads): a hypothesis state
machine checks them together against a plain dict model (opening, closing, taking, forgetting,
expiring and compacting never lose or duplicate an open read; due reads come out in
deadline order), plus a few targeted cases."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from queued.reader.open_reads import OpenReads, TimedOut, TimeoutHeap

QUEUES = ["q", "r"]
READERS = ["", "a"]
N_LEDGERS = 3

ledger_ix = st.integers(0, N_LEDGERS - 1)
queue = st.sampled_from(QUEUES)
reader = st.sampled_from(READERS)
item_id = st.integers(1, 12)

ReadKey = tuple[int, str, str, int]  # ledger, queue, reader, item id


@dataclass(frozen=True)
class Pushed:
    deadline: float
    seq: int
    key: ReadKey


class OpenReadsMachine(RuleBasedStateMachine):
    """Model: open reads are a dict {(ledger, queue, reader, id): deadline or None} in
    opening order; the heap is the list of everything pushed and not yet popped."""

    def __init__(self) -> None:
        super().__init__()
        self.ledgers = [OpenReads(f"c{i}") for i in range(N_LEDGERS)]
        self.heap = TimeoutHeap(min_size=4)  # small: pushes compact it often
        self.now = 0.0
        self.seq = 0
        self.open: dict[ReadKey, float | None] = {}
        self.pushed: list[Pushed] = []

    def live(self, p: Pushed) -> bool:
        return p.key in self.open and self.open[p.key] == p.deadline

    @rule(i=ledger_ix, q=queue, r=reader, ids=st.lists(item_id, min_size=1, max_size=4,
                                                       unique=True),
          delay=st.none() | st.sampled_from([0.0, 1.0, 1.5, 3.0]))
    def open_reads(self, i: int, q: str, r: str, ids: list[int], delay: float | None) -> None:
        ids = [n for n in ids if (i, q, r, n) not in self.open]  # an open id is not reopened
        deadline = None if delay is None else self.now + delay
        for n in ids:
            self.ledgers[i].add(q, r, n, deadline)
            self.open[(i, q, r, n)] = deadline
        if deadline is None:
            return
        earliest = min((p.deadline for p in self.pushed), default=None)
        if ids and len(self.pushed) + len(ids) > self.heap.statistics().limit:
            # push compacts first (a push of no ids does nothing at all)
            self.pushed = [p for p in self.pushed if self.live(p)]
            earliest = min((p.deadline for p in self.pushed), default=None)
        wake = self.heap.push(deadline, self.ledgers[i], q, r, ids)
        for n in ids:
            self.pushed.append(Pushed(deadline, self.seq, (i, q, r, n)))
            self.seq += 1
        assert wake == bool(ids and (earliest is None or deadline < earliest))

    @rule(i=ledger_ix, q=queue, r=reader, n=item_id)
    def close(self, i: int, q: str, r: str, n: int) -> None:
        """A confirm or abort of one read (or of one that is not open)."""
        assert self.ledgers[i].remove(q, r, n) == ((i, q, r, n) in self.open)
        self.open.pop((i, q, r, n), None)

    @rule(i=ledger_ix, q=queue, r=st.none() | reader)
    def forget(self, i: int, q: str, r: str | None) -> None:
        """The queue (r None) or reader was deleted."""
        gone = [k for k in self.open if k[:2] == (i, q) and r in (None, k[2])]
        assert self.ledgers[i].forget(q, r) == len(gone)
        for k in gone:
            del self.open[k]

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.0]))
    def expire(self, dt: float) -> None:
        self.now += dt
        due = sorted((p for p in self.pushed if p.deadline <= self.now),
                     key=lambda p: (p.deadline, p.seq))
        want = []
        for p in due:
            if self.live(p):  # the first live entry of a read expires it; later ones are stale
                want.append((p.key, p.deadline))
                del self.open[p.key]
        self.pushed = [p for p in self.pushed if p.deadline > self.now]
        got = self.heap.pop_due(self.now)
        assert [((self.ledgers.index(t.reads), t.queue, t.reader, t.item_id), t.deadline)
                for t in got] == want

    @rule()
    def compact(self) -> None:
        live = [p for p in self.pushed if self.live(p)]
        assert self.heap.compact() == len(self.pushed) - len(live)
        self.pushed = live

    def pick(self, data: st.DataObject, count: int | None
             ) -> tuple[int, str, str, list[int] | None, list[int]]:
        """An open (ledger, queue, reader), the ids asked for (None: all) and what the
        model says `choose` picks of them: (ledger, queue, reader, asked, picked)."""
        i, q, r, _ = data.draw(st.sampled_from(sorted(self.open)))
        mine = [k[3] for k in self.open if k[:3] == (i, q, r)]
        asked = data.draw(st.none() | st.lists(item_id, max_size=5))
        want = mine if asked is None else [n for n in dict.fromkeys(asked) if n in mine]
        return i, q, r, asked, want if count is None else want[:count]

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data(), count=st.none() | st.integers(0, 3))
    def choose(self, data: st.DataObject, count: int | None) -> None:
        i, q, r, asked, want = self.pick(data, count)
        assert self.ledgers[i].choose(q, r, count, asked) == want

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data(), count=st.none() | st.integers(0, 3))
    def take(self, data: st.DataObject, count: int | None) -> None:
        """A confirm's bulk close: what `choose` picks, closed, with its deadlines."""
        i, q, r, asked, want = self.pick(data, count)
        taken = self.ledgers[i].take(q, r, count, asked)
        assert list(taken.items()) == [(n, self.open[(i, q, r, n)]) for n in want]
        for n in want:
            del self.open[(i, q, r, n)]

    @invariant()
    def ledgers_match(self) -> None:
        for i, ledger in enumerate(self.ledgers):
            mine = [k for k in self.open if k[0] == i]
            assert ledger.open_total == len(mine)
            assert set(ledger.open_keys()) == {k[1:3] for k in mine}
            assert ledger.statistics().open_total == len(mine)
            for q in QUEUES:
                for r in READERS:
                    assert ledger.open_ids(q, r) == [k[3] for k in mine if k[1:3] == (q, r)]

    @invariant()
    def heap_matches(self) -> None:
        assert len(self.heap) == len(self.pushed)
        assert self.heap.next_deadline() == min((p.deadline for p in self.pushed), default=None)
        # Every read with a deadline has an entry that will expire it.
        for key, deadline in self.open.items():
            if deadline is not None:
                assert any(p.key == key and p.deadline == deadline for p in self.pushed)


TestOpenReads = OpenReadsMachine.TestCase
TestOpenReads.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_due_reads_come_out_in_deadline_then_push_order() -> None:
    a, b = OpenReads("a"), OpenReads("b")
    heap = TimeoutHeap()
    for ledger, n, deadline in [(a, 1, 5.0), (b, 2, 3.0), (a, 3, 3.0), (b, 4, 9.0)]:
        ledger.add("q", "", n, deadline)
        heap.push(deadline, ledger, "q", "", [n])
    assert heap.pop_due(2.9) == []
    assert heap.pop_due(5.0) == [TimedOut(b, "q", "", 2, 3.0), TimedOut(a, "q", "", 3, 3.0),
                                 TimedOut(a, "q", "", 1, 5.0)]
    assert (a.open_total, b.open_ids("q", "")) == (0, [4])
    assert heap.next_deadline() == 9.0


def test_a_closed_read_never_times_out_even_if_reopened_later() -> None:
    c = OpenReads()
    heap = TimeoutHeap()
    c.add("q", "", 1, 1.0)
    heap.push(1.0, c, "q", "", [1])
    assert c.remove("q", "", 1)
    c.add("q", "", 1, 4.0)  # the same id open again, with a later deadline
    heap.push(4.0, c, "q", "", [1])
    assert heap.pop_due(2.0) == []
    assert c.open_ids("q", "") == [1]
    assert heap.pop_due(4.0) == [TimedOut(c, "q", "", 1, 4.0)]


def test_compaction_bounds_a_heap_of_closed_reads() -> None:
    c = OpenReads()
    heap = TimeoutHeap(min_size=100)
    for n in range(1, 10_001):  # a fast get/confirm loop
        c.add("q", "", n, 60.0)
        heap.push(60.0, c, "q", "", [n])
        c.remove("q", "", n)
    assert len(heap) <= 100
    assert heap.statistics().compactions > 0


def test_ledger_names_and_ids() -> None:
    first, second = OpenReads(), OpenReads("conn-7")
    assert second.id == first.id + 1
    assert first.name == f"client-{first.id}" and second.name == "conn-7"
    second.add("q", "", 1, None)
    assert second.open_total == 1
    second.add("q", "", 1, 2.0)  # already open: only its deadline moves
    assert second.open_total == 1 and second.holds("q", "", 1, 2.0)


