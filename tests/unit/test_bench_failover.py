"""bench failover's pure helpers: the median recovery curve and the segment size of a scale run."""

from __future__ import annotations

from kvpool.tools.bench_failover import _median_curve, _scale_size, _value_of


def test_median_curve_holds_each_run_at_its_last_probe() -> None:
    fast = [[0.1, 0.0], [1.2, 1.0]]
    slow = [[0.1, 0.0], [1.1, 0.5], [2.3, 1.0]]
    never = [[0.2, 0.0], [2.4, 0.0]]
    curve = _median_curve([fast, slow, never], step=0.5)
    assert curve[0] == [0.0, 0.0]
    by_time = dict((t, f) for t, f in curve)
    assert by_time[1.0] == 0.0  # no run had read anything by 1.0 s
    assert by_time[1.5] == 0.5  # fast 1.0, slow 0.5, never 0.0
    assert by_time[2.5] == 1.0  # fast and slow complete
    assert curve[-1][0] >= 2.4
    assert _median_curve([]) == []


def test_scale_size_leaves_room_for_aligned_objects() -> None:
    assert _scale_size(1000, 512, 2) == "64MiB"  # the floor
    size_mib = int(_scale_size(1_000_000, 512, 2).removesuffix("MiB"))
    assert size_mib * (1 << 20) >= 1_000_000 * 512 // 2


def test_values_are_a_function_of_the_key() -> None:
    assert _value_of("a", 512) == _value_of("a", 512)
    assert _value_of("a", 512) != _value_of("b", 512)
    assert len(_value_of("a", 100)) == 100
