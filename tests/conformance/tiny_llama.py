"""The one place that touches the transformers model and cache API (it is moving: 5.x renamed
``past_key_values=`` to ``cache=`` and the output key with it; 4.x caches had ``key_cache``/``value_cache``
lists). Used by model_worker.py and benchmarks/prefill_with_pool.py. Pinned: transformers 5.24.0.

The model is a tiny random-weight Llama (4 layers, hidden 128, 4 query / 2 KV heads: GQA), seeded, built
from a ``LlamaConfig`` - nothing is downloaded. KV pages use SGLang's page_first object layout: per page a
K object and a V object, each ``[page_size, layers, kv_heads, head_dim]`` contiguous.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

VOCAB = 512


def load_model(seed: int = 0, layers: int = 4) -> Any:
    """A deterministic tiny Llama in eval mode, float32 on the CPU."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(config)
    return model.eval()


def tokens(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, VOCAB, (n,), generator=gen)]


# 5.x: forward(cache=...) -> out["cache"]; 4.x: forward(past_key_values=...) -> out["past_key_values"].
_FORWARD_PARAMS = inspect.signature(LlamaForCausalLM.forward).parameters
_CACHE_ARG = "cache" if "cache" in _FORWARD_PARAMS else "past_key_values"


@torch.no_grad()
def forward(model: Any, ids: list[int], cache: Any = None) -> tuple[torch.Tensor, Any]:
    """Logits for ``ids`` (continuing ``cache`` when given) and the updated cache."""
    kwargs: dict[str, Any] = {"input_ids": torch.tensor([ids]), "use_cache": True}
    if cache is not None:
        kwargs[_CACHE_ARG] = cache
    out = model(**kwargs)
    new_cache = out.get("cache") if "cache" in out else out.get("past_key_values")
    return out.logits, new_cache


def kv_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [1, kv_heads, tokens, head_dim]."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))  # transformers 4.x


def empty_cache() -> Any:
    """A cache to pass to :func:`forward` that the caller can watch fill, layer by layer."""
    return DynamicCache()


@contextmanager
def layer_hooks(
    model: Any, before: Callable[[int], None] | None = None, after: Callable[[int], None] | None = None
) -> Iterator[None]:
    """Call ``before(i)`` as decoder layer ``i`` starts and ``after(i)`` once it has run (its KV is then in
    the cache): where vLLM's attention calls ``wait_for_layer_load`` and ``save_kv_layer``."""
    handles = []
    for i, layer in enumerate(model.model.layers):
        if before is not None:
            handles.append(layer.register_forward_pre_hook(lambda _m, _a, i=i: before(i)))
        if after is not None:
            handles.append(layer.register_forward_hook(lambda _m, _a, _o, i=i: after(i)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def cache_from_layers(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def to_pages(layers: list[tuple[torch.Tensor, torch.Tensor]], page_size: int) -> list[torch.Tensor]:
    """Objects of the full pages, in pool order [page0_K, page0_V, page1_K, ...]."""
    k = torch.stack([lk[0] for lk, _ in layers])  # [layers, heads, tokens, dim]
    v = torch.stack([lv[0] for _, lv in layers])
    pages = k.shape[2] // page_size
    objects = []
    for p in range(pages):
        span = slice(p * page_size, (p + 1) * page_size)
        objects.append(k[:, :, span].permute(2, 0, 1, 3).contiguous())  # [page, layers, heads, dim]
        objects.append(v[:, :, span].permute(2, 0, 1, 3).contiguous())
    return objects


def from_pages(objects: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of :func:`to_pages`: ``objects`` is [2 * pages, page, layers, heads, dim]."""
    k = torch.cat(list(objects[0::2]))  # [tokens, layers, heads, dim]
    v = torch.cat(list(objects[1::2]))
    k, v = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)  # [layers, heads, tokens, dim]
    return [(k[i].unsqueeze(0).contiguous(), v[i].unsqueeze(0).contiguous()) for i in range(k.shape[0])]


def page_buffer(model: Any, pages: int, page_size: int) -> torch.Tensor:
    """Host memory for ``pages`` pages: [2 * pages, page, layers, kv_heads, head_dim] float32."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return torch.zeros((2 * pages, page_size, cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim))


def object_bytes(model: Any, page_size: int) -> int:
    return int(page_buffer(model, 1, page_size)[0].numel() * 4)


def byte_views(objects: torch.Tensor | list[torch.Tensor]) -> list[memoryview]:
    """Writable byte views of each object (CPU, contiguous), for the pool's buffer APIs."""
    return [o.numpy().data.cast("B") for o in objects]
