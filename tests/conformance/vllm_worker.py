"""One vLLM-like engine process of the vLLM end-to-end check (tests/conformance/test_vllm_e2e.py).

    vllm_worker.py write --master M --seed S [--prompt-len 256]
        prefill the prompt through the connector's scheduler/worker calls; the KV goes into a paged cache
        and the connector saves its full blocks
    vllm_worker.py read --master M --seed S [--prompt-len 256] [--turn-len 40] [--pause-file F]
        prompt + a new turn: the connector finds and loads the prefix blocks into the paged cache, the
        model prefills only the rest, and the logits are compared with a full recompute. With
        --pause-file, a second engine instance in the same process (``timeout_s`` --timeout-s, TCP only)
        then reads again, printing ``looked-up`` after the scheduler's lookup and waiting for F to exist
        before the load (the test breaks the pool in between); one process saves an import of vLLM.

The model is the tiny Llama of tiny_llama.py; each process prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import tiny_llama as tl  # the adapter sits next to this script (sys.path[0])
import torch
import vllm_driver as vd

BLOCK = 16
HEAD_DIM = 32  # hidden 128 / 4 query heads
LAYERWISE = {"layerwise": True, "load_async": False, "save_async": True}


def instance(args: argparse.Namespace, model: Any, name: str = "", **extra: Any) -> Any:
    extra = {"master": args.master, **extra}
    return vd.Instance(
        extra,
        layers=model.config.num_hidden_layers,
        kv_heads=model.config.num_key_value_heads,
        head_dim=HEAD_DIM,
        block_size=BLOCK,
        num_blocks=64,
        model=name or f"tiny-llama-{args.seed}",
    )


def write(args: argparse.Namespace) -> dict[str, Any]:
    model = tl.load_model(args.seed)
    prompt = tl.tokens(args.seed, args.prompt_len)
    inst = instance(args, model)
    try:
        request = vd.make_request("write", prompt, BLOCK)
        step = inst.prefill(request)
        _, cache = tl.forward(model, prompt)
        inst.write_tokens(tl.kv_layers(cache), step.block_ids, 0)
        inst.finish_step(request, step.block_ids)
        metrics = inst.worker.pool.metrics()
    finally:
        inst.close()
    layerwise = write_layerwise(args, model, prompt)
    return {
        "external_tokens": step.external_tokens,
        "blocks": len(prompt) // BLOCK,
        "metrics": metrics,
        "layerwise": layerwise,
    }


def write_layerwise(args: argparse.Namespace, model: Any, prompt: list[int]) -> dict[str, Any]:
    """The prompt again, under a namespace of its own, saved layer by layer from inside the forward: as
    each decoder layer finishes, its KV goes into the paged cache and ``save_kv_layer`` starts its put."""
    inst = instance(args, model, name=f"tiny-llama-{args.seed}-layerwise", **LAYERWISE)
    try:
        request = vd.make_request("write-layerwise", prompt, BLOCK)
        step = inst.prefill(request)
        cache = tl.empty_cache()
        names = inst.layer_names()

        def saved(layer: int) -> None:
            k, v = tl.kv_layers(cache)[layer]
            inst.write_layer_tokens(layer, k, v, step.block_ids, 0)
            inst.worker.save_kv_layer(names[layer], inst.kv[names[layer]], None)

        with tl.layer_hooks(model, after=saved):
            tl.forward(model, prompt, cache)
        inst.end_forward()
        inst.finish_step(request, step.block_ids)
    finally:
        inst.close()
    return {"external_tokens": step.external_tokens}


def _wait_for(path: Path, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear in {timeout} s")
        time.sleep(0.01)


def read(args: argparse.Namespace) -> dict[str, Any]:
    result = read_once(args, "read", None)
    if args.pause_file:

        def pause() -> None:
            print("looked-up", file=sys.stderr, flush=True)
            _wait_for(Path(args.pause_file), 60)

        result["failed_pool"] = read_once(args, "read-paused", pause, timeout_s=args.timeout_s, use_shm=False)
    result["layerwise"] = read_layerwise(args)
    return result


def read_layerwise(args: argparse.Namespace) -> dict[str, Any]:
    """prompt + turn against the layerwise namespace: ``start_load_kv`` queues one read per layer, the
    forward waits for each layer's blocks just before that layer runs; load errors are collected after
    the forward, as vLLM's model runner does, and the failed blocks recomputed."""
    model = tl.load_model(args.seed)
    full = tl.tokens(args.seed, args.prompt_len) + tl.tokens(args.seed + 1, args.turn_len)
    inst = instance(args, model, name=f"tiny-llama-{args.seed}-layerwise", **LAYERWISE)
    try:
        request = vd.make_request("read-layerwise", full, BLOCK)
        step = inst.prefill(request, forward_waits=True)
        hit = step.external_tokens
        names = inst.layer_names()
        heads = model.config.num_key_value_heads
        cache = tl.cache_from_layers(
            [(torch.zeros(1, heads, hit, HEAD_DIM), torch.zeros(1, heads, hit, HEAD_DIM)) for _ in names]
        )
        waited: list[int] = []

        def loaded(layer: int) -> None:
            inst.worker.wait_for_layer_load(names[layer])
            waited.append(layer)
            k, v = inst.read_layer_tokens(layer, step.block_ids, hit)
            target_k, target_v = tl.kv_layers(cache)[layer]
            target_k.copy_(k)
            target_v.copy_(v)

        with tl.layer_hooks(model, before=loaded):
            suffix_logits, _ = tl.forward(model, full[hit:], cache)
        errors = inst.end_forward()
        failed_at = min((step.block_ids.index(b) for b in errors), default=None)
        reused = hit if failed_at is None else failed_at * BLOCK
        if reused != hit:  # vLLM's recompute policy: from the first failed block on
            prefix = tl.cache_from_layers(inst.read_tokens(step.block_ids, reused)) if reused else None
            suffix_logits, _ = tl.forward(model, full[reused:], prefix)
        inst.finish_step(request, step.block_ids)
    finally:
        inst.close()
    full_logits, _ = tl.forward(model, full)
    return {
        "external_tokens": hit,
        "load_errors": len(errors),
        "waited_layers": waited,
        "reused_tokens": reused,
        "max_abs_diff": float((suffix_logits - full_logits[:, reused:]).abs().max()),
    }


