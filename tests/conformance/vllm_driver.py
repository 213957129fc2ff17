"""Drives ``KvPoolConnector`` the way vLLM 0.33's scheduler and model runner do, on a CPU.

Real vLLM classes wherever they run without a GPU: ``Request`` with vLLM's own sha256 block hasher,
``KVCacheBlocks``/``KVCacheBlock``, ``SchedulerOutput``/``NewRequestData``/``CachedRequestData``,
``KVTransferConfig``, ``KVConnectorRole``. Faked (named so): ``FakeVllmConfig``, because a real
``VllmConfig`` resolves a model from the hub; it carries exactly the fields the connector reads.
The paged cache is per layer ``[2, num_blocks, block_size, kv_heads, head_dim]`` (FlashAttention's).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from vllm.config.kv_transfer import KVTransferConfig  # type: ignore[import-not-found,import-untyped,unused-ignore]
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
    KVConnectorRole,
)
from vllm.sampling_params import SamplingParams  # type: ignore[import-not-found,import-untyped,unused-ignore]
from vllm.utils.hashing import get_hash_fn_by_name  # type: ignore[import-not-found,import-untyped,unused-ignore]
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # type: ignore[import-not-found,import-untyped,unused-ignore]
from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.output import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.request import Request  # type: ignore[import-not-found,import-untyped,unused-ignore]

from kvpool.client.connectors.vllm import KvPoolConnector

_HASH = get_hash_fn_by_name("sha256")
init_none_hash(_HASH)


def _output(new: list[Any], scheduled: dict[str, int]) -> Any:
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


class FakeVllmConfig(SimpleNamespace):
    """The fields of ``VllmConfig`` the connector reads (a real one needs a model from the hub)."""


def vllm_config(extra: dict[str, Any], block_size: int, model: str, role: str = "kv_both") -> FakeVllmConfig:
    return FakeVllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvPoolConnector",
            kv_connector_module_path="kvpool.client.connectors.vllm",
            kv_role=role,
            kv_connector_extra_config=extra,
        ),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto", prefix_caching_hash_algo="sha256"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model=model, dtype=torch.float32, use_mla=False),
    )


def make_request(req_id: str, tokens: list[int], block_size: int, cache_salt: str | None = None) -> Any:
    return Request(
        req_id,
        list(tokens),
        SamplingParams(max_tokens=1),
        None,
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(block_size, _HASH),
    )


@dataclass
class Step:
    """What one prefill step of a request got from the connector."""

    external_tokens: int
    block_ids: list[int]
    load_errors: set[int] = field(default_factory=set)
    load_seconds: float = 0.0


class Instance:
    """One vLLM instance: a scheduler-side and a worker-side connector and a paged CPU KV cache."""

    def __init__(
        self,
        extra: dict[str, Any],
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        model: str,
        role: str = "kv_both",
    ) -> None:
        cfg = vllm_config(extra, block_size, model, role)
        self.block_size = block_size
        self.scheduler = KvPoolConnector(cfg, KVConnectorRole.SCHEDULER, None)
        self.worker = KvPoolConnector(cfg, KVConnectorRole.WORKER, None)
        self.kv = {
            f"model.layers.{i}.self_attn.attn": torch.zeros(2, num_blocks, block_size, kv_heads, head_dim)
            for i in range(layers)
        }
        self.worker.register_kv_caches(self.kv)
        self._free = list(range(num_blocks))
        self._forward_ended = False

    def prefill(
        self, request: Any, before_load: Any = None, layer_loaded: Any = None, forward_waits: bool = False
    ) -> Step:
        """Schedule ``request`` whole: lookup, allocate, load (asynchronously: the request waits for its
        KV as in WAITING_FOR_REMOTE_KVS, then is scheduled), build the step's metadata.
        ``before_load`` runs between the scheduler's lookup and the worker's load; ``layer_loaded(name)``
        right after ``wait_for_layer_load(name)`` returns, where the layer's attention would run.
        ``forward_waits`` (in-step loads): only ``start_load_kv`` runs here; the caller's forward waits for
        each layer, and :meth:`end_forward` collects the load errors."""
        hit, load_async = self.scheduler.get_num_new_matched_tokens(request, 0)
        assert hit is not None
        assert load_async == (hit > 0 and self.scheduler.load_async)
        blocks = [KVCacheBlock(self._free.pop(0)) for _ in range(math.ceil(request.num_tokens / self.block_size))]
        self.scheduler.update_state_after_alloc(request, KVCacheBlocks((blocks,)), hit)
        ids = [b.block_id for b in blocks]
        errors: set[int] = set()
        seconds = 0.0
        if load_async:
            # the load's own step: the request is not scheduled, only its load is in the metadata
            meta = self.scheduler.build_connector_meta(_output([], {}))
            errors, seconds = self._run_load(meta, before_load, request.request_id, layer_loaded)
            self.scheduler.update_state_after_alloc(request, KVCacheBlocks(([],)), 0)
        new = NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            mm_features=[],
            sampling_params=request.sampling_params,
            pooling_params=None,
            block_ids=(ids,),
            num_computed_tokens=hit,
            lora_request=None,
        )
        self._meta = self.scheduler.build_connector_meta(_output([new], {request.request_id: request.num_tokens - hit}))
        if not load_async and forward_waits:
            self.worker.bind_connector_metadata(self._meta)
            self.worker.start_load_kv(None)
        elif not load_async:
            errors, seconds = self._run_load(self._meta, before_load, None, layer_loaded)
        else:
            self.worker.bind_connector_metadata(self._meta)
        return Step(hit, ids, errors, seconds)

    def _run_load(
        self, meta: Any, before_load: Any, wait_for: str | None, layer_loaded: Any = None
    ) -> tuple[set[int], float]:
        if before_load is not None:
            before_load()
        self.worker.bind_connector_metadata(meta)
        start = time.monotonic()
        self.worker.start_load_kv(None)
        for name in self.kv:
            self.worker.wait_for_layer_load(name)
            if layer_loaded is not None:
                layer_loaded(name)
        errors = set(self.worker.get_block_ids_with_load_errors())
        if wait_for is not None:  # the model runner polls get_finished every step
            self.worker.wait_for_save()
            self.worker.clear_connector_metadata()
            end = time.monotonic() + 60
            while True:
                _, recving = self.worker.get_finished(set())
                errors |= self.worker.get_block_ids_with_load_errors()
                if recving and wait_for in recving:
                    break
                assert time.monotonic() < end, "the asynchronous load never finished"
                time.sleep(0.005)
        return errors, time.monotonic() - start

    def save_layers(self, names: list[str] | None = None) -> None:
        """The forward's per-layer hook: each layer's KV is in the paged cache, ``save_kv_layer`` it."""
        for name in names if names is not None else list(self.kv):
            self.worker.save_kv_layer(name, self.kv[name], None)

    def release(self, block_ids: list[int]) -> None:
        """Give a finished request's blocks back to the free list."""
        self._free.extend(block_ids)

    def layer_names(self) -> list[str]:
        return list(self.kv)

    def end_forward(self) -> set[int]:
        """The model runner after a forward: ``wait_for_save``, then the blocks whose load failed."""
        self.worker.wait_for_save()
        self._forward_ended = True
        return set(self.worker.get_block_ids_with_load_errors())

    def finish_step(self, request: Any, block_ids: list[int]) -> None:
        """After the forward: the worker saves, the scheduler frees - once the saves are done when the
        connector asks to delay the free."""
        if not self._forward_ended:
            self.worker.wait_for_save()
        self._forward_ended = False
        self.worker.clear_connector_metadata()
        delay, _ = self.scheduler.request_finished_all_groups(request, (block_ids,))
        finished = {request.request_id}
        end = time.monotonic() + 60
        while delay:
            sending, _ = self.worker.get_finished(finished)
            finished = set()
            if sending and request.request_id in sending:
                break
            assert time.monotonic() < end, "the asynchronous save never finished"
            time.sleep(0.005)

    # --- the paged cache as the model sees it ---------------------------------------------------

    def write_tokens(self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], start: int) -> None:
        """Store per-layer K/V ``[1, heads, n, dim]`` for tokens ``start..start+n`` into the paged cache."""
        for (k, v), cache in zip(layer_kv, self.kv.values(), strict=True):
            for t in range(k.shape[2]):
                pos = start + t
                block, off = block_ids[pos // self.block_size], pos % self.block_size
                cache[0, block, off] = k[0, :, t]
                cache[1, block, off] = v[0, :, t]

    def write_layer_tokens(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, block_ids: list[int], start: int
    ) -> None:
        """One layer's K/V ``[1, heads, n, dim]`` for tokens ``start..start+n`` into the paged cache."""
        cache = list(self.kv.values())[layer]
        for t in range(k.shape[2]):
            pos = start + t
            block, off = block_ids[pos // self.block_size], pos % self.block_size
            cache[0, block, off] = k[0, :, t]
            cache[1, block, off] = v[0, :, t]

    def read_layer_tokens(self, layer: int, block_ids: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K/V ``[1, heads, n, dim]`` of the first ``n`` tokens, from the paged cache."""
        cache = list(self.kv.values())[layer]
        k = torch.stack([cache[0, block_ids[p // self.block_size], p % self.block_size] for p in range(n)], dim=1)
        v = torch.stack([cache[1, block_ids[p // self.block_size], p % self.block_size] for p in range(n)], dim=1)
        return k.unsqueeze(0).contiguous(), v.unsqueeze(0).contiguous()

    def read_tokens(self, block_ids: list[int], n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer K/V ``[1, heads, n, dim]`` of the first ``n`` tokens, from the paged cache."""
        out = []
        for cache in self.kv.values():
            k = torch.stack([cache[0, block_ids[p // self.block_size], p % self.block_size] for p in range(n)], dim=1)
            v = torch.stack([cache[1, block_ids[p // self.block_size], p % self.block_size] for p in range(n)], dim=1)
            out.append((k.unsqueeze(0).contiguous(), v.unsqueeze(0).contiguous()))
        return out

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()
