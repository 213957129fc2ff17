"""KvPoolHiCacheStorage driven the way SGLang 0.5.23 drives a dynamic L3 backend, against a real cluster.

The backend is built by SGLang's own ``StorageBackendFactory.create_backend("dynamic", config, None)`` and
subclasses SGLang's real ``HiCacheStorage``; the host pool is a fake with the page_first layout and the
exact pointer arithmetic of SGLang's ``MHATokenToKVPoolHost.get_page_buffer_meta`` (a real host pool needs
a device pool). Needs torch + sglang (scripts/install-conformance-deps.sh): skipped without them, failed
under CI.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvpool.common.keys import page_keys
from kvpool.tools.local_cluster import LocalCluster
from tests.conformance.sglang_shim import install_light_sglang, require
from tests.support.cluster import client, wait_for

pytestmark = [pytest.mark.conformance, pytest.mark.integration]

PAGE = 64  # --page-size 64
Backends = Callable[..., Any]
LAYERS, HEADS, DIM = 4, 2, 32
MODULE = "kvpool.client.connectors.sglang"


@pytest.fixture(scope="module")
def sgl() -> SimpleNamespace:
    require("torch", "sglang")
    install_light_sglang()
    import torch
    from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-untyped]
        HiCacheStorage,
        HiCacheStorageConfig,
    )
    from sglang.srt.mem_cache.storage.backend_factory import (  # type: ignore[import-untyped]
        StorageBackendFactory,
    )

    return SimpleNamespace(
        torch=torch, HiCacheStorage=HiCacheStorage, Config=HiCacheStorageConfig, Factory=StorageBackendFactory
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(stores=2, store_size="64MiB", base_dir=tmp_path_factory.mktemp("sglang"))
    try:
        yield c.start()
    finally:
        c.stop()


class FakeHostPool:
    """SGLang's host KV pool, page_first layout, as the backend sees it (pool_host/mha.py, mla.py)."""

    def __init__(
        self, torch: Any, pages: int, mla: bool = False, seed: int | None = None, layout: str = "page_first"
    ) -> None:
        self.torch = torch
        self.page_size, self.layer_num, self.head_num, self.head_dim = PAGE, LAYERS, HEADS, DIM
        self.layout = layout
        self.dtype = torch.bfloat16
        self.size = pages * PAGE
        self.mla = mla
        if layout == "layer_first":  # MHA only here
            dims: tuple[int, ...] = (2, LAYERS, self.size, HEADS, DIM)
        else:
            dims = (self.size, LAYERS, 1, DIM) if mla else (2, self.size, LAYERS, HEADS, DIM)
        if seed is None:
            self.kv_buffer = torch.zeros(dims, dtype=self.dtype)
        else:
            self.kv_buffer = torch.randn(dims, generator=torch.Generator().manual_seed(seed)).to(self.dtype)

    def _token_bytes(self) -> int:
        return int(self.layer_num * (1 if self.mla else self.head_num) * self.head_dim * self.dtype.itemsize)

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        base, ptrs = self.kv_buffer.data_ptr(), []
        v_offset = self.size * self._token_bytes()
        for i in range(0, len(indices), self.page_size):
            k_ptr = base + int(indices[i]) * self._token_bytes()
            ptrs += [k_ptr] if self.mla else [k_ptr, k_ptr + v_offset]
        return ptrs, [self.page_size * self._token_bytes()] * len(ptrs)

    def _page(self, index: int) -> Any:
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index : index + PAGE]
        return self.kv_buffer[index : index + PAGE] if self.mla else self.kv_buffer[:, index : index + PAGE]

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        page = self._page(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> Any:
        return self.torch.zeros(self._page(0).shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        self._page(index)[...] = data_page.reshape(self._page(index).shape)

    def pages(self, first_slot_page: int, n: int) -> Any:
        """Host indices (token slots) of n pages starting at slot page ``first_slot_page``."""
        start = first_slot_page * PAGE
        return self.torch.arange(start, start + n * PAGE, dtype=self.torch.int64)

    def same_pages(self, other: FakeHostPool, mine: int, theirs: int, n: int) -> bool:
        t = self.torch
        return all(t.equal(self._page((mine + i) * PAGE), other._page((theirs + i) * PAGE)) for i in range(n))


def make_backend(
    sgl: SimpleNamespace,
    master: str,
    model: str = "org/model-a",
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    tp_lcm_size: int | None = None,
    should_split_heads: bool = False,
    **extra: Any,
) -> Any:
    config = sgl.Config(
        tp_rank=tp_rank,
        tp_size=tp_size,
        tp_lcm_size=tp_lcm_size,
        should_split_heads=should_split_heads,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=True,
        model_name=model,
        extra_config={
            "backend_name": "kvpool",
            "module_path": MODULE,
            "class_name": "KvPoolHiCacheStorage",
            "interface_v1": 1,
            "master": master,
            "timeout_s": 5,
            "lookup_timeout_s": 2,
            **extra,
        },
    )
    return sgl.Factory.create_backend("dynamic", config, None)


@pytest.fixture
def backends(sgl: SimpleNamespace, cluster: LocalCluster) -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def make(*args: Any, **kwargs: Any) -> Any:
        backend = make_backend(sgl, cluster.master, *args, **kwargs)
        made.append(backend)
        return backend

    try:
        yield make
    finally:
        for backend in made:
            backend.close()


def hashes(n: int, seed: int) -> list[str]:
    return page_keys([(seed * 1_000_003 + i) % 32_000 for i in range(n * PAGE)], PAGE)


# ----------------------------------------------------------------------------------------- factory
def test_the_factory_builds_a_real_hicache_storage(sgl: SimpleNamespace, backends: Backends) -> None:
    backend = backends()
    assert isinstance(backend, sgl.HiCacheStorage)
    assert type(backend).__module__ == MODULE
    assert not getattr(type(backend), "__abstractmethods__", set())
    backend.register_mem_pool_host(FakeHostPool(sgl.torch, 1))
    assert backend.namespace.prefix == "tp1_org-model-a_"


def test_client_tuning_comes_from_the_extra_config(backends: Backends) -> None:
    backend = backends(
        connections_per_store="2",
        lease_cache_entries=7,
        lease_renewal="false",
        use_shm="no",
        revalidate_reads="0",
        native_lanes="off",
    )
    cfg = backend.pool.config
    tuning = (
        cfg.connections_per_store,
        cfg.lease_cache_entries,
        cfg.lease_renewal,
        cfg.use_shm,
        cfg.revalidate_reads,
        cfg.native_lanes,
    )
    assert tuning == (2, 7, False, False, False, False)
    defaults = backends().pool.config
    assert (defaults.lease_renewal, defaults.revalidate_reads, defaults.native_lanes) == (True, True, True)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"connections_per_store": 0}, "connections_per_store must be >= 1"),
        ({"connections_per_store": "four"}, "connections_per_store='four' is not a whole number"),
        ({"timeout_s": "soon"}, "timeout_s='soon' is not a number"),
        ({"timeout_s": -1}, "timeout_s must be > 0"),
        ({"lookup_timeout_s": 0}, "lookup_timeout_s must be > 0"),
        ({"spin_us": -5}, "spin_us and lease_cache_entries must be >= 0"),
    ],
)
def test_a_bad_extra_config_value_stops_the_backend_with_its_key_named(
    sgl: SimpleNamespace, cluster: LocalCluster, extra: dict[str, Any], message: str
) -> None:
    """SGLang fails to start with the message: better than a pool that misbehaves later."""
    with pytest.raises(ValueError, match=f"kvpool extra_config.*{message}"):
        make_backend(sgl, cluster.master, **extra)


