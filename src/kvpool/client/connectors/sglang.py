"""SGLang HiCache L3 backend: ``KvPoolHiCacheStorage``, a subclass of SGLang's real ``HiCacheStorage``.

Loaded by SGLang's factory as a dynamic backend (``cls(storage_config, kwargs)``; the host pool arrives
later in ``register_mem_pool_host``)::

    --hicache-storage-backend dynamic --hicache-mem-layout page_first \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
        "module_path": "kvpool.client.connectors.sglang", "class_name": "KvPoolHiCacheStorage",
        "interface_v1": 1, "master": "10.0.0.1:50051"}'

Extra-config keys (all optional): ``master`` (else ``KVPOOL_MASTER``), ``timeout_s`` (gets and puts, default
5), ``lookup_timeout_s`` (``batch_exists``, default 0.5), ``tag`` (an extra namespace part, e.g. the KV
dtype when one model is served with two), ``token_file``, ``cluster``, ``connections_per_store``,
``replica_num``, ``spin_us``, ``lease_cache_entries``, ``lease_renewal``, ``revalidate_reads``, ``use_shm``,
``native_lanes``. See docs/sglang.md.

Keys (:class:`kvpool.common.keys.Namespace`, Mooncake's naming): ``<tag>_<model>_<hash>_<tp_rank>_k|_v`` for
MHA (each TP rank stores its head shard), ``<tag>_<model>_<hash>__k`` for MLA (one copy shared by all
ranks; only the storage-writer rank writes). Two departures from Mooncake, both for correctness: the MHA
tag carries the TP size (a TP2 and a TP4 rank 0 hold different head shards under Mooncake's identical
keys) and any layout other than ``page_first`` (page_first_direct, layer_first, ... store their bytes in
another order); ``_`` inside the tag and the model name becomes ``-``, so that ``<tag>_<model>_`` is an
exact namespace prefix and ``clear()`` removes this deployment's pages only (Mooncake's wipes the pool).

Zero-copy (``"interface_v1": 1``): ``batch_get_v1``/``batch_set_v1`` move pages straight between the pool and
the host KV pool through ``mem_pool_host.get_page_buffer_meta`` pointers. The legacy ``get``/``set``/
``batch_get``/``batch_set`` path takes flat page tensors; for MHA the flat page is ``[K page | V page]``, so
it is stored as the same ``_k``/``_v`` objects and both paths share every page.

Thread-safe: SGLang calls from its prefetch, prefetch-IO and backup threads at once; the PoolClient is
thread-safe and the statistics take a lock. This module imports torch and sglang; nothing else in
kvpool imports it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch  # type: ignore[import-not-found,unused-ignore]
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

try:  # the v2 (hybrid-model) types; an older SGLang has only v1 and never calls the v2 methods
    from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        PoolHitPolicy,
        PoolTransferResult,
    )
except ImportError:  # pragma: no cover - SGLang before v2
    PoolHitPolicy = PoolTransferResult = None

from kvpool.client.config import ClientConfig
from kvpool.client.connectors import base
from kvpool.client.pool_client import PoolClient, ptr_view
from kvpool.common.keys import Namespace
from kvpool.common.log import get_logger

log = get_logger(__name__)

# Layouts whose per-page K (and V) bytes are SGLang's page_first order: one contiguous
# [page_size, layers, heads, dim] block per object. Keys of any other layout get the layout in their tag.
_DEFAULT_LAYOUT = "page_first"
# Layouts whose get_page_buffer_meta gives one pointer per object (k, v per page; one per page for MLA).
_V1_LAYOUTS = {"page_first", "page_first_direct", "page_head"}


@dataclass
class _FallbackStorageMetrics:
    """The shape of SGLang's ``StorageMetrics`` when its metrics module cannot be imported."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


# Shared with the vLLM and LMCache connectors (kvpool.client.connectors.base).
_clean = base.clean
_config_value = base.config_value
_typed = base.typed

