"""The pure serving model of ``kvpool bench serve``: model profiles, the prefill cost model, per-request cache
hits of the simulated caches, and the event-driven replay over N prefill instances. No I/O beyond reading
the profile file shipped in the package; the real pool runs live in :mod:`kvpool.tools.bench_serve`.

Cost model (one request with ``c`` reused tokens and ``u`` tokens to compute, on a profile with ``P`` active
parameters, ``L`` layers and an attention width ``d`` = query heads x head dim)::

    flops     = 2 P u + 4 L d (u c + u (u + 1) / 2)     # the linear layers + causal attention (QK^T and AV)
    prefill_s = overhead_s + flops / (gpus x peak_flops x mfu)

Reused KV still costs attention for the new tokens (they attend to it), which is why ``c`` appears. A full
hit still computes the last prompt token (an engine needs its logits), so ``c <= input_length - 1``.

Queueing (``simulate``): each request has an instance, an arrival time, a ready time (arrival + the time to
fetch its reused KV, which the engine's prefetch starts on arrival and so overlaps with the wait in the
queue; a remote hit slower to fetch than to recompute is not used) and a prefill time. An idle instance
starts, among its requests that are ready, the one that arrived first (SGLang skips a waiting request whose
prefetch is not done and schedules the next). TTFT = end of the prefill - arrival.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from kvpool.tools.trace import BlockLRU, Request, capacity_blocks

__all__ = [
    "CONFIGS",
    "CacheOutcome",
    "FetchRates",
    "Job",
    "ModelProfile",
    "RateResult",
    "build_jobs",
    "global_hits",
    "goodput",
    "load_profiles",
    "percentile",
    "routed_hits",
    "simulate",
    "summarize",
]

CONFIGS = ("none", "private", "prefix_private", "pool", "pool_ssd")
"""The cache configurations, in the order of the output."""
GOODPUT_SLO_SHARE = 0.9
"""Goodput: the highest rate at which at least this share of requests meets the TTFT SLO."""

_PROFILE_FIELDS = (
    "name",
    "description",
    "gpus",
    "mfu",
    "active_params",
    "layers",
    "attention_dim",
    "kv_bytes_per_token",
    "overhead_s",
    "slo_ttft_s",
    "source",
)
_NUMERIC_FIELDS = _PROFILE_FIELDS[2:-1]


@dataclass(frozen=True)
class ModelProfile:
    """One model on one GPU type: what the cost model and the fetch time need (see the module doc)."""

    name: str
    description: str
    gpus: int
    """GPUs of one prefill instance (tensor parallel)."""
    mfu: float
    """Share of the peak FLOPs that prefill reaches (an assumption, documented in docs/serving-replay.md)."""
    active_params: int
    """Parameters each token goes through (all of them for a dense model, the activated ones for MoE)."""
    layers: int
    attention_dim: int
    """Query heads x head dim: the width of QK^T and AV per layer."""
    kv_bytes_per_token: int
    overhead_s: float
    """Fixed cost of one prefill (scheduling, kernel launches)."""
    slo_ttft_s: float
    """Default TTFT SLO for this profile (``--slo-ttft-s`` overrides it for all)."""
    source: str
    peak_flops_per_gpu: float
    gpu: str

    def compute_flops(self) -> float:
        """FLOP/s of one instance at the profile's MFU."""
        return self.gpus * self.peak_flops_per_gpu * self.mfu

    def prefill_flops(self, input_tokens: int, reused_tokens: int) -> float:
        """FLOPs to prefill ``input_tokens`` of which ``reused_tokens`` come from a cache (see ``reusable``)."""
        c = reusable(input_tokens, reused_tokens)
        u = input_tokens - c
        return 2.0 * self.active_params * u + 4.0 * self.layers * self.attention_dim * (u * c + u * (u + 1) / 2)

    def prefill_seconds(self, input_tokens: int, reused_tokens: int) -> float:
        return self.overhead_s + self.prefill_flops(input_tokens, reused_tokens) / self.compute_flops()


def reusable(input_tokens: int, hit_tokens: int) -> int:
    """Cached tokens a prefill can use: at most ``input_tokens - 1`` (the last token is always computed)."""
    return max(0, min(hit_tokens, input_tokens - 1))


