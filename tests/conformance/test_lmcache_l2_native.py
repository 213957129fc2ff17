"""KvPoolL2Client as LMCache 0.5.6's multi-process-mode L2 storage, against a real local cluster.

The adapter is built the way LMCache builds it: its own ``NativePluginL2AdapterConfig.from_dict`` and
``create_l2_adapter_from_registry`` (which imports the class, checks the methods and wraps it in the real
``NativeConnectorL2Adapter`` with its demux thread). Chunks are LMCache's own ``TensorMemoryObj`` from its
``TensorMemoryAllocator``. Needs torch + lmcache (scripts/install-conformance-deps.sh): skipped without
them, failed under CI.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvpool.tools.local_cluster import LocalCluster
from tests.conformance.sglang_shim import require

pytestmark = [pytest.mark.conformance, pytest.mark.integration]

SHAPE = (2, 2, 16, 2, 8)  # KV_2LTD: K/V, layers, tokens, heads, dim (float32: 4 KiB a chunk)
MODULE = "kvpool.client.connectors.lmcache_native"


@pytest.fixture(scope="module")
def lm() -> SimpleNamespace:
    require("torch", "lmcache")
    import torch
    from lmcache.v1.distributed.api import ObjectKey  # type: ignore[import-not-found,import-untyped,unused-ignore]
    from lmcache.v1.distributed.l2_adapters.factory import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
        create_l2_adapter_from_registry,
    )
    from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
        NativeConnectorL2Adapter,
    )
    from lmcache.v1.distributed.l2_adapters.native_plugin_l2_adapter import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
        NativePluginL2AdapterConfig,
    )
    from lmcache.v1.memory_allocators.tensor_memory_allocator import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
        TensorMemoryAllocator,
    )
    from lmcache.v1.memory_management import MemoryFormat  # type: ignore[import-not-found,import-untyped,unused-ignore]

    return SimpleNamespace(
        torch=torch,
        ObjectKey=ObjectKey,
        create=create_l2_adapter_from_registry,
        Adapter=NativeConnectorL2Adapter,
        Config=NativePluginL2AdapterConfig,
        allocator=TensorMemoryAllocator(torch.empty(4 << 20, dtype=torch.uint8)),
        fmt=MemoryFormat.KV_2LTD,
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(stores=1, store_size="32MiB", base_dir=tmp_path_factory.mktemp("lmcache-l2"))
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture
def adapters(lm: SimpleNamespace) -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def make(master: str, **params: Any) -> Any:
        config = lm.Config.from_dict(
            {"module_path": MODULE, "class_name": "KvPoolL2Client", "adapter_params": {"master": master, **params}}
        )
        adapter = lm.create(config)
        made.append(adapter)
        return adapter

    try:
        yield make
    finally:
        for adapter in made:
            adapter.close()


def chunks(lm: SimpleNamespace, n: int, seed: int | None) -> list[Any]:
    gen = lm.torch.Generator().manual_seed(seed or 0)
    objs = []
    for _ in range(n):
        obj = lm.allocator.allocate(lm.torch.Size(SHAPE), lm.torch.float32, lm.fmt)
        obj.tensor.copy_(lm.torch.randn(SHAPE, generator=gen) if seed is not None else lm.torch.zeros(SHAPE))
        objs.append(obj)
    return objs


def free(objs: list[Any]) -> None:
    for obj in objs:
        obj.ref_count_down()


def keys(lm: SimpleNamespace, n: int, seed: int, salt: str = "") -> list[Any]:
    return [
        lm.ObjectKey(chunk_hash=f"{seed:08d}{i:08d}".encode(), model_name="tiny", kv_rank=0, cache_salt=salt)
        for i in range(n)
    ]


def result(poll: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Wait, with a deadline, for an asynchronous L2 task's result."""
    end = time.monotonic() + timeout
    while (got := poll()) is None:
        assert time.monotonic() < end, "the L2 task never completed"
        time.sleep(0.005)
    return got


