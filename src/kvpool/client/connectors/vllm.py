"""vLLM KV connector: ``KvPoolConnector``, a subclass of vLLM's ``KVConnectorBase_V1`` and ``SupportsHMA``.

Loaded out of tree (vllm 0.33)::

    --kv-transfer-config '{"kv_connector": "KvPoolConnector",
        "kv_connector_module_path": "kvpool.client.connectors.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"master": "10.0.0.1:50051"}}'

Extra-config keys: the common ones of :mod:`kvpool.client.connectors.base` (``master``, ``timeout_s``,
``lookup_timeout_s``, ``tag``, ``token_file``, ...) plus ``save_decode`` (also store blocks filled while
decoding, default true), ``load_async`` and ``save_async`` (default true). See docs/vllm.md.

**Keys.** A block's key is vLLM's own block hash (hex), which already chains the parent block and folds in
vLLM's extra keys (LoRA, multimodal inputs, cache salt). The namespace adds the model, the KV dtype, the
block size, the hash algorithm and the parallel rank (TP rank and size; MLA pages are one copy for all
ranks; PP rank), so only instances whose bytes are interchangeable share. Per block and rank the pool
holds one object per layer and K/V half - the bytes of that block in vLLM's paged cache, in the paged
layout's own order (the layout is part of the object keys) - and a small marker written after all of
them: the scheduler's prefix lookup checks one marker per block and rank, one master round trip.

**Flow.** Scheduler: ``get_num_new_matched_tokens`` (one prefix lookup, bounded by ``lookup_timeout_s``;
0 when the pool is down; asynchronous where there is a hit) -> ``update_state_after_alloc`` (what to load)
-> ``build_connector_meta`` (loads, and the newly full blocks to save). Worker: ``start_load_kv`` reads
the blocks straight into the paged cache (one batched call, bounded by ``timeout_s``) on a loader thread,
reported by ``get_finished`` when done; a block that fails is reported by ``get_block_ids_with_load_errors``
with every block after it, and vLLM's ``kv_load_failure_policy`` decides: recompute, or fail the request.
``wait_for_save`` hands the step's full blocks to a saver thread (batched zero-copy puts, then markers);
``request_finished`` then returns True and vLLM keeps the blocks until ``get_finished`` reports the saves
done. ``load_async``/``save_async`` false do both inside the step. ``layerwise`` pipelines by layer:
``save_kv_layer`` starts each layer's put as the layer is computed, in-step loads are one read per layer
that ``wait_for_layer_load`` waits for, and the markers follow every layer's put. GPU caches go through a
host staging copy.

``import kvpool.client.connectors.vllm`` works without vLLM or torch; constructing the connector without
them raises an ImportError naming what is missing.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool.client.connectors.base import PoolConnector, namespace_tag, typed
from kvpool.common.log import get_logger

log = get_logger(__name__)

if TYPE_CHECKING:
    _Base = Any
    _HMA = Any
    _Metadata = Any
else:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorBase_V1 as _Base,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorMetadata as _Metadata,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            SupportsHMA as _HMA,
        )
    except ImportError as exc:  # vLLM is not installed: the module still imports (see the docstring)
        _VLLM_IMPORT_ERROR: ImportError | None = exc

        class _Base:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise ImportError(
                    f"kvpool.client.connectors.vllm.KvPoolConnector needs vllm (0.33) and torch: "
                    f"{_VLLM_IMPORT_ERROR}. Install vllm, or `pip install kvpool[vllm]`."
                )

        class _HMA:
            pass

        class _Metadata:
            pass


MARKER = b"kvpool-block\x00\x00\x00\x00"
"""The value of a block's marker object; only its presence is read."""

_KNOWN_KEYS = frozenset({"save_decode", "load_async", "save_async", "layerwise"})


@dataclass
class BlockTransfer:
    """Blocks of one request to load or save: per block its hash and its block id in each KV group."""

    req_id: str
    hashes: list[str]
    block_ids: dict[int, list[int]]
    """group id -> block ids, one per hash."""


@dataclass
class KvPoolConnectorMetadata(_Metadata):  # type: ignore[misc]
    """Scheduler -> worker, once per step."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class _RequestState:
    """The scheduler's view of one running request."""

    request: Any
    block_ids: dict[int, list[int]] = field(default_factory=dict)
    saved_blocks: int = 0
    """Leading blocks already in the pool (loaded, or saved by an earlier step)."""
    saving: bool = False
    """A save was scheduled: with asynchronous saves, freeing waits for the worker's finished_sending."""


