"""The raw TCP ceiling (kvpool.tools.ceiling): its buffers start on a page boundary, so the ceiling is not
measured with the slow short-distance copy (ceiling.prefaulted), and it measures for real."""

from __future__ import annotations

import ctypes
import mmap

import pytest

from kvpool.tools import ceiling

pytestmark = pytest.mark.integration


def _page_offset(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % mmap.PAGESIZE


def test_page_aligned_buffers_are_filled_and_start_on_a_page() -> None:
    buf = ceiling.prefaulted(10_000, b"ab")
    assert _page_offset(buf) == 0
    assert buf == b"ab" * 5000


def test_the_ceiling_lands_every_answer_on_a_page_boundary() -> None:
    with ceiling.RawTcpPeer(1 << 20) as peer:
        assert _page_offset(peer._dest) == 0
        result = peer.measure(1 << 20, 0.05)
        assert result.requests > 0
        assert result.gbps > 0
        spread = peer.measure(1 << 20, 0.05, spread=True)
        assert spread.requests > 0
        assert peer._spread is not None
        assert _page_offset(peer._spread) == 0
