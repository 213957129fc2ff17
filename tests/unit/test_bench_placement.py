"""bench_placement: allocator utilisation and new-segment fill-up on the pure master (small, fast sizes)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvpool.tools import bench_placement as bp


def test_uniform_pages_use_at_least_95_percent_of_a_segment() -> None:
    for size in (4096, 100 * 1024, 160 * 1024 + 17):
        result = bp.utilisation("u", lambda _r, s=size: s, 16 << 20, rounds=3, seed=1)
        assert result.minimum >= 0.95, (size, result)
        assert result.failures == 3


def test_mixed_sizes_are_reported() -> None:
    result = bp.utilisation("m", lambda r: r.randint(1024, 256 * 1024), 16 << 20, rounds=3, seed=1)
    assert 0.5 < result.minimum <= result.mean <= 1.0


def test_a_new_segment_fills_faster_with_free_ratio_first_than_with_random() -> None:
    kwargs = {"segments": 3, "segment_size": 128 * 1024 * 64, "object_size": 64 * 1024, "tolerance": 0.05}
    free_first = bp.converge("free_ratio_first", seed=0, **kwargs)  # type: ignore[arg-type]
    rand = bp.converge("random", seed=0, **kwargs)  # type: ignore[arg-type]
    assert free_first.objects_written is not None
    assert rand.objects_written is None or rand.objects_written > 2 * free_first.objects_written
    assert abs(free_first.new_fraction - free_first.others_fraction) <= 0.05


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bp.add_arguments(parser)
    args = parser.parse_args(
        [
            "--segment-mib",
            "4",
            "--rounds",
            "2",
            "--segments",
            "2",
            "--objects-per-segment",
            "64",
            "--seeds",
            "1",
            "--json",
        ]
    )
    assert bp.run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["policy"] for c in doc["convergence"]] == ["free_ratio_first", "random"]
    assert len(doc["utilisation"]) == len(bp.UNIFORM_SIZES) + 2
