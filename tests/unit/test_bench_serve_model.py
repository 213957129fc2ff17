"""The pure serving model of ``kvpool bench serve``: cost model, queueing, statistics, against hand-computed
cases (no cluster)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from kvpool.tools.serve_model import (
    CacheOutcome,
    FetchRates,
    Job,
    ModelProfile,
    RateResult,
    build_jobs,
    global_hits,
    goodput,
    load_profiles,
    percentile,
    reusable,
    routed_hits,
    simulate,
    summarize,
)
from kvpool.tools.trace import Request, load_trace, make_router, route_all, simulate_global, simulate_routed

# Round numbers so that the expected times can be worked out by hand: 1 TFLOP/s x 0.5 = 5e11 FLOP/s.
TOY = ModelProfile(
    name="toy",
    description="hand-checkable",
    gpus=1,
    mfu=0.5,
    active_params=1_000_000_000,
    layers=2,
    attention_dim=10,
    kv_bytes_per_token=100,
    overhead_s=0.1,
    slo_ttft_s=1.0,
    source="test",
    peak_flops_per_gpu=1e12,
    gpu="toy-gpu",
)


def _req(ts_ms: float, tokens: int, first_id: int = 0) -> Request:
    blocks = -(-tokens // 512)
    return Request(ts_ms, tokens, 1, tuple(range(first_id, first_id + blocks)))


# ----------------------------------------------------------------------------------------------------
# Cost model
# ----------------------------------------------------------------------------------------------------


def test_prefill_without_cache_is_linear_plus_causal_attention() -> None:
    # 2 x 1e9 x 100 + 4 x 2 x 10 x (100 x 101 / 2) = 2e11 + 404,000 FLOPs
    assert TOY.prefill_flops(100, 0) == 200_000_404_000
    assert TOY.prefill_seconds(100, 0) == pytest.approx(0.1 + 200_000_404_000 / 5e11)


def test_reused_tokens_still_cost_attention_of_the_new_ones() -> None:
    # u = 40 new tokens after c = 60 cached: 2e9 x 40 + 80 x (40 x 60 + 40 x 41 / 2) = 8e10 + 257,600
    assert TOY.prefill_flops(100, 60) == 80_000_257_600
    assert TOY.prefill_seconds(100, 60) == pytest.approx(0.1 + 80_000_257_600 / 5e11)


def test_a_full_hit_still_computes_the_last_token() -> None:
    # c = 99, u = 1: 2e9 + 80 x (99 + 1)
    assert TOY.prefill_flops(100, 100) == 2_000_008_000
    assert TOY.prefill_flops(100, 500) == TOY.prefill_flops(100, 100)
    assert reusable(100, 100) == 99
    assert reusable(0, 10) == 0
    assert reusable(100, -5) == 0


def test_more_gpus_or_mfu_divide_the_compute_time() -> None:
    double = replace(TOY, gpus=2, overhead_s=0.0)
    single = replace(TOY, overhead_s=0.0)
    assert double.prefill_seconds(1000, 0) == pytest.approx(single.prefill_seconds(1000, 0) / 2)


# ----------------------------------------------------------------------------------------------------
# Jobs
# ----------------------------------------------------------------------------------------------------


def test_remote_hits_pay_the_fetch_at_the_tier_rates_and_arrivals_scale() -> None:
    trace = [_req(2000, 1024)]
    outcome = CacheOutcome(hit_tokens=(1024,), ssd_tokens=(512,), remote=True)
    rates = FetchRates(dram_bytes_per_s=1e9, ssd_bytes_per_s=1e8)
    (job,) = build_jobs(trace, [3], outcome, TOY, rates, rate_scale=2.0)
    assert job.arrival_s == pytest.approx(1.0)  # 2 s / 2
    assert job.instance == 3
    # 1023 reusable tokens: 512 from SSD (512 x 100 B / 1e8 B/s), 511 from DRAM (511 x 100 B / 1e9 B/s)
    assert job.fetch_s == pytest.approx(512e-6 + 51.1e-6)
    assert job.prefill_s == pytest.approx(TOY.prefill_seconds(1024, 1023))


def test_a_fetch_slower_than_recomputing_is_not_used() -> None:
    trace = [_req(0, 1024)]
    outcome = CacheOutcome(hit_tokens=(1024,), ssd_tokens=(0,), remote=True)
    # 1023 x 100 B at 1e4 B/s = 10.23 s to fetch; recomputing 1023 tokens saves about 2e9 x 1023 / 5e11 = 4.09 s
    (slow,) = build_jobs(trace, [0], outcome, TOY, FetchRates(1e4, 1e4), 1.0)
    assert slow.fetch_s == 0.0
    assert slow.prefill_s == pytest.approx(TOY.prefill_seconds(1024, 0))
    # at 1e5 B/s the fetch takes 1.023 s, less than it saves: used
    (fast,) = build_jobs(trace, [0], outcome, TOY, FetchRates(1e5, 1e5), 1.0)
    assert fast.fetch_s == pytest.approx(1.023)
    assert fast.prefill_s == pytest.approx(TOY.prefill_seconds(1024, 1023))


def test_local_hits_cost_no_fetch_and_bad_rate_scale_is_refused() -> None:
    trace = [_req(0, 600)]
    (job,) = build_jobs(trace, [0], CacheOutcome.local([512]), TOY, FetchRates(1.0, 1.0), 1.0)
    assert job.fetch_s == 0.0
    assert job.prefill_s == pytest.approx(TOY.prefill_seconds(600, 512))
    with pytest.raises(ValueError, match="rate_scale"):
        build_jobs(trace, [0], CacheOutcome.local([0]), TOY, FetchRates(1.0, 1.0), 0.0)


# ----------------------------------------------------------------------------------------------------
# Queueing
# ----------------------------------------------------------------------------------------------------


def test_fifo_on_one_instance() -> None:
    jobs = [Job(0.0, 0, 0.0, 2.0), Job(1.0, 0, 0.0, 1.0)]
    assert simulate(jobs, 1) == pytest.approx([2.0, 2.0])  # B waits 1 s, runs 2..3


def test_fetch_overlaps_the_wait_in_the_queue() -> None:
    hidden = [Job(0.0, 0, 0.0, 2.0), Job(0.5, 0, 1.0, 1.0)]  # ready at 1.5, instance free at 2
    assert simulate(hidden, 1) == pytest.approx([2.0, 2.5])
    longer = [Job(0.0, 0, 0.0, 2.0), Job(0.5, 0, 3.0, 1.0)]  # ready at 3.5: the fetch shows
    assert simulate(longer, 1) == pytest.approx([2.0, 4.0])


def test_a_request_still_fetching_does_not_block_the_next() -> None:
    jobs = [Job(0.0, 0, 5.0, 1.0), Job(1.0, 0, 0.0, 1.0)]
    assert simulate(jobs, 1) == pytest.approx([6.0, 1.0])


def test_the_earliest_arrival_among_ready_requests_goes_first() -> None:
    # A runs 0..3; at 3 both B (arrived 1, ready 2) and C (arrived 1.5) wait: B first.
    jobs = [Job(0.0, 0, 0.0, 3.0), Job(1.0, 0, 1.0, 1.0), Job(1.5, 0, 0.0, 1.0)]
    assert simulate(jobs, 1) == pytest.approx([3.0, 3.0, 3.5])


def test_events_at_one_instant_are_all_seen_before_the_choice() -> None:
    # At t = 1: A finishes, B (arrived 1) and C (arrived 0.5, fetched until 1) become ready: C goes first.
    jobs = [Job(0.0, 0, 0.0, 1.0), Job(1.0, 0, 0.0, 1.0), Job(0.5, 0, 0.5, 1.0)]
    assert simulate(jobs, 1) == pytest.approx([1.0, 2.0, 1.5])


def test_instances_queue_independently() -> None:
    jobs = [Job(0.0, 0, 0.0, 4.0), Job(0.0, 1, 0.0, 1.0), Job(0.5, 1, 0.0, 1.0), Job(0.5, 0, 0.0, 1.0)]
    assert simulate(jobs, 2) == pytest.approx([4.0, 1.0, 1.5, 4.5])


def test_every_job_gets_a_ttft() -> None:
    jobs = [Job(i * 0.1, i % 3, (i % 5) * 0.2, 0.3 + (i % 7) * 0.1) for i in range(200)]
    ttft = simulate(jobs, 3)
    assert not any(math.isnan(t) for t in ttft)
    assert all(t >= j.fetch_s + j.prefill_s - 1e-9 for t, j in zip(ttft, jobs, strict=True))


# ----------------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------------


def test_nearest_rank_percentiles() -> None:
    values = [float(v) for v in range(10, 0, -1)]
    assert (percentile(values, 50), percentile(values, 90), percentile(values, 99)) == (5.0, 9.0, 10.0)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_slo_fraction_counts_requests_at_or_under_the_slo() -> None:
    row = summarize("toy", "none", 1.0, [1.0, 2.0, 2.5, 4.0], 2.5)
    assert row.slo_fraction == 0.75
    assert row.ttft_p50_s == 2.0
    assert set(row.to_json()) == {
        "model", "config", "rate_scale", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "slo_fraction"
    }  # fmt: skip


def _rate(scale: float, share: float) -> RateResult:
    return RateResult("toy", "pool", scale, 0.0, 0.0, 0.0, share)


def test_goodput_is_the_last_rate_before_the_first_failure() -> None:
    rows = [_rate(4.0, 0.95), _rate(1.0, 0.95), _rate(3.0, 0.5), _rate(2.0, 0.9)]
    assert goodput(rows) == 2.0
    assert goodput([_rate(1.0, 0.89)]) == 0.0


# ----------------------------------------------------------------------------------------------------
# Cache hits and profiles
# ----------------------------------------------------------------------------------------------------


def test_hits_follow_the_prefix_rule() -> None:
    trace = [_req(0, 1024, 0), _req(1, 1500, 0), _req(2, 600, 7)]  # the second reuses both blocks of the first
    assert global_hits(trace, None) == [0, 1024, 0]
    assert routed_hits(trace, [0, 1, 0], 2, None) == [0, 0, 0]  # the reuse landed on the other instance
    assert global_hits(trace, 512) == [0, 0, 0]  # one block of room: the second block evicted the first


def test_hits_agree_with_the_trace_simulators(shipped_trace: list[Request]) -> None:
    trace = shipped_trace
    routes = route_all(trace, make_router("random", 4, 0))
    assert sum(global_hits(trace, 2_000_000)) == simulate_global(trace, 2_000_000).tokens_hit
    assert sum(routed_hits(trace, routes, 4, 2_000_000)) == simulate_routed(trace, routes, 4, 2_000_000).tokens_hit


@pytest.fixture(scope="module")
def shipped_trace() -> list[Request]:
    from kvpool.tools.bench_serve import DEFAULT_TRACE

    return load_trace(DEFAULT_TRACE, 400)


def test_shipped_profiles_carry_kv_bytes_from_the_model_configs() -> None:
    profiles = load_profiles()
    assert list(profiles) == ["llama-3.1-8b", "llama-3.1-70b", "qwen3-30b-a3b"]
    # 2 (K and V) x layers x KV heads x head dim x 2 bytes (BF16)
    assert profiles["llama-3.1-8b"].kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert profiles["llama-3.1-70b"].kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert profiles["qwen3-30b-a3b"].kv_bytes_per_token == 2 * 48 * 4 * 128 * 2
    assert all(p.source and p.peak_flops_per_gpu == 989e12 for p in profiles.values())


def _profile_text(**change: object) -> str:
    profile = {
        "name": "x",
        "description": "d",
        "gpus": 1,
        "mfu": 0.5,
        "active_params": 10,
        "layers": 1,
        "attention_dim": 1,
        "kv_bytes_per_token": 1,
        "overhead_s": 0.0,
        "slo_ttft_s": 1.0,
        "source": "s",
    } | change
    return json.dumps({"gpu": {"name": "g", "peak_dense_bf16_tflops": 1.0}, "profiles": [profile]})


def test_bad_profiles_are_refused_with_a_reason() -> None:
    assert load_profiles(_profile_text())["x"].compute_flops() == pytest.approx(0.5e12)
    with pytest.raises(ValueError, match="non-positive"):
        load_profiles(_profile_text(mfu=0))
    with pytest.raises(ValueError, match="layers must be a number"):
        load_profiles(_profile_text(layers="32"))
    with pytest.raises(ValueError, match="lacks description.*layers"):
        load_profiles(json.dumps({"gpu": {"name": "g", "peak_dense_bf16_tflops": 1}, "profiles": [{"name": "y"}]}))