def store(adapter: Any, ks: list[Any], objs: list[Any]) -> int:
    task = adapter.submit_store_task(ks, objs)
    return int(result(lambda: adapter.pop_completed_store_tasks().get(task)))


def lookup(adapter: Any, ks: list[Any]) -> list[bool]:
    task = adapter.submit_lookup_and_lock_task(ks, {})
    bitmap = result(lambda: adapter.query_lookup_and_lock_result(task))
    adapter.submit_unlock(ks)
    return [bitmap.test(i) for i in range(len(ks))]


def load(adapter: Any, ks: list[Any], objs: list[Any]) -> list[bool]:
    task = adapter.submit_load_task(ks, objs)
    bitmap = result(lambda: adapter.query_load_result(task))
    return [bitmap.test(i) for i in range(len(ks))]


def test_lmcache_builds_it_through_its_native_plugin_factory(
    lm: SimpleNamespace, cluster: LocalCluster, adapters: Callable[..., Any]
) -> None:
    adapter = adapters(cluster.master)
    assert isinstance(adapter, lm.Adapter)
    assert type(adapter._client).__name__ == "KvPoolL2Client"


def test_chunks_round_trip_between_two_adapters(
    lm: SimpleNamespace, cluster: LocalCluster, adapters: Callable[..., Any]
) -> None:
    writer, reader = adapters(cluster.master), adapters(cluster.master)
    ks = keys(lm, 3, seed=1)
    src, dst = chunks(lm, 3, seed=1), chunks(lm, 3, seed=None)
    try:
        assert store(writer, ks, src) == 3 * src[0].get_size()  # LMCache counts the bytes stored
        missing = keys(lm, 1, seed=2)
        assert lookup(reader, [*ks, *missing]) == [True, True, True, False]
        assert load(reader, ks, dst) == [True] * 3
        assert all(lm.torch.equal(a.tensor, b.tensor) for a, b in zip(src, dst, strict=True))
        assert load(reader, missing, dst[:1]) == [False]
        # the same key with another cache salt is another object
        assert lookup(reader, keys(lm, 1, seed=1, salt="tenant-2")) == [False]
    finally:
        free(src + dst)


def test_lmcache_eviction_deletes_unread_chunks(
    lm: SimpleNamespace, cluster: LocalCluster, adapters: Callable[..., Any]
) -> None:
    adapter = adapters(cluster.master)
    ks = keys(lm, 2, seed=5)
    src = chunks(lm, 2, seed=5)
    try:
        assert store(adapter, ks, src) > 0
        adapter.delete(ks[:1])  # LMCache's L2 eviction (a chunk under a read lease stays until it ends)
        assert lookup(adapter, ks) == [False, True]
    finally:
        free(src)


def test_tags_separate_deployments(lm: SimpleNamespace, cluster: LocalCluster, adapters: Callable[..., Any]) -> None:
    blue, green = adapters(cluster.master, tag="blue"), adapters(cluster.master, tag="green")
    ks = keys(lm, 2, seed=3)
    src = chunks(lm, 2, seed=3)
    try:
        assert store(blue, ks, src) > 0
        assert lookup(green, ks) == [False, False]
        assert lookup(blue, ks) == [True, True]
    finally:
        free(src)


def test_a_dead_pool_completes_every_task_as_failed_without_raising(
    lm: SimpleNamespace, adapters: Callable[..., Any]
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    adapter = adapters(f"127.0.0.1:{port}", timeout_s=1, lookup_timeout_s=0.3)
    ks = keys(lm, 2, seed=4)
    src = chunks(lm, 2, seed=4)
    try:
        start = time.monotonic()
        assert store(adapter, ks, src) < 0  # L2StoreResult: -1 is a failure
        assert lookup(adapter, ks) == [False, False]
        assert load(adapter, ks, src) == [False, False]
        assert time.monotonic() - start < 15
    finally:
        free(src)