# extra_config keys read by this backend (documented in docs/sglang.md): the common ones, plus
# SGLang's own keys that it leaves in extra_config: the dynamic-backend triple and the v1 switch
_KNOWN_KEYS = base.COMMON_KEYS | {"backend_name", "module_path", "class_name", "interface_v1"}


class KvPoolHiCacheStorage(HiCacheStorage):  # type: ignore[misc,unused-ignore]
    """kvpool as SGLang's L3 storage (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        super().__init__()
        extra: dict[str, Any] = dict(storage_config.extra_config or {})
        if unknown := sorted(set(extra) - _KNOWN_KEYS):
            log.warning("kvpool: extra_config keys %s are not kvpool's and are ignored (a typo?)", unknown)
        self.storage_config = storage_config
        self.timeout_s = _typed(extra, "timeout_s", float, 5.0)
        self.lookup_timeout_s = _typed(extra, "lookup_timeout_s", float, 0.5)
        if not self.lookup_timeout_s > 0:
            raise ValueError(f"kvpool extra_config lookup_timeout_s must be > 0, got {self.lookup_timeout_s}")
        self.is_writer = bool(storage_config.is_storage_writer)
        self.mem_pool_host: Any = None
        self.layout = _DEFAULT_LAYOUT
        self._user_tag = _clean(str(_config_value(extra, "tag", "")))
        # Mixed TP (tp_lcm_size): a rank stores its heads as split_factor shards keyed by their rank in a
        # TP of tp_lcm_size, so instances of every TP size dividing tp_lcm_size share pages.
        lcm = int(storage_config.tp_lcm_size or 0)
        self.split_factor = 1
        self._lcm_tp = lcm if lcm and not storage_config.is_mla_model else 0
        if storage_config.should_split_heads and self._lcm_tp and lcm % storage_config.tp_size == 0:
            self.split_factor = lcm // storage_config.tp_size
        self.namespace = self._namespace(_DEFAULT_LAYOUT)
        self._shards = self._shard_namespaces()
        self.per_page = len(self.namespace.object_keys("0" * 64)) * self.split_factor
        self.pool = PoolClient(config=self._client_config(extra))
        self._side_per_page: dict[str, int] = {}  # side pool name -> objects per page (v2)
        self._stats_lock = threading.Lock()
        self._stats = _FallbackStorageMetrics()
        self._enable_stats = bool(storage_config.enable_storage_metrics)
        log.info(
            "kvpool HiCache backend: master %s, namespace prefix %r, %s, writer=%s",
            self.pool.config.master,
            self.namespace.prefix,
            "MLA" if self.namespace.mla else "MHA",
            self.is_writer,
        )

    # --- configuration ----------------------------------------------------------------------------

    @staticmethod
    def _client_config(extra: dict[str, Any]) -> ClientConfig:
        """The client's config from extra_config, built in one go so that ClientConfig's own checks run."""
        return base.client_config(extra)

    def _namespace(self, layout: str) -> Namespace:
        cfg = self.storage_config
        parts = [self._user_tag]
        if not cfg.is_mla_model:
            parts.append(f"tp{self._lcm_tp or cfg.tp_size}")
        if layout != _DEFAULT_LAYOUT:
            parts.append(_clean(layout))
        if cfg.attn_cp_size > 1:
            parts.append(f"cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}")
        if cfg.dcp_size > 1:
            parts.append(f"dcp{cfg.dcp_rank}of{cfg.dcp_size}")
        return Namespace(
            model=_clean(cfg.model_name or ""),
            tp_rank=cfg.tp_rank,
            pp_rank=cfg.pp_rank,
            pp_size=cfg.pp_size,
            mla=bool(cfg.is_mla_model),
            tag="-".join(p for p in parts if p),
        )

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.layout = str(getattr(mem_pool_host, "layout", _DEFAULT_LAYOUT))
        self.namespace = self._namespace(self.layout)
        self._shards = self._shard_namespaces()
        if self.split_factor > 1 and self.layout != "page_head":
            raise ValueError(
                f"kvpool: tp_lcm_size head splitting needs --hicache-mem-layout page_head, not {self.layout}"
            )
        if self.layout not in _V1_LAYOUTS:
            log.warning(
                "kvpool: host layout %s has no per-object pointers: pages go through flat copies "
                "(use --hicache-mem-layout page_first for zero-copy)",
                self.layout,
            )
        buffer = getattr(mem_pool_host, "kv_buffer", None)
        if isinstance(buffer, torch.Tensor) and buffer.device.type == "cpu" and buffer.numel():
            try:  # a no-op for TCP; an RDMA memory region where RDMA is used
                self.pool.register_buffer(ptr_view(buffer.data_ptr(), buffer.numel() * buffer.element_size()))
            except Exception as exc:  # registration is an optimisation: never fail the attach for it
                log.warning("kvpool: could not register the host KV buffer: %s", exc)

    # --- keys ----------------------------------------------------------------------------------------

    def _shard_namespaces(self) -> list[Namespace]:
        """One namespace per head shard this rank stores: its own, or with head splitting the
        ``split_factor`` ranks it covers in a TP of ``tp_lcm_size`` (SGLang's pointer order)."""
        ns = self.namespace
        first = ns.tp_rank * self.split_factor
        return [replace(ns, tp_rank=first + i) for i in range(self.split_factor)] if self.split_factor > 1 else [ns]

    def _object_keys(self, keys: list[str]) -> list[str]:
        shards = self._shards
        return [key for page in keys for ns in shards for key in ns.object_keys(page)]

    def _pages_ok(self, codes: list[int], want: list[int]) -> list[bool]:
        """Per page: did every object of the page get ``want`` (bytes read, or 0 for puts)?"""
        k = self.per_page
        return [all(codes[j] == want[j] for j in range(i, i + k)) for i in range(0, len(codes), k)]

    # --- lookups -------------------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Leading pages present (every object of each page); one round trip; 0 when degraded."""
        if not keys:
            return 0
        found = self.pool.prefix_length(self._object_keys(keys), timeout=self.lookup_timeout_s)
        return found // self.per_page

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # --- zero-copy path ------------------------------------------------------------------------------

    def _page_meta(self, keys: list[str], host_indices: Any) -> tuple[list[int], list[int]] | None:
        if self.split_factor > 1:
            ptrs, sizes = self.mem_pool_host.get_split_heads_page_buffer_meta(host_indices, self.split_factor)
        else:
            ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) != len(keys) * self.per_page:
            log.error(
                "kvpool: %d pointers for %d pages (layout %s); expected %d per page",
                len(ptrs),
                len(keys),
                self.layout,
                self.per_page,
            )
            return None
        return [int(p) for p in ptrs], [int(s) for s in sizes]

    def _logical_anchor(self) -> bool:
        # DeepSeek-V4-style pools have no physical KV buffer: side pools (v2) carry the data.
        return getattr(self.mem_pool_host, "kv_buffer", True) is None

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        if not keys:
            return []
        if self._logical_anchor():
            return [True] * len(keys)
        if self.layout not in _V1_LAYOUTS:
            return self._get_via_flat_pages(keys, host_indices)
        meta = self._page_meta(keys, host_indices)
        if meta is None:
            return [False] * len(keys)
        ptrs, sizes = meta
        start = time.perf_counter()
        codes = self.pool.batch_get_into_ptrs(self._object_keys(keys), ptrs, sizes, timeout=self.timeout_s)
        ok = self._pages_ok(codes, sizes)
        self._record("prefetch", _leading(ok), sum(sizes), time.perf_counter() - start)
        return ok

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        if not keys:
            return []
        if not self.is_writer or self._logical_anchor():
            return [True] * len(keys)  # MLA: the writer rank stores the one shared copy
        if self.layout not in _V1_LAYOUTS:
            return self._set_via_flat_pages(keys, host_indices)
        meta = self._page_meta(keys, host_indices)
        if meta is None:
            return [False] * len(keys)
        ptrs, sizes = meta
        start = time.perf_counter()
        views = [ptr_view(p, s) for p, s in zip(ptrs, sizes, strict=True)]
        codes = self._put_missing(self._object_keys(keys), views)
        ok = self._pages_ok(codes, [0] * len(codes))
        self._record("backup", sum(ok), sum(sizes), time.perf_counter() - start)
        return ok

    def _put_missing(self, objects: list[str], views: list[memoryview]) -> list[int]:
        """Mooncake's exists-then-put: existing objects count as written (values are immutable)."""
        exists = self.pool.batch_exists(objects, timeout=self.lookup_timeout_s)
        codes = [0 if e == 1 else -1 for e in exists]
        missing = [i for i, e in enumerate(exists) if e != 1]
        if missing:
            put = self.pool.batch_put_from(
                [objects[i] for i in missing], [views[i] for i in missing], timeout=self.timeout_s
            )
            for i, code in zip(missing, put, strict=True):
                codes[i] = code
        return codes

    def _slots(self, keys: list[str], host_indices: Any) -> list[int]:
        page = int(self.mem_pool_host.page_size)
        return [int(host_indices[i * page]) for i in range(len(keys))]

    def _get_via_flat_pages(self, keys: list[str], host_indices: Any) -> list[bool]:
        """v1 for layouts without per-object pointers (layer_first): a flat page per key, then copied
        into the host pool by SGLang's own ``set_from_flat_data_page``."""
        pages = self.batch_get(keys)
        ok = [page is not None for page in pages]
        for slot, page in zip(self._slots(keys, host_indices), pages, strict=True):
            if page is not None:
                self.mem_pool_host.set_from_flat_data_page(slot, page)
        return ok

    def _set_via_flat_pages(self, keys: list[str], host_indices: Any) -> list[bool]:
        slots = self._slots(keys, host_indices)
        pages = [self.mem_pool_host.get_data_page(slot, flat=True) for slot in slots]
        return [self.batch_set(keys, pages)] * len(keys)

    # --- generic (legacy) path: flat page tensors ----------------------------------------------------

    def _split(self, page: Any) -> list[memoryview]:
        """Byte views of a flat page tensor's objects: [K half, V half] for MHA, [whole] for MLA."""
        flat = page.contiguous()
        nbytes = flat.numel() * flat.element_size()
        if nbytes % self.per_page:
            raise ValueError(f"a flat page of {nbytes} bytes does not split into {self.per_page} objects")
        view = ptr_view(flat.data_ptr(), nbytes)
        part = nbytes // self.per_page
        return [view[i * part : (i + 1) * part] for i in range(self.per_page)]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Read pages into flat page tensors (allocated from the host pool when not given); None = miss."""
        if not keys:
            return []
        if self.split_factor > 1:  # flat pages are not in head-shard order: only the v1 path splits heads
            log.error("kvpool: tp_lcm_size head splitting needs interface_v1; the flat-page get is refused")
            return [None] * len(keys)
        targets = (
            list(target_locations)
            if target_locations is not None
            else [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        )
        views = [v for t in targets for v in self._split(t)]
        start = time.perf_counter()
        codes = self.pool.batch_get_into(self._object_keys(keys), views, timeout=self.timeout_s)
        ok = self._pages_ok(codes, [len(v) for v in views])
        self._record("prefetch", _leading(ok), sum(len(v) for v in views), time.perf_counter() - start)
        return [t if good else None for t, good in zip(targets, ok, strict=True)]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store flat page tensors; True iff every page is in the pool afterwards."""
        if not keys:
            return True
        if not self.is_writer:
            return True
        if self.split_factor > 1:
            log.error("kvpool: tp_lcm_size head splitting needs interface_v1; the flat-page set is refused")
            return False
        if values is None or len(values) != len(keys):
            return False
        pages = [p.contiguous() for p in values]  # keep the contiguous copies alive during the put
        views = [v for p in pages for v in self._split(p)]
        start = time.perf_counter()
        codes = self._put_missing(self._object_keys(keys), views)
        ok = self._pages_ok(codes, [0] * len(codes))
        self._record("backup", sum(ok), sum(len(v) for v in views), time.perf_counter() - start)
        return all(ok)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value] if value is not None else None)

    # --- v2: hybrid models' side pools (Mamba/SSM state, SWA, DSA indexer, draft, DeepSeek-V4) -------

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Remember a side pool by name; its pages go through its own ``get_page_buffer_meta``."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if str(host_pool_name) == "kv":
            return  # the anchor: registered through register_mem_pool_host
        self._side_per_page[str(host_pool_name)] = _objects_per_page(host_pool)
        buffer = getattr(host_pool, "kv_buffer", None)
        if isinstance(buffer, torch.Tensor) and buffer.device.type == "cpu" and buffer.numel():
            try:
                self.pool.register_buffer(ptr_view(buffer.data_ptr(), buffer.numel() * buffer.element_size()))
            except Exception as exc:
                log.warning("kvpool: could not register the %s host buffer: %s", host_pool_name, exc)

    def _side_keys(self, name: str, pages: list[str], per_page: int) -> list[str]:
        """Objects of a side pool's pages: ``<prefix><hash>_<rank>_<pool>_<j>``, j < objects per page."""
        ns = self.namespace
        return [f"{ns.prefix}{page}_{ns.rank_suffix}_{_clean(name)}_{j}" for page in pages for j in range(per_page)]

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[Any] | None = None, extra_info: Any = None) -> Any:
        """The KV prefix, cut to the stop points every side pool can serve (SGLang's fold semantics:
        ALL_PAGES needs every page, TRAILING_PAGES the window before the stop point; BLOCK_GROUPS reports
        its leading whole groups and never gates the KV hit). One lookup for the KV pages, one for all
        side-pool objects."""
        kv_pages = len(keys) if self._logical_anchor() else self.batch_exists(keys, extra_info)
        hit_count: dict[str, int] = {"kv": kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        transfers = [t for t in pool_transfers or [] if str(t.name) != "kv"]
        if not restorable or not transfers:
            return PoolTransferResult(kv_pages, hit_count, restorable)
        spans: list[tuple[Any, int, int, int]] = []
        objects: list[str] = []
        for transfer in transfers:
            per_page = self._side_per_page.get(str(transfer.name), 1)
            start = len(objects)
            objects += self._side_keys(str(transfer.name), keys[:kv_pages], per_page)
            spans.append((transfer, per_page, start, len(objects)))
        exists = self.pool.batch_exists(objects, timeout=self.lookup_timeout_s)
        for transfer, per_page, start, end in spans:
            found = exists[start:end]
            present = [all(e == 1 for e in found[i * per_page : (i + 1) * per_page]) for i in range(kv_pages)]
            boundary, stops = _pool_stops(transfer, present)
            if boundary:
                hit_count[str(transfer.name)] = boundary
            if stops is not None:
                restorable = [p for p in restorable if p in stops]
        return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        return self._batch_io_v2(transfers, extra_info, write=False)

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        return self._batch_io_v2(transfers, extra_info, write=True)

    def _batch_io_v2(self, transfers: list[Any], extra_info: Any, write: bool) -> dict[str, list[bool]]:
        """KV through the v1 path; every side pool's pages in one batched pool call."""
        results: dict[str, list[bool]] = {}
        spans: list[tuple[str, int, int, int]] = []
        objects: list[str] = []
        ptrs: list[int] = []
        sizes: list[int] = []
        for transfer in transfers:
            name, keys = str(transfer.name), list(transfer.keys or [])
            if name == "kv":
                io = self.batch_set_v1 if write else self.batch_get_v1
                results[name] = io(keys, transfer.host_indices, extra_info)
                continue
            pool = self.registered_pools.get(transfer.name) if hasattr(self, "registered_pools") else None
            if pool is None or not keys:
                results[name] = [False] * len(keys)
                continue
            if write and not self.is_writer:
                results[name] = [True] * len(keys)  # MLA: the writer rank stores the one shared copy
                continue
            pool_ptrs, pool_sizes = pool.get_page_buffer_meta(transfer.host_indices)
            per_page = len(pool_ptrs) // len(keys)
            if per_page < 1 or per_page * len(keys) != len(pool_ptrs):
                log.error("kvpool: pool %s: %d pointers for %d pages", name, len(pool_ptrs), len(keys))
                results[name] = [False] * len(keys)
                continue
            start = len(objects)
            objects += self._side_keys(name, keys, per_page)
            ptrs += [int(p) for p in pool_ptrs]
            sizes += [int(z) for z in pool_sizes]
            spans.append((name, per_page, start, len(objects)))
        if not objects:
            return results
        if write:
            codes = self._put_missing(objects, [ptr_view(p, z) for p, z in zip(ptrs, sizes, strict=True)])
            want = [0] * len(codes)
        else:
            codes = self.pool.batch_get_into_ptrs(objects, ptrs, sizes, timeout=self.timeout_s)
            want = sizes
        for name, per_page, start, end in spans:
            ok = [codes[j] == want[j] for j in range(start, end)]
            results[name] = [all(ok[i : i + per_page]) for i in range(0, len(ok), per_page)]
        return results

    # --- admin ---------------------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove this deployment's pages only (its namespace prefix), not the whole pool."""
        prefix = self.namespace.prefix
        if not prefix:
            log.warning("kvpool: clear() refused: no model name or tag, so no namespace prefix to scope it")
            return
        removed = self.pool.remove_all(prefix=prefix, timeout=max(self.timeout_s, 30.0))
        log.info("kvpool: clear() removed %d objects under %r", removed, prefix)

    def _record(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        if not self._enable_stats:
            return
        gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        with self._stats_lock:
            if kind == "prefetch":
                self._stats.prefetch_pgs.append(pages)
                self._stats.prefetch_bandwidth.append(gbps)
            else:
                self._stats.backup_pgs.append(pages)
                self._stats.backup_bandwidth.append(gbps)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s per batch), then reset."""
        with self._stats_lock:
            taken, self._stats = self._stats, _FallbackStorageMetrics()
        try:
            from sglang.srt.observability.metrics_collector import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
                StorageMetrics,
            )
        except Exception:  # the metrics module pulls half of sglang; outside a server it may not import
            return taken
        metrics = StorageMetrics()
        metrics.prefetch_pgs.extend(taken.prefetch_pgs)
        metrics.backup_pgs.extend(taken.backup_pgs)
        metrics.prefetch_bandwidth.extend(taken.prefetch_bandwidth)
        metrics.backup_bandwidth.extend(taken.backup_bandwidth)
        return metrics

    def close(self) -> None:
        self.pool.close()


def _objects_per_page(host_pool: Any) -> int:
    """Objects per page of a host pool: the pointers its ``get_page_buffer_meta`` gives for one page."""
    page = int(getattr(host_pool, "page_size", 1) or 1)
    try:
        ptrs, _ = host_pool.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
        return max(1, len(ptrs))
    except Exception:  # a pool without pointers for slot 0: its first transfer tells
        return 1


def _pool_stops(transfer: Any, present: list[bool]) -> tuple[int, set[int] | None]:
    """(pages this pool reports, the KV stop points it allows; None = it does not gate the KV hit)."""
    n = len(present)
    policy = str(getattr(transfer.hit_policy, "value", transfer.hit_policy))
    if policy == "trailing_pages":
        window = max(1, len(transfer.keys) if transfer.keys else 1)
        stops = {end for end in range(1, n + 1) if all(present[max(0, end - window) : end])}
        return (max(stops) if stops else 0), stops
    leading = next((i for i, p in enumerate(present) if not p), n)
    if policy == "block_groups":
        group = max(1, int(getattr(transfer, "group_pages", 0) or 1))
        return leading // group * group, None
    return leading, set(range(1, leading + 1))  # all_pages


def _leading(ok: list[bool]) -> int:
    n = 0
    for good in ok:
        if not good:
            break
        n += 1
    return n
