"""Batches of any size (client/batching.py): the client splits what the master's max_batch and request
size limits would refuse, keeps the answers in key order and returns the codes a small batch would."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from kvpool.common import failpoints
from kvpool.common.errors import ErrorCode
from kvpool.tools.local_cluster import LocalCluster
from tests.support.cluster import FAST_MASTER, client

pytestmark = pytest.mark.integration

VALUE_BYTES = 4096


def _values(n: int, seed: int) -> list[bytes]:
    """Distinct 4 KiB values: a key's own index and a seed at the front, so a value read into the wrong
    key's buffer shows; random bytes after."""
    noise = os.urandom(VALUE_BYTES)
    return [f"{seed}:{i}:".encode().ljust(32, b".") + noise[32:] for i in range(n)]


def test_a_batch_over_max_batch_is_split_in_order_with_small_batch_codes(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(
        stores=1, store_size="32MiB", master_args=(*FAST_MASTER, "--max-batch", "100", "--max-key-bytes", "64")
    )
    n = 1_050
    keys = [f"split-{i}" for i in range(n)]
    values = _values(n, 1)
    with client(cluster.master) as pool:
        # Every 7th key is too long: its own code, in its place, in every chunk.
        keys_with_bad = [("x" * 65 if i % 7 == 3 else k) for i, k in enumerate(keys)]
        codes = pool.batch_put_from(keys_with_bad, values)
        assert codes == [ErrorCode.KEY_TOO_LONG if i % 7 == 3 else 0 for i in range(n)]
        good = [k for i, k in enumerate(keys) if i % 7 != 3]
        assert pool.batch_exists(keys) == [0 if i % 7 == 3 else 1 for i in range(n)]
        assert pool.prefix_length(keys) == 3
        assert pool.prefix_length(good) == len(good)  # found across every chunk
        assert pool.prefix_length([*good, "absent", *good]) == len(good)
        got = pool.batch_get(keys)
        assert got == [None if i % 7 == 3 else values[i] for i in range(n)]
        buffers = [bytearray(VALUE_BYTES) for _ in keys]
        read = pool.batch_get_into(keys_with_bad, buffers)
        assert read == [ErrorCode.KEY_TOO_LONG if i % 7 == 3 else VALUE_BYTES for i in range(n)]
        assert all(bytes(buffers[i]) == values[i] for i in range(n) if i % 7 != 3)
        assert pool.batch_remove(good) == [ErrorCode.OBJECT_HAS_LEASE] * len(good)  # just read
        assert pool.batch_remove(good, force=True) == [0] * len(good)
        assert pool.batch_exists(good) == [0] * len(good)


def test_a_split_batch_shares_one_deadline(
    make_cluster: Callable[..., LocalCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks do not each get the whole timeout: with every chunk's put held 0.1 s (a failpoint before
    PutEnd), 200 chunks would take 5 s at four at a time; under one 0.5 s deadline the chunks that start
    after it fail at once, and the call ends soon after its deadline."""
    cluster = make_cluster(stores=1, store_size="32MiB", master_args=(*FAST_MASTER, "--max-batch", "10"))
    keys = [f"d-{i}" for i in range(2_000)]
    monkeypatch.setenv("KVPOOL_FAILPOINTS", "client.put.before_end=sleep:0.1")
    failpoints.reload()
    try:
        with client(cluster.master) as pool:
            assert pool.batch_exists(keys[:1]) == [0]  # connected: the deadline is spent on the puts
            started = time.monotonic()
            codes = pool.batch_put_from(keys, [b"v"] * len(keys), timeout=0.5)
            elapsed = time.monotonic() - started
    finally:
        monkeypatch.delenv("KVPOOL_FAILPOINTS")
        failpoints.reload()
    assert elapsed < 3.0, f"a 0.5 s call of 200 chunks took {elapsed:.1f} s"
    assert codes[:10] == [0] * 10  # the first chunks ran within the deadline
    assert set(codes[-100:]) <= {int(ErrorCode.TIMEOUT), int(ErrorCode.UNAVAILABLE)}


def test_mismatched_lengths_are_refused_before_any_split(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(stores=1, store_size="32MiB", master_args=(*FAST_MASTER, "--max-batch", "10"))
    from kvpool.common.errors import KvPoolError

    with client(cluster.master) as pool, pytest.raises(KvPoolError, match="INVALID_ARGUMENT"):
        pool.batch_put_from([f"m{i}" for i in range(30)], [b"v"] * 29)


@pytest.mark.parametrize("n", [10_000, 100_000])
def test_ten_and_a_hundred_thousand_keys_of_4kib_in_one_call_each(
    make_cluster: Callable[..., LocalCluster], n: int
) -> None:
    """The acceptance of issue 32: over the master's default max_batch (8,192), put and read back
    byte-identical, with both the zero-copy and the plain batch calls."""
    size = "96MiB" if n <= 10_000 else "900MiB"
    # The master's default timings: the tests' 2 s store TTL is too short for a store busy with 400 MB.
    cluster = make_cluster(stores=1, store_size=size, master_args=())
    keys = [f"big-{n}-{i}" for i in range(n)]
    values = _values(n, n)
    with client(cluster.master, timeout_s=120.0) as pool:
        half = n // 2
        assert pool.batch_put_from(keys[:half], values[:half]) == [0] * half
        assert pool.batch_put(keys[half:], values[half:]) == [0] * (n - half)
        buffers = [bytearray(VALUE_BYTES) for _ in range(n)]
        assert pool.batch_get_into(keys, buffers) == [VALUE_BYTES] * n
        assert all(bytes(b) == v for b, v in zip(buffers, values, strict=True))
        del buffers
        got = pool.batch_get(keys)
        assert all(g == v for g, v in zip(got, values, strict=True))
        assert pool.prefix_length(keys) == n
