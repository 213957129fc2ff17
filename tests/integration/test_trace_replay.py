"""``kvpool bench trace`` against a real local cluster: the pool's hit rate matches the oracle's.

CI replays a prefix of the synthetic trace (``PREFIX`` requests, 1 KiB blocks): the acceptance lines are the
same as for the full trace, against the oracle computed on that prefix. The full trace (with eviction at 3 M
tokens of DRAM, and with the SSD tier) runs where ``KVPOOL_TEST_FULL_TRACE=1`` asks for it: it adds a minute and
a half to the suite and checks the same lines at full scale (its figures are in docs/trace-replay.md).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import pytest

from kvpool.tools import bench_trace_pool, cli
from kvpool.tools.trace import DEFAULT_TRACE

pytestmark = pytest.mark.integration

TRACE = DEFAULT_TRACE  # shipped in the repository: benchmarks/traces/
PREFIX = 1000


def bench(capsys: pytest.CaptureFixture[str], *extra: str, limit: int | None = PREFIX) -> dict[str, Any]:
    argv = ["--trace", str(TRACE), "--block-bytes", "1024", "--json", *extra]
    if limit is not None:
        argv += ["--limit-requests", str(limit)]
    parser = argparse.ArgumentParser()
    bench_trace_pool.add_arguments(parser)  # what `kvpool bench trace` parses
    assert bench_trace_pool.run(parser.parse_args(argv)) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert report["pool_backend"] == "local"
    assert report["pool_put_errors"] == 0
    return report


def test_kvpool_bench_trace_runs_the_real_pool() -> None:
    assert cli.BENCHES["trace"][0] == "kvpool.tools.bench_trace_pool"


def test_unlimited_capacity_pool_equals_the_oracle(capsys: pytest.CaptureFixture[str]) -> None:
    r = bench(capsys)
    assert r["pool_hit"] == pytest.approx(r["oracle_hit"], abs=0.002)
    assert r["pool_token_hit"] == pytest.approx(r["oracle_token_hit"], abs=0.002)
    assert r["pool_evictions"] == 0


def test_3m_tokens_random_routing_pool_is_within_a_point_of_the_oracle(
    capsys: pytest.CaptureFixture[str],
) -> None:
    r = bench(capsys, "--capacity", "3M", "--routing", "random", "--instances", "8")
    assert r["pool_evictions"] > 0  # the prefix's working set is well above 3 M tokens
    assert abs(r["pool_hit"] - r["oracle_hit"]) <= 0.01
    assert r["private_hit"] < r["pool_hit"]


def test_small_dram_with_an_ssd_tier_reaches_the_unlimited_hit_rate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ws_tokens = _working_set_tokens(PREFIX)
    r = bench(capsys, "--capacity", str(ws_tokens // 10), "--ssd")
    assert r["pool_demotions"] > 0
    assert r["pool_ssd_bytes"] > r["pool_dram_bytes"] * 5
    assert abs(r["pool_hit"] - r["oracle_unlimited_hit"]) <= 0.01
    assert r["oracle_hit"] < r["pool_hit"] - 0.05  # DRAM alone would not come close


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("KVPOOL_TEST_FULL_TRACE") != "1",
    reason="opt-in: KVPOOL_TEST_FULL_TRACE=1 replays the whole trace (the prefix tests run always)",
)
@pytest.mark.parametrize(
    "extra",
    [("--capacity", "3M"), ("--capacity", "2249000", "--ssd")],
    ids=["3M", "10pct-dram-ssd"],
)
def test_full_trace(capsys: pytest.CaptureFixture[str], extra: tuple[str, ...]) -> None:
    r = bench(capsys, *extra, limit=None)
    target = r["oracle_unlimited_hit"] if "--ssd" in extra else r["oracle_hit"]
    assert abs(r["pool_hit"] - target) <= 0.01


def _working_set_tokens(limit: int) -> int:
    from kvpool.tools.trace import load_trace

    trace = load_trace(TRACE, limit)
    return len({h for req in trace for h in req.hash_ids}) * 512