def test_unknown_extra_config_keys_are_named_in_a_warning(backends: Backends, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        backend = backends(conections_per_store=2)  # a typo: the default stays, and the log says so
    assert backend.pool.config.connections_per_store == 4
    warned = [r.getMessage() for r in caplog.records if "not kvpool's" in r.getMessage()]
    assert warned == ["kvpool: extra_config keys ['conections_per_store'] are not kvpool's and are ignored (a typo?)"]


# ----------------------------------------------------------------------------------------- zero copy
def test_zero_copy_round_trip_through_set_exists_get_v1(sgl: SimpleNamespace, backends: Backends) -> None:
    writer, reader = backends(), backends()
    src, dst = FakeHostPool(sgl.torch, 8, seed=1), FakeHostPool(sgl.torch, 8)
    writer.register_mem_pool_host(src)
    reader.register_mem_pool_host(dst)
    keys = hashes(6, seed=1)

    assert writer.batch_exists(keys) == 0
    assert writer.batch_set_v1(keys, src.pages(0, 6)) == [True] * 6
    assert reader.batch_exists(keys) == 6
    assert reader.batch_exists(keys + hashes(2, seed=99)) == 6  # the hit prefix, in pages
    assert reader.batch_get_v1(keys, dst.pages(2, 6)) == [True] * 6  # into other slots
    assert dst.same_pages(src, 2, 0, 6)

    puts = writer.pool.metrics()["puts"]
    assert writer.batch_set_v1(keys, src.pages(0, 6)) == [True] * 6  # existing pages count as written
    assert writer.pool.metrics()["puts"] == puts  # ... and are not written again
    stats = writer.get_stats()
    assert stats.backup_pgs == [6, 6]
    assert writer.get_stats().backup_pgs == []  # reset after each call, as Mooncake does
    assert reader.get_stats().prefetch_pgs == [6]


def test_a_missing_page_fails_only_from_there(sgl: SimpleNamespace, backends: Backends) -> None:
    backend = backends()
    src, dst = FakeHostPool(sgl.torch, 4, seed=2), FakeHostPool(sgl.torch, 4)
    backend.register_mem_pool_host(src)
    keys = hashes(4, seed=2)
    assert backend.batch_set_v1(keys[:2], src.pages(0, 2)) == [True, True]
    backend.register_mem_pool_host(dst)
    assert backend.batch_get_v1(keys, dst.pages(0, 4)) == [True, True, False, False]
    assert dst.same_pages(src, 0, 0, 2)


def test_mla_pages_are_written_once_by_the_writer_rank_and_shared(
    sgl: SimpleNamespace, backends: Backends, cluster: LocalCluster
) -> None:
    rank0, rank1 = (
        backends("org/mla", tp_rank=0, tp_size=2, mla=True),
        backends("org/mla", tp_rank=1, tp_size=2, mla=True),
    )
    src0, src1 = FakeHostPool(sgl.torch, 4, mla=True, seed=3), FakeHostPool(sgl.torch, 4, mla=True, seed=4)
    rank0.register_mem_pool_host(src0)
    rank1.register_mem_pool_host(src1)
    keys = hashes(4, seed=3)

    assert rank1.batch_set_v1(keys, src1.pages(0, 4)) == [True] * 4  # not the writer: a no-op
    assert rank1.batch_exists(keys) == 0
    assert rank0.batch_set_v1(keys, src0.pages(0, 4)) == [True] * 4
    assert rank1.batch_exists(keys) == 4
    dst = FakeHostPool(sgl.torch, 4, mla=True)
    rank1.register_mem_pool_host(dst)
    assert rank1.batch_get_v1(keys, dst.pages(0, 4)) == [True] * 4
    assert dst.same_pages(src0, 0, 0, 4)
    with client(cluster.master) as pool:  # one object per page, Mooncake's MLA naming
        assert pool.batch_exists([f"org-mla_{k}__k" for k in keys]) == [1] * 4
        assert pool.batch_exists([f"org-mla_{k}_1_k" for k in keys]) == [0] * 4


def test_clear_removes_this_models_pages_only(sgl: SimpleNamespace, backends: Backends) -> None:
    a, b, a_large = backends("org/model_a"), backends("org/model_b"), backends("org/model_a_large")
    keys = hashes(3, seed=5)
    for backend, seed in ((a, 5), (b, 6), (a_large, 7)):
        host = FakeHostPool(sgl.torch, 3, seed=seed)
        backend.register_mem_pool_host(host)
        assert backend.batch_set_v1(keys, host.pages(0, 3)) == [True] * 3
    a.clear()
    assert a.batch_exists(keys) == 0
    assert b.batch_exists(keys) == 3  # another model's pages survive
    assert a_large.batch_exists(keys) == 3  # a model whose name starts like this one's survives too


# ----------------------------------------------------------------------------------------- legacy path
def test_legacy_get_set_batch_get_batch_set_exists(sgl: SimpleNamespace, backends: Backends) -> None:
    backend = backends("org/legacy")
    src, dst = FakeHostPool(sgl.torch, 4, seed=8), FakeHostPool(sgl.torch, 4)
    backend.register_mem_pool_host(src)
    keys = hashes(4, seed=8)

    assert backend.set(keys[0], src.get_data_page(0)) is True
    assert backend.exists(keys[0]) is True
    assert backend.exists(keys[1]) is False
    assert backend.batch_set(keys[1:3], [src.get_data_page(PAGE), src.get_data_page(2 * PAGE)]) is True
    assert backend.batch_exists(keys) == 3

    got = backend.get(keys[0], dst.get_dummy_flat_data_page())
    assert got is not None
    dst.set_from_flat_data_page(0, got)
    pages = backend.batch_get(keys, [dst.get_dummy_flat_data_page() for _ in keys])
    assert [p is not None for p in pages] == [True, True, True, False]
    for i in (1, 2):
        dst.set_from_flat_data_page(i * PAGE, pages[i])
    assert dst.same_pages(src, 0, 0, 3)
    assert backend.batch_get(keys[:1])[0] is not None  # targets from the host pool when none given

    # The flat page is [K | V], stored as the same _k/_v objects the zero-copy path uses.
    v1 = FakeHostPool(sgl.torch, 4)
    backend.register_mem_pool_host(v1)
    assert backend.batch_get_v1(keys[:3], v1.pages(0, 3)) == [True] * 3
    assert v1.same_pages(src, 0, 0, 3)


def test_layer_first_layout_goes_through_flat_pages_under_its_own_keys(
    sgl: SimpleNamespace, backends: Backends
) -> None:
    lf, pf = backends("org/layouts"), backends("org/layouts")
    src, dst = (
        FakeHostPool(sgl.torch, 3, seed=13, layout="layer_first"),
        FakeHostPool(sgl.torch, 3, layout="layer_first"),
    )
    lf.register_mem_pool_host(src)
    pf.register_mem_pool_host(FakeHostPool(sgl.torch, 3))
    assert "layer-first" in lf.namespace.prefix
    keys = hashes(3, seed=13)
    assert lf.batch_set_v1(keys, src.pages(0, 3)) == [True] * 3
    assert pf.batch_exists(keys) == 0  # other byte order: never mixed with page_first pages
    lf.register_mem_pool_host(dst)
    assert lf.batch_get_v1(keys, dst.pages(0, 3)) == [True] * 3
    assert dst.same_pages(src, 0, 0, 3)


# ----------------------------------------------------------------------------------------- threads
def test_concurrent_calls_from_sglangs_threads(sgl: SimpleNamespace, backends: Backends) -> None:
    backend = backends("org/threads")
    src = FakeHostPool(sgl.torch, 32, seed=9)
    backend.register_mem_pool_host(src)
    errors: list[str] = []

    def worker(t: int) -> None:
        keys = hashes(8, seed=100 + t)
        for _ in range(3):
            if backend.batch_set_v1(keys, src.pages(t * 8, 8)) != [True] * 8:
                errors.append(f"set {t}")
            if backend.batch_exists(keys) != 8:
                errors.append(f"exists {t}")
            if backend.batch_get_v1(keys, src.pages(t * 8, 8)) != [True] * 8:
                errors.append(f"get {t}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors


def test_master_address_from_the_environment(
    sgl: SimpleNamespace, cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPOOL_MASTER", cluster.master)
    backend = make_backend(sgl, "")  # no "master" in the extra config
    try:
        backend.register_mem_pool_host(FakeHostPool(sgl.torch, 1))
        assert backend.batch_exists(hashes(1, seed=10)) == 0
        assert backend.pool.metrics()["degraded_calls"] == 0
    finally:
        backend.close()


# ----------------------------------------------------------------------------------------- degraded
def test_master_down_gives_fast_misses(sgl: SimpleNamespace, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = LocalCluster(stores=1, store_size="64MiB", base_dir=tmp_path, master_args=("--port", str(port)))
    try:
        cluster.start()
        backend = make_backend(sgl, cluster.master, "org/degraded", lookup_timeout_s=0.5)
        try:
            host = FakeHostPool(sgl.torch, 4, seed=11)
            backend.register_mem_pool_host(host)
            keys = hashes(4, seed=11)
            assert backend.batch_set_v1(keys, host.pages(0, 4)) == [True] * 4
            master = cluster.masters[0]
            cluster.kill(master)
            for _ in range(10):
                start = time.monotonic()
                assert backend.batch_exists(keys) == 0
                assert backend.batch_get_v1(keys, host.pages(0, 4)) == [False] * 4
                assert backend.batch_set_v1(hashes(1, seed=12), host.pages(0, 1)) == [False]
                assert time.monotonic() - start < 1.0
            cluster.restart(master)
            wait_for(lambda: backend.batch_exists(keys) == 4, 30, "the keys back after the store re-mounted")
        finally:
            backend.close()
    finally:
        cluster.stop()


def test_keys_follow_sglang_page_hashes() -> None:
    # The hashes the engine passes are SGLang's page chain (reference §1.6 vectors).
    assert page_keys(list(range(8)), 4) == [
        "baed642339816affb3fe8719792d0e4ce82f12db72b7373d244eaa65445800fe",
        "01414b052706d93bd0f1f1646c0e8ca2fa8ef5efd7bcc99f7a1cee8eb11ad052",
    ]


# ---------------------------------------------------------------------------------- v2: hybrid models
class FakeSidePool:
    """A hybrid model's side host pool (Mamba state, DSA indexer) as the v2 calls see it: its own slots,
    ``page_size`` tokens per page, and ``parts`` objects per page from ``get_page_buffer_meta``."""

    def __init__(self, torch: Any, slots: int, page_size: int, row_bytes: int, parts: int, seed: int) -> None:
        self.torch = torch
        self.page_size = page_size
        self.parts = parts
        self.row_bytes = row_bytes
        self.buffers = [
            torch.randint(
                0, 255, (slots, row_bytes), generator=torch.Generator().manual_seed(seed + j), dtype=torch.uint8
            )
            for j in range(parts)
        ]

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        ptrs: list[int] = []
        for i in range(0, len(indices), self.page_size):
            slot = int(indices[i])
            ptrs += [b.data_ptr() + slot * self.row_bytes for b in self.buffers]
        return ptrs, [self.page_size * self.row_bytes] * len(ptrs)

    def slots(self, first: int, pages: int) -> Any:
        return self.torch.arange(first * self.page_size, (first + pages) * self.page_size, dtype=self.torch.int64)

    def rows(self, first: int, pages: int) -> list[Any]:
        span = slice(first * self.page_size, (first + pages) * self.page_size)
        return [b[span].clone() for b in self.buffers]


def hybrid_backend(sgl: SimpleNamespace, backends: Backends, seed: int | None, model: str) -> tuple[Any, Any, Any, Any]:
    from sglang.srt.mem_cache.hicache_storage import PoolName  # type: ignore[import-untyped]

    backend = backends(model)
    kv = FakeHostPool(sgl.torch, 8, seed=seed)
    mamba = FakeSidePool(sgl.torch, 8, 1, 96, parts=2, seed=seed or 0)  # temporal + conv state, one slot a page
    indexer = FakeSidePool(sgl.torch, 8 * PAGE, PAGE, 8, parts=1, seed=(seed or 0) + 100)
    if seed is None:
        for b in (*mamba.buffers, *indexer.buffers):
            b.zero_()
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    backend.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
    return backend, kv, mamba, indexer


def test_v2_hybrid_pages_round_trip_with_their_side_pools(sgl: SimpleNamespace, backends: Backends) -> None:
    from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-untyped]
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
        PoolTransferResult,
    )

    keys = hashes(4, seed=41)
    writer, kv, mamba, indexer = hybrid_backend(sgl, backends, seed=5, model="org/hybrid")
    written = writer.batch_set_v2(
        [
            PoolTransfer(PoolName.KV, host_indices=kv.pages(0, 4), keys=keys),
            # Mamba keeps the state of the last page only: TRAILING_PAGES with a one-page window
            PoolTransfer(
                PoolName.MAMBA, host_indices=mamba.slots(3, 1), keys=keys[3:], hit_policy=PoolHitPolicy.TRAILING_PAGES
            ),
            PoolTransfer(PoolName.INDEXER, host_indices=indexer.slots(0, 4), keys=keys),
        ]
    )
    assert written == {"kv": [True] * 4, "mamba": [True], "indexer": [True] * 4}

    reader, kv2, mamba2, indexer2 = hybrid_backend(sgl, backends, seed=None, model="org/hybrid")
    probe = [
        PoolTransfer(PoolName.MAMBA, keys=keys[3:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
        PoolTransfer(PoolName.INDEXER, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES),
    ]
    found = reader.batch_exists_v2([*keys, *hashes(1, seed=42)], probe)
    assert isinstance(found, PoolTransferResult)
    # KV holds 4 pages; the Mamba state exists only at page 4's boundary, so 4 is the one stop point.
    assert found.kv_hit_pages == 4
    assert found.restorable_prefix_pages == [4]
    assert found.extra_pool_hit_pages == {"kv": 4, "mamba": 4, "indexer": 4}

    got = reader.batch_get_v2(
        [
            PoolTransfer(PoolName.KV, host_indices=kv2.pages(2, 4), keys=keys),
            PoolTransfer(PoolName.MAMBA, host_indices=mamba2.slots(6, 1), keys=keys[3:]),
            PoolTransfer(PoolName.INDEXER, host_indices=indexer2.slots(1, 4), keys=keys),
        ]
    )
    assert got == {"kv": [True] * 4, "mamba": [True], "indexer": [True] * 4}
    assert kv2.same_pages(kv, 2, 0, 4)
    assert all(sgl.torch.equal(a, b) for a, b in zip(mamba2.rows(6, 1), mamba.rows(3, 1), strict=True))
    assert all(sgl.torch.equal(a, b) for a, b in zip(indexer2.rows(1, 4), indexer.rows(0, 4), strict=True))


def test_v2_a_missing_side_page_cuts_the_prefix(sgl: SimpleNamespace, backends: Backends) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # type: ignore[import-untyped]

    keys = hashes(4, seed=43)
    writer, kv, mamba, indexer = hybrid_backend(sgl, backends, seed=6, model="org/hybrid-cut")
    # the indexer lacks page 2 (index 2): an ALL_PAGES pool stops the prefix before it
    writer.batch_set_v2(
        [
            PoolTransfer(PoolName.KV, host_indices=kv.pages(0, 4), keys=keys),
            PoolTransfer(PoolName.INDEXER, host_indices=indexer.slots(0, 2), keys=keys[:2]),
            PoolTransfer(PoolName.INDEXER, host_indices=indexer.slots(3, 1), keys=keys[3:]),
            PoolTransfer(PoolName.MAMBA, host_indices=mamba.slots(1, 1), keys=keys[1:2]),
        ]
    )
    found = writer.batch_exists_v2(
        keys, [PoolTransfer(PoolName.INDEXER, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)]
    )
    assert found.kv_hit_pages == 2
    assert found.restorable_prefix_pages == [1, 2]
    both = writer.batch_exists_v2(
        keys,
        [
            PoolTransfer(PoolName.INDEXER, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES),
            PoolTransfer(PoolName.MAMBA, keys=keys[3:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
        ],
    )
    # Mamba state exists at page 2's boundary only; with the indexer's [1, 2] that leaves 2.
    assert both.kv_hit_pages == 2
    assert both.restorable_prefix_pages == [2]
    # an unregistered or empty transfer fails its pages instead of raising
    assert writer.batch_get_v2([PoolTransfer(PoolName.SWA, host_indices=indexer.slots(0, 1), keys=keys[:1])]) == {
        "swa": [False]
    }


# ------------------------------------------------------------------------- mixed TP: tp_lcm_size
class FakePageHeadPool:
    """SGLang's MHA host pool with the page_head layout, ``[2, pages, heads, page, layers, dim]``, with the
    pointer arithmetic of ``get_page_buffer_meta`` and ``get_split_heads_page_buffer_meta`` (pool_host/mha.py)."""

    layout = "page_head"

    def __init__(self, torch: Any, pages: int, heads: int, data: Any = None) -> None:
        self.torch = torch
        self.page_size, self.layer_num, self.head_num, self.head_dim = PAGE, LAYERS, heads, DIM
        self.dtype = torch.bfloat16
        self.size = pages * PAGE
        dims = (2, pages, heads, PAGE, LAYERS, DIM)
        self.kv_buffer = data.contiguous() if data is not None else torch.zeros(dims, dtype=self.dtype)

    def _head_bytes(self) -> int:
        return int(self.page_size * self.layer_num * self.head_dim * self.dtype.itemsize)

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        base, v_offset = self.kv_buffer.data_ptr(), self.kv_buffer[0].numel() * self.dtype.itemsize
        ptrs: list[int] = []
        for i in range(0, len(indices), self.page_size):
            k = base + int(indices[i]) * self.head_num * self.layer_num * self.head_dim * self.dtype.itemsize
            ptrs += [k, k + v_offset]
        return ptrs, [self.head_num * self._head_bytes()] * len(ptrs)

    def get_split_heads_page_buffer_meta(self, indices: Any, split_factor: int) -> tuple[list[int], list[int]]:
        base, v_offset = self.kv_buffer.data_ptr(), self.kv_buffer[0].numel() * self.dtype.itemsize
        step = self.head_num // split_factor
        ptrs: list[int] = []
        for i in range(0, len(indices), self.page_size):
            page = base + int(indices[i]) * self.head_num * self.layer_num * self.head_dim * self.dtype.itemsize
            for head in range(0, self.head_num, step):
                k = page + head * self._head_bytes()
                ptrs += [k, k + v_offset]
        return ptrs, [step * self._head_bytes()] * len(ptrs)


def test_mixed_tp_instances_share_pages_through_tp_lcm_size(sgl: SimpleNamespace, backends: Backends) -> None:
    t = sgl.torch
    keys = hashes(3, seed=51)
    data = t.randn((2, 3, 2, PAGE, LAYERS, DIM), generator=t.Generator().manual_seed(9)).to(t.bfloat16)
    # TP2 rank 0 holds KV heads 0-1 of 4; with tp_lcm_size 4 it stores them as the shards of TP4 ranks 0, 1
    tp2 = backends("org/mixed", tp_rank=0, tp_size=2, tp_lcm_size=4, should_split_heads=True)
    tp2.register_mem_pool_host(FakePageHeadPool(t, 3, heads=2, data=data))
    assert tp2.batch_set_v1(keys, t.arange(0, 3 * PAGE)) == [True] * 3
    for rank in (0, 1):
        tp4 = backends("org/mixed", tp_rank=rank, tp_size=4, tp_lcm_size=4, should_split_heads=False)
        host = FakePageHeadPool(t, 3, heads=1)
        tp4.register_mem_pool_host(host)
        assert tp4.batch_exists(keys) == 3
        assert tp4.batch_get_v1(keys, t.arange(0, 3 * PAGE)) == [True] * 3
        assert t.equal(host.kv_buffer[:, :, 0], data[:, :, rank])  # its own head, from the TP2 writer
    # TP4 rank 2's heads were never written (they belong to TP2 rank 1): no false hit
    other = backends("org/mixed", tp_rank=2, tp_size=4, tp_lcm_size=4, should_split_heads=False)
    other.register_mem_pool_host(FakePageHeadPool(t, 3, heads=1))
    assert other.batch_exists(keys) == 0
