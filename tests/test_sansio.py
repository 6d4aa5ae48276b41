"""What every sans-IO parser and file format shares (queued.sansio), pure: the name rule
for queues and readers (they become file names) and the caps on timeouts and delays.
Each protocol's use of the rule: the test_wire_* files; the config's: test_config_keys.py."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queued import sansio


@given(st.text(max_size=260))
def test_a_name_is_valid_exactly_when_it_matches_the_file_name_pattern(name: str) -> None:
    want = re.fullmatch(r"[A-Za-z0-9_:-]{1,250}", name, re.ASCII) is not None
    assert sansio.is_valid_name(name) is want


@pytest.mark.parametrize("name", ["q", "a" * 250, "jobs:high-1_x", "0"])
def test_valid_names(name: str) -> None:
    assert sansio.is_valid_name(name)


@pytest.mark.parametrize("name", ["", "a" * 251, "q+r", "a/b", "..", "q.1", "é", "q\n",
                                  "\uff51", "q r", "\u0663"])
def test_names_that_would_not_be_safe_file_names_are_refused(name: str) -> None:
    assert not sansio.is_valid_name(name)


def test_caps_fit_what_kestrel_and_the_journal_can_hold() -> None:
    assert sansio.MAX_TIMEOUT_MS == 2**31 - 1  # a Java Int, as Kestrel parses timeouts
    assert sansio.MAX_DELAY_MS < 2**63 // 2  # a due time (now + delay) stays an i64
    assert sansio.MAX_DELAY_MS >= 10 * 365 * 24 * 3600 * 1000


def test_need_data_is_one_value() -> None:
    assert sansio.NEED_DATA is sansio.Signal.NEED_DATA
    assert sansio.NEED_DATA != "NEED_DATA"  # not a string a parser could return by accident
