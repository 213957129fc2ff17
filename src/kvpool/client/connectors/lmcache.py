"""LMCache remote storage plugin: ``KvPoolRemoteConnector``, a subclass of LMCache 0.5's ``RemoteConnector``.

LMCache (in-process mode, e.g. under vLLM's ``LMCacheConnectorV1``) loads it through its plugin loader::

    remote_url: "plugin://kvpool"
    remote_serde: "naive"
    remote_storage_plugins: ["kvpool"]
    extra_config:
      remote_storage_plugin.kvpool.module_path: kvpool.client.connectors.lmcache
      remote_storage_plugin.kvpool.class_name: KvPoolRemoteConnector
      kvpool.master: "10.0.0.1:50051"

Extra-config keys are the common ones of :mod:`kvpool.client.connectors.base`, each written ``kvpool.<key>``
(``kvpool.master``, ``kvpool.timeout_s``, ``kvpool.lookup_timeout_s``, ``kvpool.tag``, ...). See
docs/lmcache.md.

Each LMCache chunk is one pool object holding the chunk's raw bytes (LMCache's ``KV_2LTD`` format; no
metadata header - like LMCache's Mooncake connector with ``save_chunk_meta: false`` - since every instance
sharing the namespace has the same chunk shape). A partial last chunk is stored short and reshaped on read
by the base class's ``reshape_partial_chunk``. The key is LMCache's own key string (model, world size,
worker id, chunk hash, dtype), under a ``<tag>-lmcache_`` prefix. Batched calls are one pool call each;
``batched_contains`` and ``batched_async_contains`` are one prefix lookup. The pool client is blocking:
the async methods run it in a worker thread so that LMCache's event loop never blocks on the network.
Every failure is a miss (reads) or a dropped write, logged, never raised into LMCache.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvpool.client.connectors.base import PoolConnector, namespace_tag
from kvpool.common.log import get_logger

log = get_logger(__name__)

if TYPE_CHECKING:
    _RemoteConnector = Any
else:
    try:
        from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector as _RemoteConnector
    except ImportError as exc:  # LMCache is not installed: the module still imports
        _LMCACHE_IMPORT_ERROR: ImportError | None = exc

        class _RemoteConnector:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise ImportError(
                    f"kvpool.client.connectors.lmcache.KvPoolRemoteConnector needs lmcache (0.5): "
                    f"{_LMCACHE_IMPORT_ERROR}. Install lmcache, or `pip install kvpool[lmcache]`."
                )


CONFIG_PREFIX = "kvpool."


def kvpool_extra(extra_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``kvpool.<key>`` entries of LMCache's extra_config, without the prefix."""
    return {k[len(CONFIG_PREFIX) :]: v for k, v in (extra_config or {}).items() if k.startswith(CONFIG_PREFIX)}


class KvPoolRemoteConnector(_RemoteConnector):  # type: ignore[misc]
    """kvpool as an LMCache remote backend (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any = None) -> None:
        config = config if config is not None else getattr(local_cpu_backend, "config", None)
        super().__init__(config, getattr(local_cpu_backend, "metadata", None))
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self._side = PoolConnector(kvpool_extra(getattr(config, "extra_config", None)))
        self._side.engine = "LMCache"
        self.pool = self._side.pool
        self.prefix = namespace_tag(self._side.settings.tag, "lmcache") + "_"
        log.info("kvpool LMCache connector: master %s, prefix %r", self.pool.config.master, self.prefix)

    # --- keys --------------------------------------------------------------------------------------

    def pool_key(self, key: Any) -> str:
        return self.prefix + str(key.to_string())

    # --- lookups -----------------------------------------------------------------------------------

    def exists_sync(self, key: Any) -> bool:
        return self._side.lookup_prefix([self.pool_key(key)]) == 1

    async def exists(self, key: Any) -> bool:
        return await asyncio.to_thread(self.exists_sync, key)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        """Leading chunks present: one prefix lookup."""
        return self._side.lookup_prefix([self.pool_key(k) for k in keys])

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[Any], pin: bool = False) -> int:
        return await asyncio.to_thread(self.batched_contains, keys)

    # --- reads -------------------------------------------------------------------------------------

    def _allocate(self) -> Any:
        return self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)

    def _get_batch(self, keys: list[Any]) -> list[Any]:
        """Read chunks into freshly allocated memory objects; None for a miss (its object released)."""
        objs = [self._allocate() for _ in keys]
        live = [i for i, o in enumerate(objs) if o is not None]
        if len(live) < len(keys):
            log.warning("kvpool LMCache connector: LMCache could not allocate %d chunks", len(keys) - len(live))
        views = [memoryview(objs[i].byte_array).cast("B") for i in live]
        codes: list[int] = [-1] * len(live)
        if live:
            try:
                codes = self.pool.batch_get_into(
                    [self.pool_key(keys[i]) for i in live], views, timeout=self._side.settings.timeout_s
                )
            except Exception as exc:
                log.warning("kvpool LMCache connector: read of %d chunks failed: %s", len(live), exc)
        out: list[Any] = [None] * len(keys)
        for i, code in zip(live, codes, strict=True):
            out[i] = self._finish_read(objs[i], code)
        return out

    def _finish_read(self, obj: Any, code: int) -> Any:
        if code > 0:
            try:
                return self.reshape_partial_chunk(obj, code)
            except ValueError as exc:  # not a whole number of tokens: not a chunk of this shape
                log.warning("kvpool LMCache connector: dropped a chunk read: %s", exc)
        obj.ref_count_down()
        return None

    async def get(self, key: Any) -> Any:
        return (await asyncio.to_thread(self._get_batch, [key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[Any]:
        return await asyncio.to_thread(self._get_batch, list(keys))

    # --- writes ------------------------------------------------------------------------------------

    def _put_batch(self, keys: list[Any], memory_objs: list[Any]) -> list[bool]:
        """Zero-copy puts of the chunks' bytes (the objects stay LMCache's; it owns their ref counts)."""
        ptrs = [int(o.data_ptr) for o in memory_objs]
        sizes = [int(o.get_size()) for o in memory_objs]
        return self._side.write_from([self.pool_key(k) for k in keys], ptrs, sizes)

    async def put(self, key: Any, memory_obj: Any) -> None:
        await asyncio.to_thread(self._put_batch, [key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        await asyncio.to_thread(self._put_batch, list(keys), list(memory_objs))

    # --- admin -------------------------------------------------------------------------------------

    def remove_sync(self, key: Any) -> bool:
        try:
            return self.pool.remove(self.pool_key(key), timeout=self._side.settings.timeout_s) == 0
        except Exception as exc:
            log.warning("kvpool LMCache connector: remove failed: %s", exc)
            return False

    async def list(self) -> list[str]:
        """Not offered: the pool's listing is an admin call over every namespace."""
        return []

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the master answers a lookup within ``lookup_timeout_s``."""
        codes = await asyncio.to_thread(
            self.pool.batch_exists, [self.prefix + "ping"], self._side.settings.lookup_timeout_s
        )
        return 0 if codes and codes[0] >= 0 else 1

    async def close(self) -> None:
        self._side.close()
