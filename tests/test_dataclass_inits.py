"""The objects made per request and per item whose dataclass `__init__` is written out
(`init=False`: a compiled class compiles an `__init__` in its body, while the one
`dataclass` generates stays Python; docs/development.md "Compiled with mypyc"). Written by
hand, it must stay the one the dataclass would make: every field, in order, with the
field's default, each set as given. A field added to the class and not to its `__init__`
(or a default changed on one side only) fails here.

Pure Python only: the check reads the source's `__init__` signature, which a compiled
one does not expose (the compiled suite runs the same classes everywhere else).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
from compiled_util import not_compiled

from queued.broker import queues
from queued.journal import records
from queued.storage import journal, write_plans
from queued.wire import commands, memcache_protocol

WRITTEN_OUT: list[type[Any]] = [
    records.Put, records.DelayedPut, records.HeadedPut, records.Decoded,
    commands.Put, commands.Get, commands.Request, commands.Stored, commands.Items,
    commands.Count, memcache_protocol.Set,
    queues.Inflight, queues.PendingPut,
    write_plans.Chunk, write_plans.Written, write_plans.WriteResult,
    journal.Planned,
]


def init_fields(cls: type[Any]) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.init]


@not_compiled("a compiled __init__ has no Python signature to read")
@pytest.mark.parametrize("cls", WRITTEN_OUT, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_a_written_out_init_takes_the_fields_in_order_with_their_defaults(
    cls: type[Any],
) -> None:
    assert cls.__dataclass_params__.init is False, "the dataclass makes this one"
    assert "__init__" in vars(cls), "written out in the class itself"
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    fields = init_fields(cls)
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields, strict=True):
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, p
        if f.default is not dataclasses.MISSING:
            assert p.default == f.default and type(p.default) is type(f.default), (p, f)
        elif f.default_factory is not dataclasses.MISSING:
            assert p.default is None, f"{p}: None stands for a new {f.default_factory}"
        else:
            assert p.default is inspect.Parameter.empty, f"{p}: the field has no default"


@not_compiled("passes placeholder objects where a compiled class checks the types")
@pytest.mark.parametrize("cls", WRITTEN_OUT, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_a_written_out_init_sets_each_field_as_given(cls: type[Any]) -> None:
    given = {f.name: object() for f in init_fields(cls)}
    made = cls(**given)
    for name, value in given.items():
        assert getattr(made, name) is value, name
    # and as positional arguments, in the fields' order
    made = cls(*given.values())
    assert all(getattr(made, name) is value for name, value in given.items())


def test_the_defaults_are_the_dataclass_defaults() -> None:
    """Made with the required fields only (true types: this runs compiled too)."""
    put = records.Put(1, b"x", 5)
    assert (put.expire_time_ms, put.error_count, put.flags, put.headers) == (None, 0, 0, b"")
    delayed = records.DelayedPut(1, b"x", 5)
    assert (delayed.due_ms, delayed.headers, delayed.flags) == (0, b"", 0)
    assert records.HeadedPut(1, b"x", 5).headers == b""
    cmd = commands.Put("q", [b"x"])
    assert (cmd.ttl_ms, cmd.expire_at_ms, cmd.flags, cmd.delay_ms, cmd.producer, cmd.sequence,
            cmd.headers, cmd.key) == (None, None, 0, 0, None, 0, None, None)
    get = commands.Get("q")
    assert (get.reader, get.max_items, get.timeout_ms, get.open, get.close, get.abort,
            get.peek, get.open_timeout_ms, get.exclusive, get.line_safe, get.max_bytes,
            get.delay_ms, get.reject) == (None, 1, 0, False, False, False, False, None,
                                          False, False, 0, 0, False)
    first, second = journal.Planned(rotate=False), journal.Planned(rotate=False)
    assert first.tickets == [] and first.tickets is not second.tickets and first.marks == 0
