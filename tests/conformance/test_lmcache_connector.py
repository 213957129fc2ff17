"""KvPoolRemoteConnector loaded by LMCache 0.5.6's own plugin loader, against a real local cluster.

``CreateConnector("plugin://kvpool", ...)`` reads ``remote_storage_plugins`` and the module/class from the
extra config exactly as LMCache does in a vLLM process; the memory objects come from LMCache's real
``LocalCPUBackend``. Needs torch + lmcache (scripts/install-conformance-deps.sh): skipped without them,
failed under CI.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvpool.tools.local_cluster import LocalCluster
from tests.conformance.sglang_shim import require

pytestmark = [pytest.mark.conformance, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
CHUNK, LAYERS, HEADS, DIM = 16, 2, 2, 8


@pytest.fixture(scope="module")
def lm() -> SimpleNamespace:
    require("torch", "lmcache")
    import torch
    from lmcache.utils import CacheEngineKey  # type: ignore[import-not-found,import-untyped,unused-ignore]
    from lmcache.v1.config import LMCacheEngineConfig  # type: ignore[import-not-found,import-untyped,unused-ignore]
    from lmcache.v1.metadata import LMCacheMetadata  # type: ignore[import-not-found,import-untyped,unused-ignore]
    from lmcache.v1.storage_backend.connector import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
        CreateConnector,
    )
    from lmcache.v1.storage_backend.connector.base_connector import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
        RemoteConnector,
    )
    from lmcache.v1.storage_backend.local_cpu_backend import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
        LocalCPUBackend,
    )

    from kvpool.client.connectors.lmcache import KvPoolRemoteConnector

    return SimpleNamespace(
        torch=torch,
        Key=CacheEngineKey,
        Config=LMCacheEngineConfig,
        Metadata=LMCacheMetadata,
        CreateConnector=CreateConnector,
        RemoteConnector=RemoteConnector,
        LocalCPUBackend=LocalCPUBackend,
        Connector=KvPoolRemoteConnector,
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(stores=1, store_size="32MiB", base_dir=tmp_path_factory.mktemp("lmcache"))
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    ev = asyncio.new_event_loop()
    try:
        yield ev
    finally:
        ev.close()


def make_connector(lm: SimpleNamespace, loop: asyncio.AbstractEventLoop, master: str, **kvpool: Any) -> Any:
    config = lm.Config.from_dict(
        {
            "chunk_size": CHUNK,
            "local_cpu": True,
            "max_local_cpu_size": 0.05,
            "remote_url": "plugin://kvpool",
            "remote_serde": "naive",
            "remote_storage_plugins": ["kvpool"],
            "extra_config": {
                "remote_storage_plugin.kvpool.module_path": "kvpool.client.connectors.lmcache",
                "remote_storage_plugin.kvpool.class_name": "KvPoolRemoteConnector",
                "kvpool.master": master,
                **{f"kvpool.{k}": v for k, v in kvpool.items()},
            },
        }
    )
    metadata = lm.Metadata(
        model_name="tiny",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=lm.torch.float32,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, DIM),
        chunk_size=CHUNK,
    )
    backend = lm.LocalCPUBackend(config, metadata)
    return lm.CreateConnector(config.remote_url, loop, backend, config, metadata, plugin_name="kvpool")


def inner(connector: Any) -> Any:
    """The KvPoolRemoteConnector inside LMCache's instrumentation wrapper."""
    return getattr(connector, "_connector", connector)


def key(lm: SimpleNamespace, chunk_hash: int) -> Any:
    return lm.Key(model_name="tiny", world_size=1, worker_id=0, chunk_hash=chunk_hash, dtype=lm.torch.float32)


def chunk(lm: SimpleNamespace, conn: Any, seed: int, tokens: int = CHUNK) -> Any:
    obj = inner(conn).local_cpu_backend.allocate(inner(conn).meta_shapes, inner(conn).meta_dtypes, inner(conn).meta_fmt)
    gen = lm.torch.Generator().manual_seed(seed)
    obj.tensor.copy_(lm.torch.randn(obj.tensor.shape, generator=gen))
    if tokens < CHUNK:
        inner(conn).reshape_partial_chunk(obj, tokens * inner(conn).single_token_size)
    return obj


