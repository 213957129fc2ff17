"""``spin_window``: how long a single small transfer polls grows with its bytes, within bounds."""

from __future__ import annotations

import pytest

from kvpool.transfer.tcp import spin_window

BASE = 50e-6


def test_small_requests_poll_the_base_window() -> None:
    assert spin_window(BASE, 0) == BASE
    assert spin_window(BASE, 100) == pytest.approx(BASE + 100e-9)


def test_the_window_grows_a_microsecond_per_kilobyte_up_to_four_times_the_base() -> None:
    assert spin_window(BASE, 64 * 1024) == pytest.approx(BASE + 65.536e-6)
    assert spin_window(BASE, 256 * 1024) == pytest.approx(4 * BASE)  # 312 us, capped at 200


def test_past_the_polling_limit_the_base_stays() -> None:
    assert spin_window(BASE, 256 * 1024 + 1) == BASE
    assert spin_window(BASE, 4 << 20) == BASE


def test_no_polling_stays_no_polling() -> None:
    assert spin_window(0.0, 64 * 1024) == 0.0
