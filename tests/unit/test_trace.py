"""Trace loading, the LRU simulators (against the golden figures of the FAST'25 synthetic trace) and the
``bench trace`` driver with the in-memory pool."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvpool.tools import bench_trace
from kvpool.tools.bench_trace import (
    ERR_NO_SPACE,
    InMemoryLRUPool,
    PoolLike,
    block_key,
    block_value,
    parse_token_count,
    pool_capacity_bytes,
    replay_pool,
)
from kvpool.tools.trace import (
    DEFAULT_TRACE,
    BlockLRU,
    HitStats,
    PrefixRouter,
    RandomRouter,
    Request,
    RoundRobinRouter,
    TraceFormatError,
    capacity_blocks,
    iter_trace,
    load_trace,
    make_router,
    route_all,
    simulate_global,
    simulate_private,
)

M = 1_000_000


SYNTHETIC = DEFAULT_TRACE  # shipped in the repository: benchmarks/traces/ (README there: origin, licence)


@pytest.fixture(scope="module")
def synthetic() -> list[Request]:
    return load_trace(SYNTHETIC)


def _line(input_length: int, hash_ids: list[int], ts: int = 0) -> str:
    return json.dumps({"timestamp": ts, "input_length": input_length, "output_length": 1, "hash_ids": hash_ids})


def _req(hash_ids: list[int], input_length: int | None = None) -> Request:
    length = 512 * len(hash_ids) if input_length is None else input_length
    return Request(0, length, 1, tuple(hash_ids))


# ---------------------------------------------------------------------------------------------------- loading


def test_load_trace_parses_requests_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_line(1000, [0, 1]) + "\n\n" + _line(512, [0], ts=7) + "\n")
    reqs = load_trace(path)
    assert reqs == [Request(0, 1000, 1, (0, 1)), Request(7, 512, 1, (0,))]
    assert load_trace(path, limit=1) == reqs[:1]


def test_bad_json_line_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_line(512, [0]) + "\n" + _line(512, [1]) + "\n" + '{"timestamp": 1, "input_len\n')
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:3: invalid JSON") as info:
        load_trace(path)
    assert info.value.line_no == 3


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 512, "output_length": 1}', "missing field 'hash_ids'"),
        (
            '{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}',
            "'input_length' must be",
        ),
        ('{"timestamp": 0, "input_length": 512, "output_length": true, "hash_ids": [0]}', "'output_length'"),
        ('{"timestamp": "x", "input_length": 512, "output_length": 1, "hash_ids": [0]}', "'timestamp'"),
        (
            '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": ["a"]}',
            "list of non-negative",
        ),
        ('{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [0]}', "expected ceil"),
    ],
)
def test_invalid_request_names_the_line(tmp_path: Path, line: str, reason: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_line(512, [0]) + "\n" + line + "\n")
    with pytest.raises(TraceFormatError, match=r":2: ") as info:
        list(iter_trace(path))
    assert reason in str(info.value)


def test_tokens_in_prefix_weights_the_partial_last_block() -> None:
    req = _req([5, 6, 7], input_length=1100)
    assert [req.tokens_in_prefix(k) for k in range(4)] == [0, 512, 1024, 1100]


# ---------------------------------------------------------------------------------------------------- LRU


def test_block_lru_evicts_least_recently_used_first() -> None:
    lru: BlockLRU[int] = BlockLRU(3)
    lru.touch([1, 2, 3])
    lru.touch([1])  # 1 becomes the most recent
    assert list(lru) == [2, 3, 1]
    lru.touch([4])
    assert list(lru) == [3, 1, 4]
    assert lru.evictions == 1
    lru.touch([5, 6])
    assert list(lru) == [4, 5, 6]


def test_block_lru_prefix_length_stops_at_first_miss_and_does_not_touch() -> None:
    lru: BlockLRU[int] = BlockLRU(None)
    lru.touch([1, 2, 4])
    assert lru.prefix_length([1, 2, 3, 4]) == 2
    assert list(lru) == [1, 2, 4]
    assert lru.access([1, 9]) == 1
    assert list(lru) == [2, 4, 1, 9]


def test_block_lru_batch_larger_than_capacity_keeps_its_tail() -> None:
    lru: BlockLRU[int] = BlockLRU(2)
    lru.touch([1, 2, 3, 4, 5])
    assert list(lru) == [4, 5]
    empty: BlockLRU[int] = BlockLRU(0)
    empty.touch([1])
    assert len(empty) == 0
    with pytest.raises(ValueError, match="capacity_blocks"):
        BlockLRU(-1)


def test_capacity_blocks_rounds_down_per_instance() -> None:
    assert capacity_blocks(None, 8) is None
    assert capacity_blocks(10 * M) == 19531
    assert capacity_blocks(10 * M, 8) == 2441
    assert capacity_blocks(3 * M, 8) == 732


def test_hit_stats_rates() -> None:
    stats = HitStats()
    assert (stats.block_hit_rate, stats.token_hit_rate) == (0.0, 0.0)
    stats.record(_req([1, 2], input_length=600), 2)
    stats.record(_req([3, 4]), 1)
    assert (stats.blocks_hit, stats.blocks_total, stats.tokens_hit, stats.tokens_total) == (3, 4, 1112, 1624)
    assert stats.block_hit_rate == 0.75


# ---------------------------------------------------------------------------------------------------- routing


def test_routers() -> None:
    reqs = [_req([i, 100 + i]) for i in range(50)]
    a = route_all(reqs, RandomRouter(8, seed=3))
    assert a == route_all(reqs, make_router("random", 8, seed=3))
    assert a != route_all(reqs, RandomRouter(8, seed=4))
    assert route_all(reqs[:5], RoundRobinRouter(2)) == [0, 1, 0, 1, 0]
    prefix = PrefixRouter(8)
    same_first = [_req([42, 1]), _req([42, 2, 3]), _req([42])]
    assert len({prefix.route(r) for r in same_first}) == 1
    assert len(set(route_all(reqs, prefix))) == 8  # 50 distinct first blocks spread over all instances
    assert prefix.route(_req([])) == 0
    with pytest.raises(ValueError, match="unknown routing"):
        make_router("sticky", 8)


# ---------------------------------------------------------------------------------------------------- golden


def _pct(rate: float) -> float:
    return 100 * rate


@pytest.mark.parametrize(
    ("capacity", "block_pct", "token_pct"),
    [(None, 64.0, 65.1), (10 * M, 56.6, 57.7), (3 * M, 30.9, 31.5)],
)
def test_global_lru_golden(synthetic: list[Request], capacity: int | None, block_pct: float, token_pct: float) -> None:
    stats = simulate_global(synthetic, capacity)
    assert stats.blocks_total == 121_877
    assert _pct(stats.block_hit_rate) == pytest.approx(block_pct, abs=0.05)
    assert _pct(stats.token_hit_rate) == pytest.approx(token_pct, abs=0.05)


@pytest.mark.parametrize(
    ("routing", "capacity", "block_pct"),
    [
        ("random", None, 22.7),
        ("random", 10 * M, 11.9),
        ("random", 3 * M, 4.6),
        ("prefix", None, 64.0),
        ("prefix", 10 * M, 56.1),
        ("prefix", 3 * M, 28.6),
    ],
)
def test_private_lru_golden(synthetic: list[Request], routing: str, capacity: int | None, block_pct: float) -> None:
    stats = simulate_private(synthetic, 8, capacity, routing, seed=0)
    assert _pct(stats.block_hit_rate) == pytest.approx(block_pct, abs=0.05)


def test_prefix_routing_unlimited_equals_global_exactly(synthetic: list[Request]) -> None:
    # Every request that can reuse a prefix meets its predecessors on one instance.
    assert simulate_private(synthetic, 8, None, "prefix") == simulate_global(synthetic, None)


# ---------------------------------------------------------------------------------------------------- driver


@pytest.mark.parametrize("capacity", [None, 3 * M])
def test_driver_with_in_memory_pool_equals_oracle(synthetic: list[Request], capacity: int | None) -> None:
    pool = InMemoryLRUPool(capacity_blocks(capacity))
    replay = replay_pool(synthetic, pool, run_tag="t", block_bytes=16)
    assert replay.stats == simulate_global(synthetic, capacity)
    assert replay.put_errors == 0


def test_driver_writes_blocks_after_the_hit_prefix_with_deterministic_values() -> None:
    pool = InMemoryLRUPool(None)
    replay = replay_pool([_req([1, 2]), _req([1, 2, 3])], pool, run_tag="r", block_bytes=40)
    assert replay.blocks_written == 3
    assert replay.stats.blocks_hit == 2
    value = pool.get(block_key("r", 3))
    assert value == block_value(3, 40)
    assert value is not None
    assert len(value) == 40
    assert block_value(3, 40) != block_value(4, 40)


class _FullPool:
    """A pool that refuses every write."""

    def prefix_length(self, keys: list[str]) -> int:
        return 0

    def batch_put(self, keys: list[str], values: list[bytes]) -> list[int]:
        return [ERR_NO_SPACE] * len(keys)


def test_driver_counts_put_errors_as_not_stored() -> None:
    pool: PoolLike = _FullPool()
    replay = replay_pool([_req([1, 2]), _req([1, 2])], pool, run_tag="r", block_bytes=8)
    assert (replay.stats.blocks_hit, replay.put_errors) == (0, 4)
    assert InMemoryLRUPool(0).batch_put(["k"], [b"v"]) == [ERR_NO_SPACE]


def test_sizing_helpers() -> None:
    assert pool_capacity_bytes(None, 4096) is None
    assert pool_capacity_bytes(3 * M, 4096) == 5859 * 4096
    assert [parse_token_count(s) for s in ("3000000", "3M", "10m", "500k", "1.5M")] == [
        3 * M,
        3 * M,
        10 * M,
        500_000,
        1_500_000,
    ]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_token_count("lots")


# ---------------------------------------------------------------------------------------------------- CLI


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_trace.add_arguments(parser)
    args = parser.parse_args(argv)
    args.master = None  # set by the top-level CLI
    return args


EXPECTED_KEYS = {
    "pool_hit",
    "private_hit",
    "oracle_hit",
    "pool_token_hit",
    "private_token_hit",
    "oracle_token_hit",
    "requests",
    "blocks",
    "instances",
    "routing",
    "capacity_tokens",
    "seconds",
    "block_bytes",
}


def test_run_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(["--trace", str(SYNTHETIC), "--limit-requests", "300", "--json", "--capacity", "3M"])
    assert bench_trace.run(args) == 0
    out, err = capsys.readouterr()
    assert out.count("\n") == 1
    report = json.loads(out)
    assert EXPECTED_KEYS <= report.keys()
    assert report["requests"] == 300
    assert report["capacity_tokens"] == 3 * M
    assert (report["instances"], report["routing"], report["block_bytes"]) == (8, "random", 4096)
    assert report["pool_hit"] == report["oracle_hit"]
    for key in EXPECTED_KEYS:
        if key.endswith("_hit"):
            assert 0.0 <= report[key] <= 1.0
    assert "100% (300/300)" in err


def test_run_uses_the_pool_factory_and_unlimited_is_null(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[argparse.Namespace] = []

    @contextmanager
    def factory(args: argparse.Namespace) -> Iterator[PoolLike]:
        seen.append(args)
        yield InMemoryLRUPool(capacity_blocks(args.capacity))

    args = _parse(["--trace", str(SYNTHETIC), "--limit-requests", "50", "--json", "--routing", "prefix"])
    assert bench_trace.run(args, factory) == 0
    report = json.loads(capsys.readouterr().out)
    assert seen == [args]
    assert report["capacity_tokens"] is None
    assert report["pool_backend"] == "local"


def test_run_reports_a_bad_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("not json\n")
    assert bench_trace.run(_parse(["--trace", str(path), "--json"])) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "bad.jsonl:1: invalid JSON" in err


def test_run_human_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(_line(1024, [0, i + 1]) for i in range(4)) + "\n")
    assert bench_trace.run(_parse(["--trace", str(path), "--instances", "2", "--routing", "round_robin"])) == 0
    out = capsys.readouterr().out
    assert "oracle (one global LRU)" in out
    assert "37.5%" in out  # 3 of 8 blocks: the shared first block of requests 2..4


def test_bench_trace_defaults_to_the_trace_shipped_in_the_repository() -> None:
    args = _parse([])
    assert Path(args.trace) == DEFAULT_TRACE
    assert DEFAULT_TRACE.is_file()
    assert (DEFAULT_TRACE.parent / "README.md").read_text().count("Apache License") == 1