def _profile_from(obj: Any, gpu: dict[str, Any]) -> ModelProfile:
    if not isinstance(obj, dict):
        raise ValueError("a profile must be a JSON object")
    missing = [f for f in _PROFILE_FIELDS if f not in obj]
    if missing:
        raise ValueError(f"profile {obj.get('name', '?')!r} lacks {', '.join(missing)}")
    for f in _NUMERIC_FIELDS:
        if isinstance(obj[f], bool) or not isinstance(obj[f], int | float):
            raise ValueError(f"profile {obj['name']!r}: {f} must be a number, got {obj[f]!r}")
    profile = ModelProfile(
        **{f: obj[f] for f in _PROFILE_FIELDS},
        peak_flops_per_gpu=float(gpu["peak_dense_bf16_tflops"]) * 1e12,
        gpu=str(gpu["name"]),
    )
    numbers = (profile.gpus, profile.mfu, profile.active_params, profile.layers, profile.attention_dim)
    if min(numbers) <= 0 or profile.kv_bytes_per_token <= 0 or profile.slo_ttft_s <= 0 or profile.overhead_s < 0:
        raise ValueError(f"profile {profile.name!r} has a non-positive size, rate or SLO")
    return profile


def load_profiles(text: str | None = None) -> dict[str, ModelProfile]:
    """The profiles of ``serve_profiles.json`` (shipped with the package), or of ``text``, by name, in order."""
    if text is None:
        text = resources.files("kvpool.tools").joinpath("serve_profiles.json").read_text(encoding="utf-8")
    data = json.loads(text)
    gpu = data["gpu"]
    profiles = [_profile_from(obj, gpu) for obj in data["profiles"]]
    return {p.name: p for p in profiles}


# ----------------------------------------------------------------------------------------------------
# Cache outcomes
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheOutcome:
    """What one cache configuration gives each request, in trace order.

    ``hit_tokens[i]``: leading prompt tokens found; ``ssd_tokens[i]``: how many of them come from the SSD tier
    (0 without one); ``remote``: whether hits are fetched over the network (pool) or are local to the engine.
    """

    hit_tokens: tuple[int, ...]
    ssd_tokens: tuple[int, ...]
    remote: bool

    @classmethod
    def local(cls, hits: Sequence[int]) -> CacheOutcome:
        return cls(tuple(hits), (0,) * len(hits), False)

    def token_hit_rate(self, trace: Sequence[Request]) -> float:
        total = sum(r.input_length for r in trace)
        return sum(self.hit_tokens) / total if total else 0.0


def routed_hits(
    trace: Sequence[Request], routes: Sequence[int], instances: int, capacity_tokens: int | None
) -> list[int]:
    """Hit tokens per request with private LRUs of ``capacity / instances`` each (``simulate_routed``'s rule)."""
    per_instance = capacity_blocks(capacity_tokens, instances)
    caches: list[BlockLRU[int]] = [BlockLRU(per_instance) for _ in range(instances)]
    return [req.tokens_in_prefix(caches[i].access(req.hash_ids)) for req, i in zip(trace, routes, strict=True)]


def global_hits(trace: Sequence[Request], capacity_tokens: int | None) -> list[int]:
    """Hit tokens per request with one global LRU of ``capacity_tokens`` (``simulate_global``'s rule)."""
    lru: BlockLRU[int] = BlockLRU(capacity_blocks(capacity_tokens))
    return [req.tokens_in_prefix(lru.access(req.hash_ids)) for req in trace]


# ----------------------------------------------------------------------------------------------------
# Jobs and the event-driven replay
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FetchRates:
    """Bytes per second of a pool fetch from DRAM and from the SSD tier."""

    dram_bytes_per_s: float
    ssd_bytes_per_s: float

    def fetch_seconds(self, dram_bytes: float, ssd_bytes: float) -> float:
        return dram_bytes / self.dram_bytes_per_s + ssd_bytes / self.ssd_bytes_per_s


@dataclass(frozen=True, slots=True)
class Job:
    """One request as the queueing model sees it (times in seconds)."""

    arrival_s: float
    instance: int
    fetch_s: float
    prefill_s: float


