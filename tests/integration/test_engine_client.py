"""EngineClient against a real local cluster: prefix lookups, prefetch policies, cancel safety, partial
(prefix) results, write-back back-pressure and degraded mode with a killed master."""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from kvpool.client.engine import EndReason, EngineClient, PrefetchHandle
from kvpool.client.pool_client import PoolClient
from kvpool.common.keys import Namespace
from kvpool.tools.local_cluster import LocalCluster
from tests.support.cluster import FAST_MASTER, client, wait_for

pytestmark = pytest.mark.integration

PAGE_TOKENS = 16
OBJ = 64 * 1024  # bytes of one page object (MHA: a page is a k and a v object)
SENTINEL = 0xEE


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(stores=2, store_size="96MiB", base_dir=tmp_path_factory.mktemp("engine"), master_args=FAST_MASTER)
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture
def pool(cluster: LocalCluster) -> Iterator[PoolClient]:
    with client(cluster.master) as p:
        yield p


def engine_for(pool: PoolClient, model: str, **kwargs: object) -> EngineClient:
    # A generous lookup deadline: CI machines are loaded, and a dead master is refused at once anyway.
    kwargs.setdefault("lookup_timeout_s", 2.0)
    return EngineClient(pool, Namespace(model=model), page_size=PAGE_TOKENS, page_bytes=OBJ, **kwargs)  # type: ignore[arg-type]


def prompt(n_pages: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(n_pages * PAGE_TOKENS)]


def seed_pages(engine: EngineClient, keys: list[str]) -> list[bytes]:
    """Write the pages through the engine's own write-back; returns the object values in order."""
    values = [os.urandom(OBJ) for _ in range(len(keys) * engine.objects_per_page)]
    done_before = engine.metrics()["writeback_done"]
    assert engine.write_back(keys, values)
    assert engine.flush(timeout=20)
    assert engine.metrics()["writeback_done"] == done_before + 1, engine.last_writeback_error
    assert engine.prefix_length(keys, timeout=5) == len(keys), engine.metrics()
    return values


def sentinel_buffers(n: int) -> list[bytearray]:
    return [bytearray([SENTINEL]) * OBJ for _ in range(n)]


def untouched(buf: bytearray | memoryview) -> bool:
    return bytes(buf) == bytes([SENTINEL]) * OBJ


def quiesce(engine: EngineClient) -> None:
    """Wait until no I/O thread works on a prefetch any more (then nothing can write into buffers)."""
    wait_for(lambda: engine.metrics()["prefetch_in_flight"] == 0, 10, "the prefetch I/O to stop")


def assert_prefix_result(handle: PrefetchHandle, bufs: list[bytearray], values: list[bytes], per_page: int) -> int:
    """Pages [0, n) hold the pool's bytes, every later buffer is untouched: a partial result is a prefix."""
    n = handle.completed_pages()
    for i, buf in enumerate(bufs):
        if i < n * per_page:
            assert bytes(buf) == values[i], f"object {i} of a completed page is wrong"
        else:
            assert untouched(buf), f"object {i} beyond the {n} completed pages was written"
    return n


# ----------------------------------------------------------------------------------------- basics
def test_write_back_then_prefix_length_then_prefetch_round_trip(pool: PoolClient) -> None:
    with engine_for(pool, "rt") as engine:
        tokens = prompt(12, seed=1)
        keys = engine.page_keys(tokens + [1, 2, 3])  # a partial tail page gets no key
        assert len(keys) == 12
        assert engine.prefix_length(tokens) == 0
        values = seed_pages(engine, keys)
        assert engine.prefix_length(tokens) == 12
        assert engine.prefix_length(keys[:5]) == 5  # page hashes are accepted as well as tokens

        bufs = sentinel_buffers(len(values))
        handle = engine.prefetch(keys, bufs, deadline_s=5, policy="wait_complete")
        assert handle.wait(timeout=10) == 12
        assert handle.done()
        assert handle.end_reason is EndReason.COMPLETE
        assert [bytes(b) for b in bufs] == values
        m = engine.metrics()
        assert m["prefetch_pages"] == 12
        assert m["prefetch_bytes"] == 12 * 2 * OBJ
        assert m["writeback_done"] == 1
        assert m["writeback_dropped"] == 0


