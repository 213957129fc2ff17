"""How the client cuts a batch into calls the master accepts (client/batching.py)."""

from __future__ import annotations

from kvpool.client.batching import PER_KEY_OVERHEAD, limits_of, plan_chunks
from kvpool.proto import master_pb2 as pb


def test_chunks_cover_every_key_in_order_within_the_key_limit() -> None:
    keys = [f"k{i}" for i in range(10)]
    chunks = plan_chunks(keys, max_keys=4, max_key_bytes_total=10**6)
    assert chunks == [(0, 4), (4, 8), (8, 10)]


def test_chunks_respect_the_byte_budget_counting_utf8_bytes() -> None:
    wide = "\u00e9" * 10  # 20 UTF-8 bytes, 10 characters
    keys = [wide] * 5
    budget = 2 * (20 + PER_KEY_OVERHEAD)
    chunks = plan_chunks(keys, max_keys=100, max_key_bytes_total=budget)
    assert chunks == [(0, 2), (2, 4), (4, 5)]


def test_a_key_over_the_whole_budget_gets_a_chunk_of_its_own() -> None:
    keys = ["a", "x" * 1000, "b"]
    assert plan_chunks(keys, max_keys=100, max_key_bytes_total=100) == [(0, 1), (1, 2), (2, 3)]


def test_no_keys_no_chunks() -> None:
    assert plan_chunks([], 10, 100) == []


def test_limits_come_from_the_masters_cluster_info_or_its_defaults() -> None:
    assert limits_of(pb.ClusterInfoResponse(max_batch=100, max_key_bytes=64)) == (100, 100 * (64 + PER_KEY_OVERHEAD))
    assert limits_of(None) == (8192, 8192 * (512 + PER_KEY_OVERHEAD))
