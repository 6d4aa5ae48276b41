"""Who may do what (queued.wire.access), pure: every protocol-neutral command needs a known
permission on a known queue, and a grant's patterns match queue names and fanout names
("q+r" counts as q). Logins and refusals over the wire: test_security.py."""

from __future__ import annotations

from queued.wire import commands as c
from queued.wire.access import ANONYMOUS, Grant, Permission, needed


def test_every_command_needs_a_known_permission() -> None:
    examples: list[c.Command] = [
        c.Put("q", [b"x"]), c.Get("q"), c.Peek("q"), c.Confirm("q"), c.Abort("q"),
        c.Flush("q"), c.FlushAll(), c.FlushExpired("q"), c.FlushAllExpired(), c.Delete("q"),
        c.Stats(), c.Stats(dump=True), c.Version(), c.Reload(), c.Shutdown(), c.Quit(),
        c.Monitor("q", None, 10), c.Auth("u", "p"), c.Touch("q", None, 1000), c.Reject("q"),
        c.Browse("q"), c.Pause("q"), c.Move("q", None, "d"),
    ]
    kinds = {type(e) for e in examples}
    assert kinds == set(c.Command.__args__)  # type: ignore[attr-defined]  # every command
    wants = {type(e).__name__ + ("+dump" if getattr(e, "dump", False) else ""): needed(e)
             for e in examples}
    assert wants["Put"] == (Permission.PUT, "q")
    assert wants["Get"] == wants["Confirm"] == wants["Monitor"] == (Permission.GET, "q")
    assert wants["Touch"] == wants["Reject"] == wants["Browse"] == (Permission.GET, "q")
    assert wants["Pause"] == wants["Move"] == (Permission.ADMIN, "q")
    assert wants["Delete"] == (Permission.ADMIN, "q")
    assert wants["FlushAll"] == wants["Stats+dump"] == (Permission.ADMIN, None)
    assert wants["Stats"] is None and wants["Version"] is None and wants["Auth"] is None


def test_grant_patterns_and_fanout_names() -> None:
    g = Grant("alice", put=["orders", "jobs-*"], get=["orders"])
    assert g.denied(c.Put("orders", [b"x"])) is None
    assert g.denied(c.Put("jobs-eu", [b"x"])) is None
    assert g.denied(c.Get("orders", "audit")) is None  # reader of queue orders
    assert g.denied(c.Get("orders+audit")) is None  # the fanout name counts as its queue
    why = g.denied(c.Get("jobs-eu"))
    assert why == "permission denied: user 'alice' lacks 'get' on queue 'jobs-eu'"
    assert "'admin'" in (g.denied(c.FlushAll()) or "")
    assert g.denied(c.Put("Orders", [b"x"])) is not None  # case-sensitive
    assert ANONYMOUS.denied(c.Shutdown()) is None
