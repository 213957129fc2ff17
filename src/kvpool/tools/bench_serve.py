"""``kvpool bench serve``: TTFT and goodput under a TTFT SLO, per cache configuration, on a request trace.

The trace's arrivals (timestamps divided by each ``--rate-scale``) are replayed over N prefill instances by
the pure model of :mod:`kvpool.tools.serve_model`, once per configuration and model profile:

* ``none``: no cache; ``private``: per-instance LRUs of ``capacity / N`` behind ``--routing``;
  ``prefix_private``: the same caches behind prefix-affinity routing. Their hits are local to the engine
  (no fetch time), which favours them.
* ``pool``: the hits the REAL pool gives (a local cluster sized like ``kvpool bench trace`` sizes it, the
  trace replayed through ``prefix_length`` and ``batch_put``), fetched at the get rate measured on that
  cluster, scaled to the profile's KV bytes.
* ``pool_ssd``: the same with an SSD tier (``--capacity`` is then the DRAM, ``--ssd-capacity`` the SSD). The
  share of each hit that still sat in DRAM is taken from a global LRU of the DRAM's size; the rest is
  fetched at the SSD read rate measured on that cluster (probe objects written before the replay, so the
  replay pushes them to SSD, each read once after it).

This module is the I/O edge (clusters, rate measurements, output, plot); the model has no I/O.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpool.tools import bench_trace, bench_trace_pool
from kvpool.tools.argtypes import positive_float, positive_int
from kvpool.tools.serve_model import (
    CONFIGS,
    CacheOutcome,
    FetchRates,
    ModelProfile,
    RateResult,
    build_jobs,
    global_hits,
    goodput,
    load_profiles,
    routed_hits,
    simulate,
    summarize,
)
from kvpool.tools.trace import ROUTING_POLICIES, Request, TraceFormatError, load_trace, make_router, route_all

__all__ = ["DEFAULT_TRACE", "PoolRun", "add_arguments", "parse_rate_scales", "run"]

DEFAULT_TRACE = Path(__file__).resolve().parents[3] / "benchmarks" / "traces" / "synthetic_trace.jsonl"
"""The synthetic Mooncake trace shipped in the repository."""
DEFAULT_RATE_SCALES = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)
DEFAULT_CAPACITY = 10_000_000
PROBE_OBJECTS = 8
"""Objects per rate probe; the DRAM probe reads them all ``PROBE_REPEATS`` times, the SSD probe reads each
of ``SSD_PROBE_GROUPS`` groups once (a second read could find it promoted to DRAM)."""
PROBE_REPEATS = 5
SSD_PROBE_GROUPS = 4
MAX_PROBE_BYTES = 1 << 20
MIN_PROBE_BYTES = 4096


def parse_rate_scales(text: str) -> list[float]:
    """``0.5,1,2`` -> sorted distinct positive factors (for ``--rate-scale``)."""
    try:
        values = sorted({float(item) for item in text.split(",") if item.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not values or values[0] <= 0 or any(v != v or v == float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"rate scales must be finite numbers > 0: {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = ", ".join(load_profiles())
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL trace (the shipped one)")
    parser.add_argument("--instances", type=positive_int, default=8, help="prefill instances (8)")
    parser.add_argument(
        "--routing", choices=ROUTING_POLICIES, default="random", help="routing of none, private and pool (random)"
    )
    parser.add_argument(
        "--capacity",
        type=bench_trace.parse_token_count,
        default=DEFAULT_CAPACITY,
        metavar="TOKENS",
        help="cache tokens over all instances: the private caches get capacity/instances each, the pool's "
        "DRAM holds all of it (10M)",
    )
    parser.add_argument(
        "--ssd-capacity",
        type=bench_trace.parse_token_count,
        default=None,
        metavar="TOKENS",
        help="the pool_ssd SSD tier in tokens (default: the trace's working set)",
    )
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="PROFILE",
        help=f"model profile, repeatable (default: all of {names}); the first one gives the top-level goodput",
    )
    parser.add_argument(
        "--slo-ttft-s", type=positive_float, default=None, help="TTFT SLO in seconds (default: each profile's)"
    )
    parser.add_argument(
        "--rate-scale",
        type=parse_rate_scales,
        default=list(DEFAULT_RATE_SCALES),
        metavar="X,...",
        help="arrival-rate factors: timestamps are divided by each (0.25 to 8)",
    )
    parser.add_argument("--limit-requests", type=positive_int, default=None, metavar="K", help="first K requests")
    parser.add_argument("--block-bytes", type=positive_int, default=4096, help="bytes per block object (4096)")
    parser.add_argument("--stores", type=positive_int, default=2, help="stores of each local cluster (2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random routing (0)")
    parser.add_argument(
        "--fetch-gbs",
        type=positive_float,
        default=None,
        help="use this fetch rate (GB/s, both tiers) instead of the measured ones, e.g. an RDMA cluster's",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="write TTFT p90 against rate (matplotlib)")


# ----------------------------------------------------------------------------------------------------
# The real pool
# ----------------------------------------------------------------------------------------------------


class RecordingPool:
    """A ``PoolLike`` that remembers each request's prefix hit (in blocks) on its way through."""

    def __init__(self, pool: bench_trace.PoolLike) -> None:
        self._pool = pool
        self.hit_blocks: list[int] = []

    def prefix_length(self, keys: list[str]) -> int:
        n = self._pool.prefix_length(keys)
        self.hit_blocks.append(min(max(n, 0), len(keys)))
        return n

    def batch_put(self, keys: list[str], values: list[bytes]) -> list[int]:
        return self._pool.batch_put(keys, values)