def test_a_missing_page_cuts_the_result_to_a_prefix(pool: PoolClient) -> None:
    with engine_for(pool, "holes") as engine:
        keys = engine.page_keys(prompt(16, seed=2))
        values = [os.urandom(OBJ) for _ in range(32)]
        present = [i for i in range(16) if i != 9]  # page 9 is missing
        objects = engine.object_keys([keys[i] for i in present])
        assert pool.batch_put_from(objects, [values[2 * i + j] for i in present for j in (0, 1)]) == [0] * 30
        assert engine.prefix_length(keys) == 9

        bufs = sentinel_buffers(32)
        handle = engine.prefetch(keys, bufs, deadline_s=5, policy="wait_complete")
        assert handle.wait(timeout=10) == 9
        assert handle.hit_pages() == 9
        quiesce(engine)
        assert assert_prefix_result(handle, bufs, values, 2) == 9


def test_prefetch_into_raw_pointers_and_mla_namespace(pool: PoolClient) -> None:
    engine = EngineClient(pool, Namespace(model="mla", mla=True), page_size=PAGE_TOKENS, page_bytes=OBJ)
    try:
        keys = engine.page_keys(prompt(6, seed=3))
        values = seed_pages(engine, keys)
        assert engine.objects_per_page == 1
        assert pool.batch_exists([f"mla_{k}__k" for k in keys]) == [1] * 6  # SGLang/Mooncake MLA naming
        host = (ctypes.c_char * (6 * OBJ))()  # like SGLang's host pool: one region, pointers into it
        base = ctypes.addressof(host)
        handle = engine.prefetch(
            keys,
            ([base + i * OBJ for i in range(6)], [OBJ] * 6),
            deadline_s=5,
            policy="wait_complete",
            hit_pages=6,
        )
        assert handle.wait(timeout=10) == 6
        assert bytes(host) == b"".join(values)
    finally:
        engine.close()


def test_a_destination_of_the_wrong_size_ends_the_prefetch_without_writing(pool: PoolClient) -> None:
    with engine_for(pool, "size") as engine:
        keys = engine.page_keys(prompt(2, seed=4))
        seed_pages(engine, keys)
        bufs = [bytearray(OBJ), bytearray(OBJ - 1), bytearray(OBJ), bytearray(OBJ)]
        handle = engine.prefetch(keys, bufs, deadline_s=5, policy="wait_complete")
        assert handle.wait(timeout=10) == 0
        assert handle.end_reason is EndReason.INVALID
        with pytest.raises(Exception, match="destinations"):
            engine.prefetch(keys, bufs[:3])


# ----------------------------------------------------------------------------------------- policies
def big_prefix(pool: PoolClient, model: str, pages: int = 96) -> tuple[EngineClient, list[str], list[bytes]]:
    # Small chunks so a prefetch takes many round trips: policies and cancels land mid-way.
    engine = engine_for(pool, model, chunk_bytes=2 * OBJ)
    keys = engine.page_keys(prompt(pages, seed=hash(model) % 1000))
    return engine, keys, seed_pages(engine, keys)


def test_best_effort_wait_returns_at_once_with_a_prefix_and_freezes_it(pool: PoolClient) -> None:
    engine, keys, values = big_prefix(pool, "best")
    try:
        bufs = sentinel_buffers(len(values))
        handle = engine.prefetch(keys, bufs, deadline_s=5, policy="best_effort", hit_pages=len(keys))
        start = time.monotonic()
        n = handle.wait(timeout=10)  # best_effort: never blocks on the transfer
        assert time.monotonic() - start < 0.05
        assert handle.done()
        assert handle.end_reason in (EndReason.COLLECTED, EndReason.COMPLETE)
        quiesce(engine)
        assert handle.completed_pages() == n
        assert assert_prefix_result(handle, bufs, values, 2) == n
    finally:
        engine.close()


def test_best_effort_keeps_fetching_in_the_background_until_collected(pool: PoolClient) -> None:
    engine, keys, values = big_prefix(pool, "background", pages=24)
    try:
        bufs = sentinel_buffers(len(values))
        handle = engine.prefetch(keys, bufs, deadline_s=10, policy="best_effort")
        wait_for(handle.done, 10, "the background fetch to finish")
        assert handle.wait() == 24
        assert [bytes(b) for b in bufs] == values
    finally:
        engine.close()