def read_once(args: argparse.Namespace, req_id: str, pause: Any, **extra: Any) -> dict[str, Any]:
    model = tl.load_model(args.seed)
    full = tl.tokens(args.seed, args.prompt_len) + tl.tokens(args.seed + 1, args.turn_len)
    inst = instance(args, model, **extra)
    try:
        request = vd.make_request(req_id, full, BLOCK)
        step = inst.prefill(request, before_load=pause)
        # vLLM's recompute policy: from the first block that failed to load, the tokens are recomputed.
        failed_at = min((step.block_ids.index(b) for b in step.load_errors), default=None)
        reused = step.external_tokens if failed_at is None else failed_at * BLOCK
        start = time.perf_counter()
        prefix = tl.cache_from_layers(inst.read_tokens(step.block_ids, reused)) if reused else None
        suffix_logits, _ = tl.forward(model, full[reused:], prefix)
        suffix_ms = (time.perf_counter() - start) * 1000
        inst.finish_step(request, step.block_ids)
    finally:
        inst.close()
    full_logits, _ = tl.forward(model, full)
    expected = full_logits[:, reused:]
    alone, _ = tl.forward(model, full[reused:]) if reused else (None, None)
    return {
        "external_tokens": step.external_tokens,
        "load_errors": len(step.load_errors),
        "load_seconds": step.load_seconds,
        "reused_tokens": reused,
        "suffix_tokens": len(full) - reused,
        "max_abs_diff": float((suffix_logits - expected).abs().max()),
        # Control: the same suffix without the prefix's KV must differ - the loaded KV is what makes it right.
        "control_diff": float((alone - expected).abs().max()) if alone is not None else None,
        "suffix_prefill_ms": suffix_ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=("write", "read"))
    parser.add_argument("--master", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--turn-len", type=int, default=40)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--pause-file", default="")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # two of these may share 2 cores with the cluster
    result = write(args) if args.role == "write" else read(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
