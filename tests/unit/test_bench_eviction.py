"""bench_eviction: put latency free vs full and the eviction work per freed object (small, fast sizes)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvpool.master.evictor import SAMPLE_WINDOW
from kvpool.tools import bench_eviction as be
from kvpool.tools import cli


def test_a_small_run_evicts_with_bounded_work_and_reports_both_phases(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    be.add_arguments(parser)
    args = parser.parse_args(["--objects", "4000", "--measure", "400", "--runs", "1", "--load", "0.5", "--json"])
    assert be.run(args) == 0
    [result] = json.loads(capsys.readouterr().out)["results"]
    assert result["mode"] == "sampled"
    assert result["evicted"] > 0  # the full phase did evict
    assert 0 < result["examined_per_freed"] <= 8 + SAMPLE_WINDOW  # eviction_sample_factor 8, one window more
    for name in ("free_p50_us", "free_p99_us", "full_p50_us", "full_p99_us", "p50_ratio", "p99_ratio"):
        assert result[name] > 0
    assert result["free_p50_us"] <= result["free_p99_us"]
    assert result["index_objects"] <= 4000 / 0.9  # what the pool holds: evicting kept it from overflowing


def test_the_closed_loop_puts_unpaced_and_no_put_is_refused_while_evicting() -> None:
    run = be.run_once(3000, 512, 8, 300, exact=False, load=0.0)  # raises if a put was refused
    assert run.offered_keys_per_s == 0  # unpaced
    assert run.evicted > 0
    assert run.free_keys_per_s > 0
    assert run.full_keys_per_s > 0
    assert 0 <= run.urgent_evictions <= 2 * 300 // 8  # at most one per timed put call of the full phase
    assert run.index_objects <= 3000 / 0.9


def test_exact_mode_examines_every_object_per_eviction() -> None:
    run = be.run_once(3000, 512, 8, 300, exact=True, load=0.5)
    assert run.evicted > 0
    assert run.examined_per_freed * run.evicted >= 2_700  # each eviction ranked the whole index (~2,700+)


def test_kvpool_bench_eviction_is_registered() -> None:
    assert cli.BENCHES["eviction"][0] == "kvpool.tools.bench_eviction"