def test_timeout_policy_stops_at_its_deadline(pool: PoolClient) -> None:
    engine, keys, values = big_prefix(pool, "timeout")
    try:
        for deadline in (0.0005, 0.005, 0.02):
            bufs = sentinel_buffers(len(values))
            handle = engine.prefetch(keys, bufs, deadline_s=deadline, policy="timeout")
            n = handle.wait(timeout=10)
            assert time.monotonic() - handle.issued_at < deadline + 0.1
            assert handle.done()
            assert handle.end_reason in (EndReason.DEADLINE, EndReason.MISS, EndReason.COMPLETE)
            quiesce(engine)
            assert assert_prefix_result(handle, bufs, values, 2) == n
        # A read cut by our own deadline says nothing about the pages: they stay hits.
        assert engine.prefix_length(keys) == len(keys)
    finally:
        engine.close()


def test_wait_complete_waits_for_every_hit_page(pool: PoolClient) -> None:
    engine, keys, values = big_prefix(pool, "complete")
    try:
        bufs = sentinel_buffers(len(values))
        handle = engine.prefetch(keys, bufs, deadline_s=0.5, policy="wait_complete")
        # deadline_s bounds each round trip, not the whole prefetch: all pages arrive.
        assert handle.wait() == len(keys)
        assert [bytes(b) for b in bufs] == values
    finally:
        engine.close()


# ----------------------------------------------------------------------------------------- cancel
def arrived(handle: PrefetchHandle) -> bool:
    return handle.completed_pages() >= 1 or handle.done()


def test_no_byte_is_written_after_cancel(pool: PoolClient) -> None:
    """SGLang #31296: a prefetch aborted while the I/O thread still writes into freed host slots. Here the
    freed memory is reused at once with a new pattern: nothing may overwrite it after cancel()."""
    engine, keys, values = big_prefix(pool, "cancel")
    per_page = engine.objects_per_page
    try:
        for attempt in range(8):
            host = (ctypes.c_char * (len(values) * OBJ))()
            ctypes.memset(host, SENTINEL, len(host))
            base = ctypes.addressof(host)
            ptrs = [base + i * OBJ for i in range(len(values))]
            handle = engine.prefetch(keys, (ptrs, [OBJ] * len(values)), deadline_s=5, policy="wait_complete")
            if attempt % 2:  # cancel mid-way, after some pages arrived
                wait_for(partial(arrived, handle), 10, "a first page")
            n = handle.cancel()
            assert handle.done()
            assert handle.completed_pages() == n
            ctypes.memset(base + n * per_page * OBJ, 0x11, len(host) - n * per_page * OBJ)  # reuse
            quiesce(engine)
            assert bytes(host)[: n * per_page * OBJ] == b"".join(values[: n * per_page])
            assert bytes(host)[n * per_page * OBJ :] == b"\x11" * (len(host) - n * per_page * OBJ)
        assert engine.metrics()["prefetch_cancelled"] >= 1
    finally:
        engine.close()


def test_close_ends_open_prefetches(pool: PoolClient) -> None:
    engine, keys, values = big_prefix(pool, "close")
    bufs = sentinel_buffers(len(values))
    handle = engine.prefetch(keys, bufs, deadline_s=5, policy="wait_complete")
    engine.close()
    assert handle.done()
    n = handle.completed_pages()
    assert handle.end_reason in (EndReason.CLOSED, EndReason.COMPLETE)
    assert assert_prefix_result(handle, bufs, values, 2) == n
    late = engine.prefetch(keys, sentinel_buffers(len(values)), deadline_s=5)
    assert late.done()
    assert late.completed_pages() == 0


# ----------------------------------------------------------------------------------------- write-back
def test_write_back_is_dropped_not_stalled_under_back_pressure(pool: PoolClient) -> None:
    page_pair = 2 * OBJ
    gate = threading.Event()
    with engine_for(pool, "pressure", max_writeback_bytes=2 * page_pair, io_threads=1) as engine:
        keys = engine.page_keys(prompt(4, seed=5))
        first = [os.urandom(OBJ) for _ in range(4)]
        # The first write-back holds the single I/O thread (its callback waits on the gate), so its
        # bytes stay queued: the queue is full.
        assert engine.write_back(keys[:2], first, on_done=lambda ok: gate.wait(10))
        start = time.monotonic()
        assert engine.write_back(keys[2:3], [os.urandom(OBJ), os.urandom(OBJ)]) is False
        assert time.monotonic() - start < 0.05  # dropped at once: no stall
        m = engine.metrics()
        assert m["writeback_dropped"] == 1
        assert m["writeback_dropped_bytes"] == page_pair
        assert m["writeback_queue_bytes"] == 2 * page_pair
        gate.set()
        assert engine.flush(timeout=10)
        assert engine.metrics()["writeback_queue_bytes"] == 0
        assert engine.prefix_length(keys) == 2  # the first landed, the dropped one did not
        assert engine.write_back(keys[2:3], [os.urandom(OBJ), os.urandom(OBJ)])  # room again
        assert engine.flush(timeout=10)
        assert engine.prefix_length(keys) == 3


