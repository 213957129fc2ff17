"""One SGLang-like engine process of the hybrid end-to-end check (tests/conformance/test_sglang_hybrid_e2e.py).

    hybrid_worker.py write --master M --seed S
        prefill a 256-token prompt of the tiny hybrid model (tiny_hybrid.py) page by page, put its attention
        KV pages in the host KV pool and its recurrent states in the host Mamba pool, and back them up
        through the HiCache backend's batch_set_v2 the way SGLang backs up radix nodes: two nodes of two
        pages, each with the Mamba state at its end (TRAILING_PAGES)
    hybrid_worker.py read --master M --seed S
        two requests: the prompt + a new turn, and a prompt that leaves the first after 200 tokens. Each
        asks batch_exists_v2 (KV pages, Mamba PoolHitPolicy.TRAILING_PAGES), restores the longest
        restorable prefix with batch_get_v2, prefills only the rest and compares its logits with a full
        prefill

The backend is KvPoolHiCacheStorage built by SGLang's own StorageBackendFactory; the host pools are the
fakes of sglang_host_pools.py. Each process prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace
from typing import Any

import torch

from kvpool.common.keys import page_keys
from tests.conformance import tiny_hybrid as th
from tests.conformance.sglang_host_pools import FakeMambaPoolHost, FakeMHATokenToKVPoolHost
from tests.conformance.sglang_shim import install_light_sglang

PAGE = 64
HOST_PAGES = 8
MODEL_NAME = "tiny-hybrid"


def sglang() -> SimpleNamespace:
    """SGLang's storage interface: the v2 types and the factory that builds dynamic backends."""
    install_light_sglang()
    from sglang.srt.mem_cache import hicache_storage as hs  # type: ignore[import-untyped]
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # type: ignore[import-untyped]

    return SimpleNamespace(
        HiCacheStorageConfig=hs.HiCacheStorageConfig,
        HiCacheStorageExtraInfo=hs.HiCacheStorageExtraInfo,
        PoolName=hs.PoolName,
        PoolTransfer=hs.PoolTransfer,
        PoolHitPolicy=hs.PoolHitPolicy,
        StorageBackendFactory=StorageBackendFactory,
    )


def backend_with_pools(sgl: Any, master: str, seed: int) -> tuple[Any, FakeMHATokenToKVPoolHost, FakeMambaPoolHost]:
    config = sgl.HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=f"{MODEL_NAME}-{seed}",
        extra_config={
            "backend_name": "kvpool",
            "module_path": "kvpool.client.connectors.sglang",
            "class_name": "KvPoolHiCacheStorage",
            "interface_v1": 1,
            "master": master,
            "timeout_s": 10,
            "lookup_timeout_s": 5,
        },
    )
    backend = sgl.StorageBackendFactory.create_backend("dynamic", config, None)
    kv = FakeMHATokenToKVPoolHost(HOST_PAGES, PAGE, th.ATTENTION_LAYERS, th.HEADS, th.HEAD_DIM)
    mamba = FakeMambaPoolHost(
        HOST_PAGES, th.RECURRENT_LAYERS, (th.D_INNER, th.D_STATE), (th.D_INNER, th.CONV_KERNEL - 1)
    )
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, sgl.PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, sgl.PoolName.MAMBA)
    return backend, kv, mamba


def write(args: argparse.Namespace) -> dict[str, Any]:
    sgl = sglang()
    model = th.load_model(args.seed)
    prompt = th.tokens(args.seed, 4 * PAGE)
    states = th.prefill_by_pages(model, prompt, PAGE)
    keys = page_keys(prompt, PAGE)
    backend, kv, mamba = backend_with_pools(sgl, args.master, args.seed)
    try:
        kv.store(0, states[-1].kv)
        for slot, state in enumerate(states):
            mamba.store(slot, state.ssm, state.conv)
        written: list[dict[str, list[bool]]] = []
        for first, end in ((0, 2), (2, 4)):  # two radix nodes, each with one Mamba state at its end
            transfers = [
                sgl.PoolTransfer(sgl.PoolName.KV, host_indices=kv.slots(first, end - first), keys=keys[first:end]),
                sgl.PoolTransfer(
                    sgl.PoolName.MAMBA,
                    host_indices=torch.tensor([end - 1]),
                    keys=[keys[end - 1]],
                    hit_policy=sgl.PoolHitPolicy.TRAILING_PAGES,
                ),
            ]
            written.append(backend.batch_set_v2(transfers, sgl.HiCacheStorageExtraInfo(prefix_keys=keys[:first])))
    finally:
        backend.close()
    return {"pages": len(keys), "written": written}


def restore(sgl: Any, args: argparse.Namespace, model: th.TinyHybrid, full: list[int]) -> dict[str, Any]:
    """One request on a fresh backend and fresh host pools: look up, restore, prefill the rest, compare."""
    keys = page_keys(full, PAGE)
    backend, kv, mamba = backend_with_pools(sgl, args.master, args.seed)
    try:
        probe = [sgl.PoolTransfer(sgl.PoolName.MAMBA, keys=keys[-1:], hit_policy=sgl.PoolHitPolicy.TRAILING_PAGES)]
        found = backend.batch_exists_v2(keys, probe, sgl.HiCacheStorageExtraInfo())
        pages = max(found.restorable_prefix_pages or [0])
        loaded: dict[str, list[bool]] = {}
        if pages:
            loaded = backend.batch_get_v2(
                [
                    sgl.PoolTransfer(sgl.PoolName.KV, host_indices=kv.slots(0, pages), keys=keys[:pages]),
                    sgl.PoolTransfer(sgl.PoolName.MAMBA, host_indices=torch.tensor([0]), keys=[keys[pages - 1]]),
                ]
            )
    finally:
        backend.close()
    reused = pages * PAGE
    ssm, conv = mamba.load(0)
    restored = th.State(kv=kv.load(0, reused), conv=conv, ssm=ssm)
    suffix_logits, _ = th.forward(model, full[reused:], restored if pages else None)
    full_logits, _ = th.forward(model, full)
    expected = full_logits[:, reused:]
    # Control: the prefix's attention KV without its recurrent state must give other logits - the
    # side pool's bytes are what make the continuation right.
    without_state = th.State(
        kv=restored.kv, conv=[torch.zeros_like(c) for c in conv], ssm=[torch.zeros_like(s) for s in ssm]
    )
    blind, _ = th.forward(model, full[reused:], without_state if pages else None)
    return {
        "kv_hit_pages": found.kv_hit_pages,
        "restorable": found.restorable_prefix_pages,
        "pool_hits": {str(k): v for k, v in found.extra_pool_hit_pages.items()},
        "loaded": loaded,
        "reused_tokens": reused,
        "suffix_tokens": len(full) - reused,
        "max_abs_diff": float((suffix_logits - expected).abs().max()),
        "no_state_diff": float((blind - expected).abs().max()),
    }


def read(args: argparse.Namespace) -> dict[str, Any]:
    sgl = sglang()
    model = th.load_model(args.seed)
    prompt = th.tokens(args.seed, 4 * PAGE)
    same_prompt = prompt + th.tokens(args.seed + 1, 40)
    diverged = prompt[:200] + th.tokens(args.seed + 2, 60)  # shares 3 full pages; state exists after 2
    return {"same_prompt": restore(sgl, args, model, same_prompt), "diverged": restore(sgl, args, model, diverged)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=("write", "read"))
    parser.add_argument("--master", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # two of these may share 2 cores with the cluster
    result = write(args) if args.role == "write" else read(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