@dataclass
class _LayerSave:
    """The per-layer saves of one step (layerwise): per transfer of ``meta.saves``, per layer, whether each
    of its blocks' objects went in."""

    transfers: list[BlockTransfer]
    layers: dict[int, Future[list[list[bool]]]] = field(default_factory=dict)


@dataclass
class _LayerRegion:
    """Where one layer's blocks live: ``tensor.select(part_dim, part)`` per part, then block ``b``."""

    name: str
    group: int
    tensor: Any
    parts: int  # 2: K and V stored apart ([2, blocks, ...]); 1: one region per block
    layout: str


def _attr(obj: Any, path: str, default: Any = None) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return default
    return obj


def _parallel_rank() -> tuple[int, int]:
    """(TP rank, PP rank) of this worker; (0, 0) outside a distributed vLLM worker."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return int(get_tp_group().rank_in_group), int(get_pp_group().rank_in_group)
    except Exception:  # not initialised: a single process
        return 0, 0


class KvPoolConnector(_Base, _HMA):  # type: ignore[misc]
    """kvpool as vLLM's KV connector (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        missing = [m for m in ("torch",) if importlib.util.find_spec(m) is None]
        if missing:
            raise ImportError(f"KvPoolConnector needs {', '.join(missing)}")
        transfer = vllm_config.kv_transfer_config
        extra: Mapping[str, Any] = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
        self._pool_side = PoolConnector(extra, _KNOWN_KEYS)
        self._pool_side.engine = "vLLM"
        self.pool = self._pool_side.pool
        self.block_size = int(_attr(vllm_config, "cache_config.block_size", 16))
        self.save_decode = bool(typed(extra, "save_decode", bool, True))
        self.load_async = bool(typed(extra, "load_async", bool, True))
        self.save_async = bool(typed(extra, "save_async", bool, True))
        self.layerwise = bool(typed(extra, "layerwise", bool, False))
        self.is_producer = bool(getattr(transfer, "is_kv_producer", True))
        self.is_consumer = bool(getattr(transfer, "is_kv_consumer", True))
        self.tp_size = int(_attr(vllm_config, "parallel_config.tensor_parallel_size", 1))
        self.pp_size = int(_attr(vllm_config, "parallel_config.pipeline_parallel_size", 1))
        self.mla = bool(_attr(vllm_config, "model_config.use_mla", False))
        self.groups = self._restored_groups(kv_cache_config)
        self._base_tag = namespace_tag(
            self._pool_side.settings.tag,
            "vllm",
            str(_attr(vllm_config, "model_config.model", "model")),
            str(_attr(vllm_config, "cache_config.cache_dtype", "auto")),
            str(_attr(vllm_config, "model_config.dtype", "")).replace("torch.", ""),
            f"bs{self.block_size}",
            str(_attr(vllm_config, "cache_config.prefix_caching_hash_algo", "")),
        )
        # scheduler side
        self._requests: dict[str, _RequestState] = {}
        self._lookups: dict[str, tuple[int, int]] = {}  # req_id -> (first block, blocks found)
        self._pending_loads: list[BlockTransfer] = []
        # worker side
        self.tp_rank, self.pp_rank = _parallel_rank()
        self._layers: list[_LayerRegion] = []
        self._load_errors: set[int] = set()
        self._errors_lock = threading.Lock()
        # asynchronous transfers (worker): one thread loads, one saves, so a load never waits behind saves
        self._loader: ThreadPoolExecutor | None = None
        self._saver: ThreadPoolExecutor | None = None
        self._recving: dict[str, list[Future[None]]] = {}
        self._sending: dict[str, list[Future[None]]] = {}
        self._finished_waiting: set[str] = set()  # finished requests whose saves are still running
        self._loads_failed = 0
        # layer-by-layer pipelining (layerwise): this step's per-layer loads and saves
        self._layer_of: dict[str, int] = {}
        self._layer_loads: dict[int, Future[None]] = {}
        self._layer_save: _LayerSave | None = None
        log.info(
            "kvpool vLLM connector (%s): master %s, namespace %s, groups %s",
            getattr(role, "name", role),
            self.pool.config.master,
            self._base_tag,
            self.groups,
        )

    # --- namespace ---------------------------------------------------------------------------------

    def _restored_groups(self, kv_cache_config: Any) -> tuple[int, ...]:
        """The KV groups this connector restores: attention groups (prefix-cacheable, vLLM's notion)
        whose block size is the scheduler's; other groups (Mamba state, ...) are recomputed by vLLM."""
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if not groups:
            return (0,)
        ids = getattr(kv_cache_config, "prefix_cacheable_group_ids", tuple(range(len(groups))))
        chosen = tuple(
            g
            for g in ids
            if hasattr(groups[g].kv_cache_spec, "num_kv_heads")
            and int(getattr(groups[g].kv_cache_spec, "block_size", self.block_size)) == self.block_size
        )
        return chosen or (0,)

    def _rank_tag(self, tp_rank: int, pp_rank: int) -> str:
        tp = "mla" if self.mla else f"tp{tp_rank}of{self.tp_size}"
        return f"{self._base_tag}-{tp}-pp{pp_rank}of{self.pp_size}"

    def _writer_ranks(self) -> list[tuple[int, int]]:
        tps = [0] if self.mla else list(range(self.tp_size))
        return [(tp, pp) for pp in range(self.pp_size) for tp in tps]

    def marker_key(self, block_hash: str, tp_rank: int, pp_rank: int) -> str:
        return f"{self._rank_tag(tp_rank, pp_rank)}_{block_hash}_ok"

    def object_key(self, block_hash: str, layer: int, part: int) -> str:
        region = self._layers[layer]
        return f"{self._rank_tag(self.tp_rank, self.pp_rank)}-{region.layout}_{block_hash}_{layer}.{part}"

    # --- scheduler side ----------------------------------------------------------------------------

    @staticmethod
    def _hashes(request: Any) -> list[str]:
        out: list[str] = []
        for h in getattr(request, "block_hashes", None) or []:
            out.append(h.hex() if isinstance(h, bytes | bytearray) else f"{int(h):x}")
        return out

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` whose blocks the pool holds (for every rank): one
        lookup. At least one prompt token is always left to compute, as vLLM requires."""
        if not self.is_consumer:
            return 0, False
        hashes = self._hashes(request)
        usable = min(len(hashes), max(int(request.num_tokens) - 1, 0) // self.block_size)
        first = num_computed_tokens // self.block_size
        if first >= usable:
            return 0, False
        ranks = self._writer_ranks()
        keys = [self.marker_key(h, tp, pp) for h in hashes[first:usable] for tp, pp in ranks]
        found = self._pool_side.lookup_prefix(keys) // len(ranks)
        self._lookups[request.request_id] = (first, found)
        return found * self.block_size, bool(found and self.load_async)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.setdefault(request.request_id, _RequestState(request))
        lookup = self._lookups.pop(request.request_id, None)
        if num_external_tokens <= 0 or lookup is None:
            return
        first, _ = lookup
        count = num_external_tokens // self.block_size
        all_ids = blocks.get_block_ids()
        ids = {g: list(all_ids[g][first : first + count]) for g in self.groups if g < len(all_ids)}
        hashes = self._hashes(request)[first : first + count]
        self._pending_loads.append(BlockTransfer(request.request_id, hashes, ids))
        state.saved_blocks = first + count

    def build_connector_meta(self, scheduler_output: Any) -> KvPoolConnectorMetadata:
        meta = KvPoolConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if not self.is_producer:
            return meta
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = {g: list(ids) for g, ids in enumerate(new.block_ids)}
                self._plan_save(meta, state, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = {g: list(ids) for g, ids in enumerate(new_ids or ())}
            elif new_ids is not None:
                for g, ids in enumerate(new_ids):
                    state.block_ids.setdefault(g, []).extend(ids)
            self._plan_save(meta, state, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _plan_save(self, meta: KvPoolConnectorMetadata, state: _RequestState, computed: int, out: Any) -> None:
        """Save the blocks this step fills: full, hashed, and not in the pool already."""
        request = state.request
        after_step = computed + int(out.num_scheduled_tokens.get(request.request_id, 0))
        if not self.save_decode:
            after_step = min(after_step, len(getattr(request, "prompt_token_ids", None) or []))
        hashes = self._hashes(request)
        full = min(after_step // self.block_size, len(hashes))
        full = min([full, *(len(state.block_ids.get(g, [])) for g in self.groups)])
        if full <= state.saved_blocks:
            return
        start = state.saved_blocks
        ids = {g: state.block_ids[g][start:full] for g in self.groups}
        meta.saves.append(BlockTransfer(request.request_id, hashes[start:full], ids))
        state.saved_blocks = full
        state.saving = True

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """True when saves of the request may still be running (asynchronous saves): vLLM then keeps its
        blocks until the workers report it in ``get_finished``'s finished_sending."""
        state = self._requests.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        return bool(state is not None and state.saving and self.save_async), None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return self.groups

    # --- worker side -------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Learn each layer's paged tensor: ``[2, blocks, ...]`` (K and V apart) or ``[blocks, ...]``."""
        group_of = self._group_by_layer()
        self._layers = []
        for name, tensor in kv_caches.items():
            parts = 2 if tensor.dim() >= 4 and tensor.shape[0] == 2 else 1
            per_block = tensor.select(0, 0) if parts == 2 else tensor
            order = sorted(range(per_block.dim()), key=lambda d: -per_block.stride(d))
            layout = "p" * (parts == 2) + "".join(str(d) for d in order)
            self._layer_of[name] = len(self._layers)
            self._layers.append(_LayerRegion(name, group_of.get(name, self.groups[0]), tensor, parts, layout))
            inner = 1
            for size in per_block.shape[1:]:
                inner *= int(size)
            if per_block.stride(0) != inner:
                raise ValueError(
                    f"kvpool: layer {name}: a block is not one contiguous span (shape {tuple(tensor.shape)})"
                )
        log.info(
            "kvpool vLLM connector: %d layers, layout %s",
            len(self._layers),
            self._layers[0].layout if self._layers else "-",
        )

    def _group_by_layer(self) -> dict[str, int]:
        groups = getattr(self._kv_cache_config, "kv_cache_groups", None) or []
        return {name: g for g, group in enumerate(groups) for name in group.layer_names}

    def _regions(
        self, transfer: BlockTransfer, only_layer: int | None = None
    ) -> tuple[list[str], list[Any], list[int]]:
        """Object keys, tensors and owning block index (into ``transfer.hashes``), block-major; all
        layers, or ``only_layer``."""
        keys: list[str] = []
        tensors: list[Any] = []
        owner: list[int] = []
        for b, block_hash in enumerate(transfer.hashes):
            for layer, region in enumerate(self._layers):
                if region.group not in transfer.block_ids or only_layer not in (None, layer):
                    continue
                block_id = transfer.block_ids[region.group][b]
                for part in range(region.parts):
                    base = region.tensor.select(0, part) if region.parts == 2 else region.tensor
                    keys.append(self.object_key(block_hash, layer, part))
                    tensors.append(base.select(0, block_id))
                    owner.append(b)
        return keys, tensors, owner

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Read this step's hit blocks into the paged cache, before the forward needs them."""
        meta = self._connector_metadata
        if not isinstance(meta, KvPoolConnectorMetadata) or not self._layers:
            return
        if self.layerwise and not self.load_async:
            self._start_layer_loads([t for t in meta.loads if t.hashes])
            return
        for transfer in meta.loads:
            if not transfer.hashes:
                continue
            if self.load_async:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvpool-vllm-load")
                future = self._loader.submit(self._load, transfer)
                self._recving.setdefault(transfer.req_id, []).append(future)
            else:
                self._load(transfer)

    def _load(self, transfer: BlockTransfer) -> None:
        try:
            keys, tensors, owner = self._regions(transfer)
            ok = _move(self._pool_side, keys, tensors, read=True)
            failed_at = next((owner[i] for i, good in enumerate(ok) if not good), None)
        except Exception as exc:  # whatever went wrong, no block of this load may count as loaded
            log.error("kvpool vLLM connector: load of request %s failed: %s", transfer.req_id, exc)
            failed_at = 0
        if failed_at is not None:
            self._load_failed(transfer, failed_at)

    # --- layer-by-layer pipelining (layerwise) ----------------------------------------------------

    def _start_layer_loads(self, transfers: list[BlockTransfer]) -> None:
        """One batched read per layer (every request of the step), queued in layer order on the loader
        thread, all under one deadline: the forward waits for each layer just before it needs it."""
        if not transfers:
            return
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvpool-vllm-load")
        deadline = time.monotonic() + self._pool_side.settings.timeout_s
        for layer in range(len(self._layers)):
            self._layer_loads[layer] = self._loader.submit(self._load_layer, transfers, layer, deadline)

    def _load_layer(self, transfers: list[BlockTransfer], layer: int, deadline: float) -> None:
        keys, tensors, owners = self._layer_batch(transfers, layer)
        try:
            ok = _move(self._pool_side, keys, tensors, read=True, timeout=deadline - time.monotonic())
        except Exception as exc:  # no block of this layer may count as loaded
            log.error("kvpool vLLM connector: load of layer %d failed: %s", layer, exc)
            ok = [False] * len(keys)
        failed: dict[int, int] = {}  # transfer -> its first block whose object did not load
        for (t, b), good in zip(owners, ok, strict=True):
            if not good:
                failed[t] = min(failed.get(t, b), b)
        for t, first in failed.items():
            self._load_failed(transfers[t], first)

    def _layer_batch(
        self, transfers: list[BlockTransfer], layer: int
    ) -> tuple[list[str], list[Any], list[tuple[int, int]]]:
        """One layer's objects of every transfer: keys, tensors, (transfer, block) owners."""
        keys: list[str] = []
        tensors: list[Any] = []
        owners: list[tuple[int, int]] = []
        for t, transfer in enumerate(transfers):
            k, ts, blocks = self._regions(transfer, only_layer=layer)
            keys += k
            tensors += ts
            owners += [(t, b) for b in blocks]
        return keys, tensors, owners

    def _wait_layer_loads(self, layers: list[int]) -> None:
        """Each read has the step's deadline, so this ends by it."""
        for layer in layers:
            future = self._layer_loads.pop(layer, None)
            if future is not None:
                future.result()

    def _save_layer(self, pending: _LayerSave, layer: int) -> None:
        """Queue one batched zero-copy write of this layer's blocks of the step's saves (once)."""
        if layer in pending.layers:
            return
        if self._saver is None:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvpool-vllm-save")
        pending.layers[layer] = self._saver.submit(self._write_layer, pending.transfers, layer)

    def _write_layer(self, transfers: list[BlockTransfer], layer: int) -> list[list[bool]]:
        keys, tensors, owners = self._layer_batch(transfers, layer)
        ok = _move(self._pool_side, keys, tensors, read=False)
        complete = [[True] * len(t.hashes) for t in transfers]
        for (t, b), good in zip(owners, ok, strict=True):
            complete[t][b] = complete[t][b] and good
        return complete

    def _finish_layer_saves(self, pending: _LayerSave) -> None:
        """After every layer's write: the markers of each transfer's leading complete blocks."""
        complete = [[True] * len(t.hashes) for t in pending.transfers]
        for future in pending.layers.values():
            try:
                per_transfer = future.result()
            except Exception as exc:  # a layer that did not save leaves its blocks without markers
                log.warning("kvpool vLLM connector: a layer save failed: %s", exc)
                per_transfer = [[False] * len(t.hashes) for t in pending.transfers]
            for mine, theirs in zip(complete, per_transfer, strict=True):
                mine[:] = [a and b for a, b in zip(mine, theirs, strict=True)]
        for transfer, blocks in zip(pending.transfers, complete, strict=True):
            self._write_markers(transfer, blocks)

    def _load_failed(self, transfer: BlockTransfer, failed_at: int) -> None:
        """Blocks ``failed_at`` and after of ``transfer`` are reported for recompute."""
        self._loads_failed += 1
        with self._errors_lock:
            for g, ids in transfer.block_ids.items():
                if g in self.groups:
                    self._load_errors.update(ids[failed_at:])
        log.warning(
            "kvpool vLLM connector: request %s: blocks %d..%d did not load; vLLM recomputes them",
            transfer.req_id,
            failed_at,
            len(transfer.hashes) - 1,
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """layerwise: wait for this layer's blocks only. Otherwise loads complete inside ``start_load_kv``
        (or, asynchronous, before the request is scheduled)."""
        layer = self._layer_of.get(layer_name)
        if layer is not None:
            self._wait_layer_loads([layer])

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """layerwise: start saving this layer's blocks of the step as soon as the layer is computed (one
        batched zero-copy put per layer). Otherwise blocks are saved whole in ``wait_for_save``."""
        if not self.layerwise or not self._layers:
            return
        if self._layer_save is None:
            meta = self._connector_metadata
            saves = [t for t in meta.saves if t.hashes] if isinstance(meta, KvPoolConnectorMetadata) else []
            if not saves or (self.mla and self.tp_rank != 0):
                return
            self._layer_save = _LayerSave(saves)
        layer = self._layer_of.get(layer_name)
        if layer is not None:
            self._save_layer(self._layer_save, layer)

    def wait_for_save(self) -> None:
        """Write this step's newly full blocks (one batched put), then their markers. layerwise: the
        layers the forward did not save go now; the markers follow every layer's put."""
        self._wait_layer_loads(list(self._layer_loads))  # every load error is known when the step ends
        meta = self._connector_metadata
        if not isinstance(meta, KvPoolConnectorMetadata) or not self._layers:
            return
        writer = not (self.mla and self.tp_rank != 0)  # MLA: one copy, written by TP rank 0
        if self.layerwise:
            self._wait_for_layer_saves(meta, writer)
            return
        for transfer in meta.saves:
            if not transfer.hashes:
                continue
            if not self.save_async:
                if writer:
                    self._save(transfer)
                continue
            # Every rank tracks the request (vLLM waits for all of them), only writers write.
            futures = self._sending.setdefault(transfer.req_id, [])
            if writer:
                if self._saver is None:
                    self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvpool-vllm-save")
                futures.append(self._saver.submit(self._save, transfer))

    def _wait_for_layer_saves(self, meta: KvPoolConnectorMetadata, writer: bool) -> None:
        pending, self._layer_save = self._layer_save, None
        saves = [t for t in meta.saves if t.hashes]
        if not saves:
            return
        if writer:
            pending = pending or _LayerSave(saves)
            for layer in range(len(self._layers)):
                self._save_layer(pending, layer)
        if not self.save_async:
            if pending is not None:
                self._finish_layer_saves(pending)
            return
        # Every rank tracks the request (vLLM waits for all of them), only writers write. The saver
        # thread runs in order: the markers' task starts after the layers' puts.
        for transfer in saves:
            self._sending.setdefault(transfer.req_id, [])
        if pending is not None and self._saver is not None:
            future = self._saver.submit(self._finish_layer_saves, pending)
            for transfer in saves:
                self._sending[transfer.req_id].append(future)

    def _save(self, transfer: BlockTransfer) -> None:
        keys, tensors, owner = self._regions(transfer)
        ok = _move(self._pool_side, keys, tensors, read=False)
        complete = [True] * len(transfer.hashes)
        for i, good in enumerate(ok):
            complete[owner[i]] = complete[owner[i]] and good
        self._write_markers(transfer, complete)

    def _write_markers(self, transfer: BlockTransfer, complete: list[bool]) -> None:
        done = [
            self.marker_key(h, self.tp_rank, self.pp_rank) for h, c in zip(transfer.hashes, complete, strict=True) if c
        ]
        # A marker only for a block whose objects are all in: a lookup never promises a half block.
        leading = next((b for b, c in enumerate(complete) if not c), len(complete))
        markers = done[:leading]
        if markers:
            try:
                self.pool.batch_put_from(
                    markers, [memoryview(MARKER)] * len(markers), timeout=self._pool_side.settings.timeout_s
                )
            except Exception as exc:
                log.warning("kvpool vLLM connector: markers of %d blocks not written: %s", len(markers), exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose saves are all done, once finished; requests whose loads are all done).
        A load's failed blocks are recorded before its request is reported here."""
        recving = {r for r, fs in self._recving.items() if all(f.done() for f in fs)}
        for req_id in recving:
            del self._recving[req_id]
        self._finished_waiting |= finished_req_ids & set(self._sending)
        sending = {r for r in self._finished_waiting if all(f.done() for f in self._sending[r])}
        for req_id in sending:
            self._finished_waiting.discard(req_id)
            del self._sending[req_id]
        return (sending or None), (recving or None)

    def shutdown(self) -> None:
        for executor in (self._loader, self._saver):
            if executor is not None:
                executor.shutdown(wait=True)  # every call has a deadline: this ends
        self._pool_side.close()


def _move(
    side: PoolConnector, keys: Sequence[str], tensors: Sequence[Any], read: bool, timeout: float | None = None
) -> list[bool]:
    """Read into (or write from) the tensors: zero-copy for host tensors, a staging copy otherwise.
    ``timeout``: the read's deadline instead of ``timeout_s`` (a step's layer reads share one)."""
    if not keys:
        return []
    staged = [t if t.device.type == "cpu" and t.is_contiguous() else None for t in tensors]
    buffers = [t if s is not None else t.detach().to("cpu").contiguous() for t, s in zip(tensors, staged, strict=True)]
    ptrs = [int(b.data_ptr()) for b in buffers]
    sizes = [int(b.numel() * b.element_size()) for b in buffers]
    if read:
        ok = side.read_into(keys, ptrs, sizes, timeout=timeout)
        for t, s, b, good in zip(tensors, staged, buffers, ok, strict=True):
            if s is None and good:
                t.copy_(b)
        return ok
    return side.write_from(keys, ptrs, sizes)
