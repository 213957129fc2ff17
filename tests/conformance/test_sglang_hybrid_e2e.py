"""End-to-end hybrid-model check of the HiCache v2 calls: a model with attention and Mamba-like recurrent
layers keeps both its KV pages and its recurrent state in the pool, and another process continues from them
exactly.

Process A prefills a 256-token prompt of the tiny hybrid model (tiny_hybrid.py) and backs up, through
``KvPoolHiCacheStorage.batch_set_v2``, its attention KV pages and its recurrent states (the Mamba side pool,
``TRAILING_PAGES``) as two radix nodes of two pages. Process B restores with ``batch_exists_v2`` +
``batch_get_v2``, prefills only the rest and gets the logits of a full prefill: once for the whole prompt
(4 pages), once for a prompt that leaves A's after 200 tokens, where the KV matches 3 pages but a recurrent
state exists only at page 2, so exactly 2 pages are restorable. Needs torch + sglang (skipped without them,
failed under CI).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.tools.local_cluster import LocalCluster
from tests.conformance.sglang_shim import require
from tests.conformance.workers import run_worker

pytestmark = [pytest.mark.conformance, pytest.mark.integration]

WORKER = Path(__file__).with_name("hybrid_worker.py")

TOLERANCE = 1e-4  # as tests/conformance/test_model_e2e.py


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    require("torch", "sglang")
    c = LocalCluster(stores=1, store_size="64MiB", base_dir=tmp_path_factory.mktemp("hybrid"))
    try:
        yield c.start()
    finally:
        c.stop()


def test_a_second_process_continues_a_hybrid_model_from_its_kv_and_recurrent_state(cluster: LocalCluster) -> None:
    wrote = run_worker(WORKER, "write", "--master", cluster.master, "--seed", "11")
    assert wrote["pages"] == 4
    assert wrote["written"] == [{"kv": [True, True], "mamba": [True]}] * 2

    got = run_worker(WORKER, "read", "--master", cluster.master, "--seed", "11")
    same = got["same_prompt"]
    assert same["restorable"] == [2, 4]  # a state at each node's end
    assert same["kv_hit_pages"] == 4
    assert same["loaded"] == {"kv": [True] * 4, "mamba": [True]}
    assert (same["reused_tokens"], same["suffix_tokens"]) == (256, 40)
    assert same["max_abs_diff"] <= TOLERANCE, same
    assert same["no_state_diff"] > 1e-2, same  # the KV alone, without the recurrent state, is not enough

    diverged = got["diverged"]
    assert diverged["pool_hits"] == {"kv": 3, "mamba": 2}  # KV matches 3 pages, a state exists at 2
    assert diverged["restorable"] == [2]
    assert diverged["kv_hit_pages"] == 2
    assert diverged["loaded"] == {"kv": [True] * 2, "mamba": [True]}
    assert (diverged["reused_tokens"], diverged["suffix_tokens"]) == (128, 132)
    assert diverged["max_abs_diff"] <= TOLERANCE, diverged
    assert diverged["no_state_diff"] > 1e-2, diverged
