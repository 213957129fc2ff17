"""tests/support/wait.py: the one wait of the test suite."""

from __future__ import annotations

import itertools

import pytest

from tests.support.wait import WaitTimeout, wait_for


def test_returns_once_the_condition_holds_and_reports_the_time_it_took() -> None:
    calls = itertools.count(1)
    took = wait_for(lambda: next(calls) >= 3, 5.0, "the third poll", interval=0.001)
    assert next(calls) == 4  # polled exactly until it held
    assert 0.0 <= took < 5.0


def test_a_condition_that_holds_at_once_is_polled_once() -> None:
    calls: list[int] = []
    wait_for(lambda: calls.append(1) or True, 5.0, "anything")
    assert calls == [1]


def test_a_timeout_names_what_it_waited_for_and_the_last_observed_value() -> None:
    polls = itertools.count(1)
    with pytest.raises(WaitTimeout) as raised:
        wait_for(lambda: next(polls) * 0, 0.05, "a miracle", interval=0.001)
    assert "a miracle" in str(raised.value)
    assert next(polls) > 2  # it kept polling until the deadline
    assert "last observed: 0" in str(raised.value)
    assert isinstance(raised.value, AssertionError)  # pytest shows it as a failed assertion


def test_the_last_observed_value_is_the_conditions_own() -> None:
    with pytest.raises(WaitTimeout, match=r"last observed: \[\]"):
        wait_for(list, 0.02, "a non-empty list", interval=0.001)


def test_exceptions_from_the_condition_propagate() -> None:
    def broken() -> bool:
        raise KeyError("boom")

    with pytest.raises(KeyError):
        wait_for(broken, 5.0, "never")
