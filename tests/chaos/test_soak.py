"""The CI soak: ``kvpool bench soak --duration 20 --json`` (client processes, a mixed checked workload, a
store killed and restarted in the middle). A longer soak on demand: ``kvpool bench soak --duration 3600``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.slow]

SOAK_S = 20


def test_short_soak_with_a_store_restart() -> None:
    cmd = [
        sys.executable,
        "-m",
        "kvpool.tools.cli",
        "bench",
        "soak",
        "--duration",
        str(SOAK_S),
        "--clients",
        "2",
        "--threads",
        "2",
        "--json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=SOAK_S + 180)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\nRELIABILITY {json.dumps({'fault': f'soak {SOAK_S} s with a store SIGKILL + restart', **doc})}")
    assert set(doc) == {"ops", "errors", "wrong_reads", "p50_us", "p99_us", "peak_rss_bytes"}
    assert doc["wrong_reads"] == 0
    assert doc["ops"] > 0
    assert 0 < doc["p50_us"] <= doc["p99_us"]
    assert "CLIENT_PROCESS_FAILED" not in doc["errors"]
    roles = sorted(name.split("-")[0] for name in doc["peak_rss_bytes"])
    # the master, the surviving store, the killed one and its restart
    assert roles == ["master", "store", "store", "store"], doc["peak_rss_bytes"]
    assert all(n > 0 for n in doc["peak_rss_bytes"].values())