@dataclasses.dataclass
class PoolRun:
    """One real pool replay: per-request hit tokens, the measured get rate and the cluster's counters."""

    hit_tokens: list[int]
    rate_bytes_per_s: float
    notes: dict[str, Any]


def _probe_bytes(dram_bytes: int) -> int:
    """Probe objects big enough that a get is not all per-call overhead; all of them fill half the DRAM at most."""
    share = dram_bytes // (2 * PROBE_OBJECTS * SSD_PROBE_GROUPS)
    return max(MIN_PROBE_BYTES, min(MAX_PROBE_BYTES, share // 4096 * 4096))


def _put_probes(pool: Any, keys: list[str], size: int) -> list[bytes]:
    values = [bench_trace.block_value(i + 1, size) for i in range(len(keys))]
    codes = pool.batch_put(keys, values)
    if any(c < 0 for c in codes):
        raise RuntimeError(f"the pool refused rate probes: codes {codes}")
    return values


def _timed_get(pool: Any, keys: list[str], expected: list[bytes]) -> float:
    start = time.perf_counter()
    values = pool.batch_get(keys)
    seconds = time.perf_counter() - start
    if values != expected:
        raise RuntimeError("a rate probe read returned bytes other than those written")
    return seconds


def _replay(trace: Sequence[Request], pool: Any, block_bytes: int, run_tag: str) -> list[int]:
    recorder = RecordingPool(pool)
    bench_trace.replay_pool(
        trace,
        recorder,
        run_tag=run_tag,
        block_bytes=block_bytes,
        progress=bench_trace.Progress("pool replay", len(trace), sys.stderr),
    )
    return [req.tokens_in_prefix(n) for req, n in zip(trace, recorder.hit_blocks, strict=True)]


def run_pool(trace: Sequence[Request], args: argparse.Namespace, *, ssd: bool) -> PoolRun:
    """Replay ``trace`` on a local cluster (with an SSD tier when ``ssd``) and measure its get rate there."""
    working_set = bench_trace_pool.working_set_blocks(list(trace))
    plan = bench_trace_pool.plan_cluster(
        args.capacity, args.block_bytes, args.stores, working_set, args.ssd_capacity, ssd
    )
    probe = _probe_bytes(plan.dram_bytes)
    probe_keys = [f"serve-probe-{uuid.uuid4().hex[:8]}-{i}" for i in range(PROBE_OBJECTS * SSD_PROBE_GROUPS)]
    if ssd:
        extra = -(-len(probe_keys) * probe // len(plan.ssd)) + probe
        plan = dataclasses.replace(plan, ssd=tuple(s + extra for s in plan.ssd))
    factory = bench_trace_pool.TracePoolFactory(plan)
    ns = argparse.Namespace(master=None)
    with factory(ns) as pool_like:
        pool: Any = pool_like  # a PoolClient: the probes also need batch_get and remove_all
        if ssd:
            values = _put_probes(pool, probe_keys, probe)
            hits = _replay(trace, pool, args.block_bytes, uuid.uuid4().hex[:12])
            groups = [range(g * PROBE_OBJECTS, (g + 1) * PROBE_OBJECTS) for g in range(SSD_PROBE_GROUPS)]
            times = [_timed_get(pool, [probe_keys[i] for i in g], [values[i] for i in g]) for g in groups]
            group_bytes = PROBE_OBJECTS * probe
        else:
            run_tag = uuid.uuid4().hex[:12]
            hits = _replay(trace, pool, args.block_bytes, run_tag)
            # The replay left the pool full and it evicts only when an allocation fails: make room.
            pool.remove_all(force=True, prefix=bench_trace.block_key(run_tag, 0)[:-1])
            keys = probe_keys[:PROBE_OBJECTS]
            values = _put_probes(pool, keys, probe)
            times = [_timed_get(pool, keys, values) for _ in range(PROBE_REPEATS)]
            group_bytes = PROBE_OBJECTS * probe
    notes = dict(factory.notes)
    notes.update(probe_bytes=probe, probe_seconds=[round(t, 6) for t in times])
    return PoolRun(hits, group_bytes / statistics.median(times), notes)


# ----------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------


def _outcomes(
    trace: Sequence[Request], args: argparse.Namespace, routes: dict[str, list[int]], pool: PoolRun, pool_ssd: PoolRun
) -> dict[str, CacheOutcome]:
    dram_hits = global_hits(trace, args.capacity)
    ssd_part = [max(0, real - dram) for real, dram in zip(pool_ssd.hit_tokens, dram_hits, strict=True)]
    return {
        "none": CacheOutcome.local([0] * len(trace)),
        "private": CacheOutcome.local(routed_hits(trace, routes["private"], args.instances, args.capacity)),
        "prefix_private": CacheOutcome.local(
            routed_hits(trace, routes["prefix_private"], args.instances, args.capacity)
        ),
        "pool": CacheOutcome(tuple(pool.hit_tokens), (0,) * len(trace), True),
        "pool_ssd": CacheOutcome(tuple(pool_ssd.hit_tokens), tuple(ssd_part), True),
    }


def _ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 3) if denominator > 0 else None


def evaluate(
    trace: Sequence[Request],
    routes: dict[str, list[int]],
    outcomes: dict[str, CacheOutcome],
    profile: ModelProfile,
    rates: FetchRates,
    rate_scales: Sequence[float],
    instances: int,
    slo_s: float,
) -> tuple[list[RateResult], dict[str, float]]:
    """Every configuration at every rate for one profile: the rows and the goodput per configuration."""
    rows: list[RateResult] = []
    best: dict[str, float] = {}
    for config in CONFIGS:
        mine = []
        for scale in rate_scales:
            jobs = build_jobs(trace, routes[config], outcomes[config], profile, rates, scale)
            mine.append(summarize(profile.name, config, scale, simulate(jobs, instances), slo_s))
        rows += mine
        best[config] = goodput(mine)
    return rows, best


def _goodput_ratios(best: dict[str, float]) -> dict[str, float | None]:
    return {
        f"{pool}/{base}": _ratio(best[pool], best[base])
        for pool in ("pool", "pool_ssd")
        for base in ("private", "none")
    }


def run(args: argparse.Namespace) -> int:
    """``kvpool bench serve``; exit status 0, or 2 for a bad trace or arguments."""
    err = sys.stderr
    profiles = load_profiles()
    chosen = args.model or list(profiles)
    unknown = [m for m in chosen if m not in profiles]
    if unknown:
        print(f"kvpool bench serve: unknown model profile {unknown[0]!r}; known: {', '.join(profiles)}", file=err)
        return 2
    try:
        trace = load_trace(args.trace, args.limit_requests)
    except (OSError, TraceFormatError) as e:
        print(f"kvpool bench serve: {e}", file=err)
        return 2
    if not trace:
        print(f"kvpool bench serve: {args.trace} holds no requests", file=err)
        return 2
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("kvpool bench serve: --plot needs matplotlib (pip install 'kvpool[plot]')", file=err)
        return 2
    started = time.perf_counter()
    base_routes = route_all(trace, make_router(args.routing, args.instances, args.seed))
    prefix_routes = route_all(trace, make_router("prefix", args.instances))
    try:
        print("kvpool bench serve: replaying on a local pool", file=err)
        pool = run_pool(trace, args, ssd=False)
        print("kvpool bench serve: replaying on a local pool with an SSD tier", file=err)
        pool_ssd = run_pool(trace, args, ssd=True)
    except ValueError as exc:  # a capacity the local cluster cannot be sized for
        print(f"kvpool bench serve: {exc}", file=err)
        return 2
    except (RuntimeError, TimeoutError) as exc:  # a cluster that did not start, a refused or wrong probe
        print(f"kvpool bench serve: the pool run failed: {exc}", file=err)
        return 1
    measured = FetchRates(pool.rate_bytes_per_s, pool_ssd.rate_bytes_per_s)
    rates = measured if args.fetch_gbs is None else FetchRates(args.fetch_gbs * 1e9, args.fetch_gbs * 1e9)
    routes = {c: (prefix_routes if c == "prefix_private" else base_routes) for c in CONFIGS}
    outcomes = _outcomes(trace, args, routes, pool, pool_ssd)
    report = _report(trace, args, chosen, profiles, routes, outcomes, rates, measured, pool, pool_ssd)
    report["seconds"] = round(time.perf_counter() - started, 1)
    if args.plot:
        from kvpool.tools.serve_plot import write_plot

        if not write_plot(report, args.plot, err):
            return 2
    print(json.dumps(report) if args.json else _table(report))
    return 0


def _report(
    trace: Sequence[Request],
    args: argparse.Namespace,
    chosen: list[str],
    profiles: dict[str, ModelProfile],
    routes: dict[str, list[int]],
    outcomes: dict[str, CacheOutcome],
    rates: FetchRates,
    measured: FetchRates,
    pool: PoolRun,
    pool_ssd: PoolRun,
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    models: dict[str, Any] = {}
    for name in chosen:
        profile = profiles[name]
        slo = args.slo_ttft_s or profile.slo_ttft_s
        results, best = evaluate(trace, routes, outcomes, profile, rates, args.rate_scale, args.instances, slo)
        rows += [r.to_json() for r in results]
        models[name] = {"slo_ttft_s": slo, "goodput": best, "goodput_ratio": _goodput_ratios(best)}
    span_s = (trace[-1].timestamp - trace[0].timestamp) / 1000.0
    return {
        "rows": rows,
        "goodput": models[chosen[0]]["goodput"],
        "models": models,
        "token_hit_rate": {c: round(o.token_hit_rate(trace), 4) for c, o in outcomes.items()},
        "fetch_gbs": {"dram": rates.dram_bytes_per_s / 1e9, "ssd": rates.ssd_bytes_per_s / 1e9},
        "measured_fetch_gbs": {"dram": measured.dram_bytes_per_s / 1e9, "ssd": measured.ssd_bytes_per_s / 1e9},
        "requests": len(trace),
        "base_rate_rps": round(len(trace) / span_s, 4) if span_s > 0 else None,
        "instances": args.instances,
        "routing": args.routing,
        "capacity_tokens": args.capacity,
        "ssd_capacity_tokens": args.ssd_capacity,
        "pool_cluster": pool.notes,
        "pool_ssd_cluster": pool_ssd.notes,
        "trace": str(args.trace),
    }


def _table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['requests']:,} requests, {report['instances']} instances, routing {report['routing']}, "
        f"capacity {report['capacity_tokens']:,} tokens; fetch GB/s dram {report['fetch_gbs']['dram']:.2f} "
        f"ssd {report['fetch_gbs']['ssd']:.2f}",
        "token hit: " + ", ".join(f"{c} {v:.1%}" for c, v in report["token_hit_rate"].items()),
    ]
    for name, model in report["models"].items():
        lines += [
            "",
            f"{name} (SLO {model['slo_ttft_s']} s)",
            f"{'config':16}{'rate':>6}{'p50':>9}{'p90':>9}{'p99':>9}{'in SLO':>8}",
        ]
        for row in report["rows"]:
            if row["model"] == name:
                lines.append(
                    f"{row['config']:16}{row['rate_scale']:>6g}{row['ttft_p50_s']:>9.3f}{row['ttft_p90_s']:>9.3f}"
                    f"{row['ttft_p99_s']:>9.3f}{row['slo_fraction']:>8.1%}"
                )
        lines.append("goodput (rate scale): " + ", ".join(f"{c} {v:g}" for c, v in model["goodput"].items()))
        lines.append("ratios: " + ", ".join(f"{k} {v}" for k, v in model["goodput_ratio"].items()))
    return "\n".join(lines)
