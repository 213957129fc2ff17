"""End-to-end model check: KV computed by one engine process is reused, exactly, by another.

Process A prefills a 256-token prompt of a tiny random Llama and writes its 4 KV pages (64 tokens, per
layer K and V, keyed by SGLang page hashes + a Namespace) to a real local cluster. Process B gets the same
prompt plus a new turn, finds the 4-page prefix, prefetches it, rebuilds the cache, prefills only the
suffix, and its logits equal a full recompute. Needs torch + transformers (skipped without them, failed
under CI).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.tools.local_cluster import LocalCluster
from tests.conformance.sglang_shim import require
from tests.conformance.workers import run_worker

pytestmark = [pytest.mark.conformance, pytest.mark.integration]

WORKER = Path(__file__).with_name("model_worker.py")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    require("torch", "transformers")
    c = LocalCluster(stores=2, store_size="64MiB", base_dir=tmp_path_factory.mktemp("model"))
    try:
        yield c.start()
    finally:
        c.stop()


def test_a_second_process_reuses_the_prefix_kv_exactly(cluster: LocalCluster) -> None:
    wrote = run_worker(WORKER, "write", "--master", cluster.master, "--seed", "7", "--prompt-len", "256")
    assert wrote["pages"] == 4
    assert wrote["queued"]
    assert wrote["written"]

    got = run_worker(
        WORKER, "read", "--master", cluster.master, "--seed", "7", "--prompt-len", "256", "--turn-len", "40"
    )
    assert got["hit_pages"] == 4
    assert got["fetched_pages"] == 4
    assert got["reused_tokens"] == 256
    assert got["suffix_tokens"] == 40
    assert got["max_abs_diff"] <= 1e-4, got
    assert got["control_diff"] > 1e-2, got  # without the prefix KV the logits are clearly different
