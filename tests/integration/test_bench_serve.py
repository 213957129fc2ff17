"""``kvpool bench serve`` end to end: the real command on a slice of the shipped trace, with its two small
local clusters (pool and pool with an SSD tier); checks the JSON's shape and that its figures are sane."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from kvpool.tools.bench_serve import DEFAULT_TRACE
from kvpool.tools.serve_model import CONFIGS, load_profiles, percentile
from kvpool.tools.trace import load_trace

pytestmark = pytest.mark.integration

ROW_FIELDS = {"model", "config", "rate_scale", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "slo_fraction"}
RATES = (1.0, 4.0)


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    argv = [
        sys.executable,
        "-m",
        "kvpool.tools.cli",
        "bench",
        "serve",
        "--limit-requests",
        "200",
        "--capacity",
        "1M",
        "--stores",
        "1",
        "--instances",
        "4",
        "--rate-scale",
        ",".join(str(r) for r in RATES),
        "--json",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=dict(os.environ), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_rows_cover_every_profile_config_and_rate(report: dict[str, Any]) -> None:
    profiles = list(load_profiles())
    rows = report["rows"]
    assert all(set(row) == ROW_FIELDS for row in rows)
    keys = {(r["model"], r["config"], r["rate_scale"]) for r in rows}
    assert keys == {(m, c, s) for m in profiles for c in CONFIGS for s in RATES}
    for row in rows:
        assert 0 < row["ttft_p50_s"] <= row["ttft_p90_s"] <= row["ttft_p99_s"]
        assert 0.0 <= row["slo_fraction"] <= 1.0


def test_goodput_and_its_ratios_for_every_profile(report: dict[str, Any]) -> None:
    profiles = list(load_profiles())
    assert set(report["goodput"]) == set(CONFIGS)
    assert report["goodput"] == report["models"][profiles[0]]["goodput"]
    assert list(report["models"]) == profiles
    for model in report["models"].values():
        assert set(model["goodput"].values()) <= {0.0, *RATES}
        ratios = model["goodput_ratio"]
        assert set(ratios) == {"pool/private", "pool/none", "pool_ssd/private", "pool_ssd/none"}
        for name, ratio in ratios.items():
            pool, base = name.split("/")
            if model["goodput"][base] == 0:
                assert ratio is None
            else:
                assert ratio == pytest.approx(model["goodput"][pool] / model["goodput"][base], abs=1e-3)


def test_the_real_pool_hits_at_least_what_private_caches_hit(report: dict[str, Any]) -> None:
    hit = report["token_hit_rate"]
    assert hit["none"] == 0.0
    assert hit["pool"] > 0.0  # the slice reuses prefixes
    assert hit["pool"] >= hit["private"]
    assert hit["pool"] >= hit["prefix_private"] - 0.01
    # The SSD tier holds the whole working set: it keeps at least what DRAM alone keeps.
    assert hit["pool_ssd"] >= hit["pool"] - 0.01


def test_fetch_rates_were_measured_on_both_clusters(report: dict[str, Any]) -> None:
    assert report["measured_fetch_gbs"]["dram"] > 0
    assert report["measured_fetch_gbs"]["ssd"] > 0
    assert report["fetch_gbs"] == report["measured_fetch_gbs"]
    assert report["pool_ssd_cluster"]["pool_demotions"] > 0  # the replay pushed blocks down to the SSD tier
    assert report["requests"] == 200


def test_without_a_cache_no_request_beats_its_own_prefill(report: dict[str, Any]) -> None:
    # TTFT_i >= prefill_i for every request, so each percentile of TTFT is at least that of the prefills.
    trace = load_trace(DEFAULT_TRACE, 200)
    for name, profile in load_profiles().items():
        prefills = [profile.prefill_seconds(r.input_length, 0) for r in trace]
        for row in report["rows"]:
            if row["model"] == name and row["config"] == "none":
                assert row["ttft_p50_s"] >= round(percentile(prefills, 50), 4) - 1e-4
                assert row["ttft_p99_s"] >= round(percentile(prefills, 99), 4) - 1e-4