def test_module_imports_without_lmcache_and_the_constructor_names_it() -> None:
    code = (
        "import sys; sys.modules['lmcache'] = None\n"
        "import kvpool.client.connectors.lmcache as m\n"
        "try:\n    m.KvPoolRemoteConnector(None, None)\nexcept ImportError as e:\n    print('ERR', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "needs lmcache" in done.stdout


def test_signatures_match_the_remote_connector(lm: SimpleNamespace) -> None:
    assert issubclass(lm.Connector, lm.RemoteConnector)
    assert not inspect.isabstract(lm.Connector)
    for name in ("exists", "exists_sync", "get", "put", "batched_get", "batched_put", "batched_contains"):
        ours = list(inspect.signature(getattr(lm.Connector, name)).parameters)
        assert ours == list(inspect.signature(getattr(lm.RemoteConnector, name)).parameters), name
    ours = list(inspect.signature(lm.Connector.batched_async_contains).parameters)
    assert ours == list(inspect.signature(lm.RemoteConnector.batched_async_contains).parameters)
    for name in ("get", "put", "batched_get", "batched_put", "exists", "batched_async_contains", "close", "list"):
        assert inspect.iscoroutinefunction(getattr(lm.Connector, name)), name


def test_chunks_round_trip_through_the_plugin_loader(
    lm: SimpleNamespace, cluster: LocalCluster, loop: asyncio.AbstractEventLoop
) -> None:
    writer = make_connector(lm, loop, cluster.master)
    reader = make_connector(lm, loop, cluster.master)
    try:
        assert isinstance(inner(writer), lm.Connector)
        keys = [key(lm, h) for h in (101, 102, 103)]
        objs = [chunk(lm, writer, 1), chunk(lm, writer, 2), chunk(lm, writer, 3, tokens=5)]  # a partial last chunk
        expected = [o.tensor.clone() for o in objs]
        loop.run_until_complete(inner(writer).batched_put(keys, objs))

        assert inner(reader).batched_contains([*keys, key(lm, 999)]) == 3
        assert inner(reader).batched_contains([key(lm, 999), *keys]) == 0
        assert loop.run_until_complete(inner(reader).batched_async_contains("lookup-1", keys)) == 3
        assert loop.run_until_complete(inner(reader).exists(keys[0]))

        got = loop.run_until_complete(inner(reader).batched_get([*keys, key(lm, 999)]))
        assert got[3] is None
        for obj, want in zip(got[:3], expected, strict=True):
            assert obj is not None
            assert tuple(obj.tensor.shape) == tuple(want.shape)
            assert lm.torch.equal(obj.tensor, want)
        one = loop.run_until_complete(inner(reader).get(keys[1]))
        assert lm.torch.equal(one.tensor, expected[1])
    finally:
        loop.run_until_complete(inner(writer).close())
        loop.run_until_complete(inner(reader).close())


def test_tags_separate_deployments(lm: SimpleNamespace, cluster: LocalCluster, loop: asyncio.AbstractEventLoop) -> None:
    a = make_connector(lm, loop, cluster.master, tag="blue")
    b = make_connector(lm, loop, cluster.master, tag="green")
    try:
        k = key(lm, 555)
        loop.run_until_complete(inner(a).put(k, chunk(lm, a, 5)))
        assert inner(a).exists_sync(k)
        assert not inner(b).exists_sync(k)
        assert loop.run_until_complete(inner(b).get(k)) is None
    finally:
        loop.run_until_complete(inner(a).close())
        loop.run_until_complete(inner(b).close())


def test_a_dead_pool_is_a_miss_not_an_error(lm: SimpleNamespace, loop: asyncio.AbstractEventLoop) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conn = make_connector(lm, loop, f"127.0.0.1:{port}", lookup_timeout_s=0.3, timeout_s=1)
    try:
        k = key(lm, 7)
        assert inner(conn).batched_contains([k]) == 0
        loop.run_until_complete(inner(conn).batched_put([k], [chunk(lm, conn, 7)]))  # dropped, not raised
        assert loop.run_until_complete(inner(conn).batched_get([k])) == [None]
        assert loop.run_until_complete(inner(conn).ping()) != 0
    finally:
        loop.run_until_complete(inner(conn).close())
