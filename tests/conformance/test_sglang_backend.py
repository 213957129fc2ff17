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
    **extra: Any,
) -> Any:
    config = sgl.Config(
        tp_rank=tp_rank,
        tp_size=tp_size,
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