def test_write_back_copies_so_the_caller_may_reuse_its_buffers(pool: PoolClient) -> None:
    with engine_for(pool, "copy") as engine:
        keys = engine.page_keys(prompt(1, seed=6))
        bufs = [bytearray(os.urandom(OBJ)) for _ in range(2)]
        want = [bytes(b) for b in bufs]
        done = threading.Event()
        assert engine.write_back(keys, bufs, on_done=lambda ok: done.set())
        for b in bufs:
            b[:] = b"\0" * OBJ
        assert done.wait(10)
        assert engine.flush(10)
        assert pool.batch_get(engine.object_keys(keys)) == want


# ----------------------------------------------------------------------------------------- degraded
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_degraded_mode_with_a_killed_master_and_recovery(tmp_path: Path) -> None:
    # A fixed gRPC port: the restarted master is found at the same address by the client and the stores.
    cluster = LocalCluster(
        stores=1,
        store_size="64MiB",
        base_dir=tmp_path,
        master_args=(*FAST_MASTER, "--port", str(free_port())),
    )
    try:
        cluster.start()
        with client(cluster.master) as pool, engine_for(pool, "degraded") as engine:
            keys = engine.page_keys(prompt(8, seed=7))
            values = seed_pages(engine, keys)
            assert engine.prefix_length(keys) == 8, engine.metrics()

            master = cluster.masters[0]
            cluster.kill(master)
            for _ in range(20):  # every call returns misses fast; the breaker stops the hammering
                start = time.monotonic()
                assert engine.prefix_length(keys) == 0
                handle = engine.prefetch(keys, sentinel_buffers(16), deadline_s=0.5, policy="timeout")
                assert handle.wait() == 0
                assert time.monotonic() - start < 0.5
            assert engine.write_back(keys[:1], values[:2])  # accepted; fails fast in the background
            assert engine.flush(timeout=5)
            m = engine.metrics()
            assert m["writeback_failed"] == 1
            assert m["pool_degraded_calls"] >= 1

            cluster.restart(master)  # rebuilds its index from the stores' re-mount inventories
            wait_for(lambda: engine.prefix_length(keys) == 8, 30, "hits after the master restart", interval=0.1)
            bufs = sentinel_buffers(16)
            assert engine.prefetch(keys, bufs, deadline_s=5, policy="wait_complete").wait(10) == 8
            assert [bytes(b) for b in bufs] == values
    finally:
        cluster.stop()


def test_a_dead_store_fails_reads_fast_and_the_negative_cache_stops_repeats(tmp_path: Path) -> None:
    cluster = LocalCluster(
        stores=1, store_size="64MiB", base_dir=tmp_path, master_args=("--store-ttl-s", "30")
    )  # the master keeps the dead store's entries
    try:
        cluster.start()
        with (
            client(cluster.master, timeout_s=2.0) as pool,
            engine_for(pool, "deadstore", negative_ttl_s=30) as engine,
        ):
            keys = engine.page_keys(prompt(4, seed=8))
            seed_pages(engine, keys)
            cluster.kill(cluster.stores[0])
            # the index still says "hit"
            assert pool.prefix_length(engine.object_keys(keys)) == 8, pool.metrics()
            start = time.monotonic()
            handle = engine.prefetch(keys, sentinel_buffers(8), deadline_s=2, policy="wait_complete")
            assert handle.wait(timeout=5) == 0
            assert handle.end_reason is EndReason.FAILED
            assert time.monotonic() - start < 2.5
            # The stale hit is not promised again: the lookup stops before the failed page (the negative
            # cache), or the master already suspects the dead store on the client's report and answers a
            # miss itself (decision 0026), whichever comes first.
            assert engine.prefix_length(keys) == 0
            master_says = pool.prefix_length(engine.object_keys(keys))
            assert engine.metrics()["negative_cache_hits"] >= 1 or master_says == 0
    finally:
        cluster.stop()
