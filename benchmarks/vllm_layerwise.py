"""What layer-by-layer pipelining (``layerwise``) buys the vLLM connector: one step that loads a prefix,
and one step that saves a prompt, with the whole-request path and with the layerwise one.

A model forward is simulated on the CPU: per layer, ``wait_for_layer_load``, then a fixed amount of
matrix-multiply compute (``--layer-ms``), then ``save_kv_layer``. The paged cache is vLLM's
``[2, blocks, block_size, kv_heads, head_dim]`` per layer (tests/conformance/vllm_driver.py, vLLM's real
scheduler-side classes), against a local cluster in this machine (or ``--master``).

- load step: scheduler lookup, ``start_load_kv``, the forward, ``wait_for_save``; whole-request: the
  load completes inside ``start_load_kv``; layerwise: each layer's read overlaps the layers before it.
- save step: the forward, then ``wait_for_save`` with synchronous saves (the step ends when every block
  and marker is in); whole-request: one put after the forward; layerwise: each layer's put starts
  when the layer is done.

The ceiling of each step is its compute alone (the forward without the pool). Medians of ``--runs``.
Needs torch + vllm (scripts/install-conformance-deps.sh).

Usage::

    python benchmarks/vllm_layerwise.py [--layers 8] [--blocks 64] [--layer-ms 4] [--runs 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from kvpool.tools.argtypes import positive_int  # noqa: E402

BLOCK, KV_HEADS, HEAD_DIM = 16, 8, 64


class Compute:
    """A layer's worth of CPU work: matrix multiplies calibrated to ``layer_ms``."""

    def __init__(self, layer_ms: float) -> None:
        import torch

        self.a = torch.randn(256, 256)
        start = time.perf_counter()
        for _ in range(20):
            self.a @ self.a
        each = (time.perf_counter() - start) / 20
        self.repeats = max(1, round(layer_ms / 1000 / each))

    def layer(self) -> None:
        for _ in range(self.repeats):
            self.a @ self.a


def forward(inst: Any, compute: Compute, load_waits: bool, layer_saves: bool) -> None:
    for name in inst.layer_names():
        if load_waits:
            inst.worker.wait_for_layer_load(name)
        compute.layer()
        if layer_saves:
            inst.save_layers([name])


def one_run(vd: Any, instances: dict[str, Any], compute: Compute, blocks: int, run: int) -> dict[str, float]:
    """Each mode saves then loads a prompt of its own (fresh keys: nothing is skipped as present)."""
    import torch

    out: dict[str, float] = {}
    start = time.perf_counter()
    forward(instances["whole-a"], compute, load_waits=False, layer_saves=False)
    out["compute_s"] = time.perf_counter() - start
    for mode in ("whole", "layerwise"):
        a, b = instances[f"{mode}-a"], instances[f"{mode}-b"]
        tokens = [(run * 7919 + i + (mode == "layerwise") * 104729) % 30000 for i in range(blocks * BLOCK + 1)]
        request = vd.make_request(f"save-{mode}-{run}", tokens, BLOCK)
        step = a.prefill(request)
        for cache in a.kv.values():
            cache[:, step.block_ids] = torch.randn(cache[:, step.block_ids].shape)
        start = time.perf_counter()
        forward(a, compute, load_waits=False, layer_saves=mode == "layerwise")
        a.end_forward()
        out[f"save_{mode}_s"] = time.perf_counter() - start
        a.finish_step(request, step.block_ids)

        reader = vd.make_request(f"load-{mode}-{run}", tokens, BLOCK)
        start = time.perf_counter()
        got = b.prefill(reader, forward_waits=mode == "layerwise")
        forward(b, compute, load_waits=mode == "layerwise", layer_saves=False)
        errors = b.end_forward()
        out[f"load_{mode}_s"] = time.perf_counter() - start
        if got.external_tokens != blocks * BLOCK or errors:
            raise RuntimeError(f"{mode}: loaded {got.external_tokens} tokens, {len(errors)} load errors")
        b.finish_step(reader, got.block_ids)
        b.release(got.block_ids)
        a.release(step.block_ids)
    return out


def measure(master: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from tests.conformance import vllm_driver as vd

    torch.set_num_threads(1)
    compute = Compute(args.layer_ms)
    modes = {"whole": {}, "layerwise": {"layerwise": True}}
    instances = {
        f"{mode}-{side}": vd.Instance(
            {"master": master, "load_async": False, "save_async": False, "timeout_s": 30, **extra},
            layers=args.layers,
            kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            block_size=BLOCK,
            num_blocks=args.blocks + 2,
            model=f"bench-layerwise-{mode}",
        )
        for mode, extra in modes.items()
        for side in ("a", "b")
    }
    try:
        runs = [one_run(vd, instances, compute, args.blocks, run) for run in range(args.runs)]
    finally:
        for inst in instances.values():
            inst.close()
    medians = {name: statistics.median(r[name] for r in runs) for name in runs[0]}
    block_bytes = 2 * BLOCK * KV_HEADS * HEAD_DIM * 4
    return {
        "layers": args.layers,
        "blocks": args.blocks,
        "mib_per_step": args.layers * args.blocks * block_bytes / 2**20,
        "layer_ms": args.layer_ms,
        "runs": args.runs,
        **{name: round(value, 4) for name, value in medians.items()},
        "load_layerwise_vs_whole": round(medians["load_layerwise_s"] / medians["load_whole_s"], 3),
        "save_layerwise_vs_whole": round(medians["save_layerwise_s"] / medians["save_whole_s"], 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--master", default="", help="an existing master; default: start a local cluster")
    parser.add_argument("--layers", type=positive_int, default=8)
    parser.add_argument("--blocks", type=positive_int, default=64, help="blocks of 16 tokens per step")
    parser.add_argument("--layer-ms", type=float, default=4.0, help="compute per layer")
    parser.add_argument("--runs", type=positive_int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.master:
        result = measure(args.master, args)
    else:
        from kvpool.tools.local_cluster import LocalCluster

        with tempfile.TemporaryDirectory() as tmp:
            cluster = LocalCluster(stores=1, store_size="512MiB", base_dir=Path(tmp)).start()
            try:
                result = measure(cluster.master, args)
            finally:
                cluster.stop()
    if args.json:
        print(json.dumps(result))
    else:
        for name, value in result.items():
            print(f"{name:26} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
