"""The TCP transport's dealing of parts to lanes: the shortcut for equal parts on equally loaded lanes
picks what the least-loaded rule picks."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvpool.transfer.tcp_plan import _PART_OVERHEAD, _least_loaded


def _rule(sizes: list[int], loads: list[int]) -> list[int]:
    """The least-loaded rule itself, one search per part."""
    picks = []
    for n in sizes:
        i = loads.index(min(loads))
        loads[i] += n + _PART_OVERHEAD
        picks.append(i)
    return picks


@given(
    size=st.integers(0, 1 << 20),
    count=st.integers(0, 300),
    lanes=st.integers(1, 8),
    start=st.integers(0, 1 << 20),
    uneven=st.booleans(),
)
def test_dealing_picks_the_least_loaded_lane_for_every_part(
    size: int, count: int, lanes: int, start: int, uneven: bool
) -> None:
    sizes = [size] * count
    if uneven and count:
        sizes[-1] += 1
    loads = [start] * lanes
    if uneven:
        loads[0] += 1
    expected_loads = list(loads)
    expected = _rule(sizes, expected_loads)
    assert _least_loaded(sizes, loads) == expected
    assert loads == expected_loads
