"""Every setting's key and how its raw value is parsed (queued.config.keys): sizes and
durations with their units, formatting back, the queue name rule, and parsers that raise
only ValueError, whatever they are given."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queued import config as cfg
from queued.config import (
    ConfigError,
    MiB,
    format_duration,
    format_size,
    keys,
    load_config,
    parse_duration,
    parse_size,
)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("100B", 100),
        ("64KiB", 64 * 1024),
        ("16MiB", 16 * MiB),
        ("1GiB", 1 << 30),
        ("2TiB", 2 << 40),
        ("10MB", 10_000_000),
        ("10mb", 10_000_000),
        ("3KB", 3000),
        ("1GB", 10**9),
        ("1TB", 10**12),
        ("512k", 512 * 1024),
        ("512K", 512 * 1024),
        ("2m", 2 * MiB),
        ("1g", 1 << 30),
        ("1.5GiB", 3 << 29),
        ("0.5KiB", 512),
        (" 7 MiB ", 7 * MiB),
    ],
)
def test_parse_size(text: object, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    "text", ["", "MiB", "1 2", "1PiB", "1.0.0", "-1", "0.1B", "1e3", True, None, 1.0, -1, 2**63]
)
def test_parse_size_errors(text: object) -> None:
    with pytest.raises(ValueError, match="expected a size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        (0, 0),
        (250, 250),
        ("250", 250),
        ("250ms", 250),
        ("30s", 30_000),
        ("5m", 300_000),
        ("1h", 3_600_000),
        ("1d", 86_400_000),
        ("1.5s", 1500),
        ("2H", 7_200_000),
    ],
)
def test_parse_duration(text: object, ms: int) -> None:
    assert parse_duration(text) == ms


@pytest.mark.parametrize("text", ["", "s", "1w", "0.5ms", "1h30m", "-1s", False, 1.5, [1]])
def test_parse_duration_errors(text: object) -> None:
    with pytest.raises(ValueError, match="expected a duration"):
        parse_duration(text)


@given(st.integers(0, cfg.MAX_INT))
def test_size_format_round_trip(size: int) -> None:
    text = format_size(size)
    assert parse_size(text) == size
    assert len(text) <= len(str(size)) + 3


@given(st.integers(0, cfg.MAX_INT))
def test_duration_format_round_trip(ms: int) -> None:
    assert parse_duration(format_duration(ms)) == ms


@given(
    st.integers(0, 10**6),
    st.sampled_from(sorted(keys.SIZE_UNITS.items())),
    st.sampled_from(["", " "]),
)
def test_size_units(amount: int, unit: tuple[str, int], space: str) -> None:
    name, scale = unit
    assert parse_size(f"{amount}{space}{name}") == amount * scale
    assert parse_size(f"{amount}{name.upper()}") == amount * scale


@given(st.integers(0, 10**6), st.sampled_from(sorted(keys.DURATION_UNITS.items())))
def test_duration_units(amount: int, unit: tuple[str, int]) -> None:
    name, scale = unit
    assert parse_duration(f"{amount}{name}") == amount * scale


@given(st.one_of(st.text(max_size=20), st.integers(), st.floats(), st.booleans(), st.none()))
def test_parsers_raise_only_value_error(value: object) -> None:
    for parse in (parse_size, parse_duration):
        try:
            result = parse(value)
        except ValueError as exc:
            assert str(exc).startswith("expected ")
        else:
            assert 0 <= result <= cfg.MAX_INT


@pytest.mark.parametrize("digits", [31, 5000])
def test_huge_numbers_are_plain_errors(digits: int) -> None:
    with pytest.raises(ValueError, match="expected a size"):
        parse_size("9" * digits + "MiB")
    with pytest.raises(ValueError, match="expected a duration"):
        parse_duration("9" * digits)
    with pytest.raises(ConfigError, match="QUEUED_MAX_LINE: expected a positive integer"):
        load_config(env={"QUEUED_MAX_LINE": "9" * digits})


@given(st.text(max_size=30))
def test_queue_name_rule_matches_regex(name: str) -> None:
    ok = re.fullmatch(r"[A-Za-z0-9_:-]{1,250}", name) is not None
    try:
        keys.parse_queue_name(name, False)
    except ValueError:
        assert not ok
    else:
        assert ok