def build_jobs(
    trace: Sequence[Request],
    routes: Sequence[int],
    outcome: CacheOutcome,
    profile: ModelProfile,
    rates: FetchRates,
    rate_scale: float,
) -> list[Job]:
    """The jobs of one configuration at one rate: arrivals ``timestamp / rate_scale``; a remote hit costs the
    fetch of its reusable tokens' KV (the SSD part at the SSD rate, the part before it at the DRAM rate).

    A remote hit whose fetch would take longer than the compute it saves is not used (the request is
    prefilled from scratch): an engine that knows its link's rate does not wait for a slower fetch."""
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    kv = profile.kv_bytes_per_token
    jobs = []
    for i, req in enumerate(trace):
        reused = reusable(req.input_length, outcome.hit_tokens[i])
        fetch_s = 0.0
        if outcome.remote and reused:
            ssd = min(outcome.ssd_tokens[i], reused)
            fetch_s = rates.fetch_seconds((reused - ssd) * kv, ssd * kv)
            saved_s = profile.prefill_seconds(req.input_length, 0) - profile.prefill_seconds(req.input_length, reused)
            if fetch_s >= saved_s:
                reused, fetch_s = 0, 0.0
        arrival = req.timestamp / 1000.0 / rate_scale
        jobs.append(Job(arrival, routes[i], fetch_s, profile.prefill_seconds(req.input_length, reused)))
    return jobs


_READY, _DONE = 0, 1


def simulate(jobs: Sequence[Job], instances: int) -> list[float]:
    """TTFT of every job (same order) under the queueing rule of the module doc.

    Events at the same time are all applied before any idle instance picks its next job, so the choice
    sees every job that became ready at that moment.
    """
    events: list[tuple[float, int, int]] = [(j.arrival_s + j.fetch_s, _READY, i) for i, j in enumerate(jobs)]
    heapq.heapify(events)
    waiting: list[list[tuple[float, int]]] = [[] for _ in range(instances)]
    busy = [False] * instances
    ttft = [math.nan] * len(jobs)
    while events:
        now = events[0][0]
        touched: set[int] = set()
        while events and events[0][0] == now:
            _, kind, i = heapq.heappop(events)
            inst = jobs[i].instance
            if kind == _READY:
                heapq.heappush(waiting[inst], (jobs[i].arrival_s, i))
            else:
                busy[inst] = False
                ttft[i] = now - jobs[i].arrival_s
            touched.add(inst)
        for inst in sorted(touched):
            if not busy[inst] and waiting[inst]:
                _, i = heapq.heappop(waiting[inst])
                busy[inst] = True
                heapq.heappush(events, (now + jobs[i].prefill_s, _DONE, i))
    return ttft


# ----------------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile: the smallest value with at least ``p`` % of the values at or below it."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class RateResult:
    """One configuration at one rate."""

    model: str
    config: str
    rate_scale: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    slo_fraction: float

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "config": self.config,
            "rate_scale": self.rate_scale,
            "ttft_p50_s": round(self.ttft_p50_s, 4),
            "ttft_p90_s": round(self.ttft_p90_s, 4),
            "ttft_p99_s": round(self.ttft_p99_s, 4),
            "slo_fraction": round(self.slo_fraction, 4),
        }


def summarize(model: str, config: str, rate_scale: float, ttft: Sequence[float], slo_s: float) -> RateResult:
    within = sum(1 for t in ttft if t <= slo_s)
    return RateResult(
        model,
        config,
        rate_scale,
        percentile(ttft, 50),
        percentile(ttft, 90),
        percentile(ttft, 99),
        within / len(ttft),
    )


def goodput(results: Sequence[RateResult], share: float = GOODPUT_SLO_SHARE) -> float:
    """The highest rate scale that meets the SLO for ``share`` of requests, every lower scale meeting it too
    (a rate past the first failure does not count); 0.0 when even the lowest fails."""
    best = 0.0
    for r in sorted(results, key=lambda r: r.rate_scale):
        if r.slo_fraction < share:
            break
        best = r.rate_scale
    return best
