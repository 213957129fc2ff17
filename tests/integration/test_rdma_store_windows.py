"""A real store process over the cross-process FAKE NIC (KVPOOL_VERBS=fake) with the compiled verbs layer
binds a type-2 memory window per grant through BIND_MW work requests (decision 0020, 0027): it never falls back
to whole-segment admission, and the client's bytes move through those windows."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool.tools.local_cluster import LocalCluster
from kvpool.transfer.verbs_native import WINDOWS_LOG_LINE, native_built
from tests.support.cluster import client

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not native_built(), reason="kvpool.transfer._verbs is not built (libibverbs-dev)"),
]

FALLBACK_WARNING = "no memory windows in this verbs layer"


def _windows_bound(metrics_endpoint: str) -> float:
    text = urllib.request.urlopen(f"http://{metrics_endpoint}/metrics", timeout=10).read().decode()
    line = next(line for line in text.splitlines() if line.startswith("kvpool_store_rdma_windows_bound_total"))
    return float(line.split()[-1])


def test_a_store_on_the_compiled_layer_binds_a_window_per_grant_and_never_falls_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, make_cluster: Callable[..., LocalCluster]
) -> None:
    monkeypatch.setenv("KVPOOL_VERBS", "fake")
    monkeypatch.setenv("KVPOOL_FAKE_VERBS_DIR", str(tmp_path / "fake-nic"))
    monkeypatch.delenv("KVPOOL_NATIVE_VERBS", raising=False)  # the default: the compiled layer where built
    cluster = make_cluster(stores=1, store_size="16MiB")
    (store,) = cluster.stores
    values = {f"w{i}": os.urandom(size) for i, size in enumerate((4096, 65536, (1 << 20) + 3))}
    before = _windows_bound(store.endpoints["metrics"])
    with client(cluster.master) as pool:
        assert pool.batch_put(list(values), list(values.values())) == [0] * len(values)
        assert pool.batch_get(list(values)) == list(values.values())
        metrics = pool.metrics()
    assert metrics["bytes_rdma"] == 2 * sum(len(v) for v in values.values())
    assert metrics["bytes_tcp"] == 0
    assert _windows_bound(store.endpoints["metrics"]) - before >= 2 * len(values)  # one per put and per get grant
    log = Path(store.log).read_text()
    assert WINDOWS_LOG_LINE in log, log
    assert FALLBACK_WARNING not in log, log
