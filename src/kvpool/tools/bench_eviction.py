"""``kvpool bench eviction``: put latency with the pool full and evicting, against the same puts with free space,
and the eviction work per freed object, on the master's own code in-process (no cluster, no network).

One run: a ``MasterState`` with one segment that holds ``--objects`` objects of ``--object-bytes`` at the
high watermark, a background thread that evicts as the master's maintenance thread does (``needs_eviction``
-> ``evict`` every ``eviction_interval_s``) and heartbeats as a store does (which drains the free queue).

* The pool is filled to ``--objects`` - M objects unmeasured; the last M of those puts, unpaced, give this
  process's put rate with free space (the ceiling). The timed puts are then offered at ``--load`` x that rate
  (open loop: each latency runs from the call's scheduled start, so a call held up by eviction counts its wait;
  ``--load 0`` is the closed loop: unpaced puts, each latency the call's own duration).
* **free**: M puts of ``--batch`` keys (one ``put_start`` + ``put_end`` each) while the pool climbs to the
  watermark: nothing is evicted.
* **full**: M puts more cross the watermark unmeasured, then 2 M puts are timed while the pool is full and
  evicting (the index holds about ``--objects`` objects in both phases).

M = ``--measure`` (default: 5 % of the objects, at least 5,000 keys). Reported per phase: p50 and p99 of one
put call in microseconds; the ratios full / free (the ceiling is the free phase of the same run); and from the
master's eviction counters (``MasterState.eviction_work``): objects examined per freed object and the
evicting thread's CPU time per freed object; puts that evicted inline; and the interpreter's full garbage
collections in each timed phase (a pause of the whole process that the open loop turns into a p99). Medians
over ``--runs`` runs. ``--exact`` runs the exact LRU (``eviction_sample_factor 0``: every object ranked on each
eviction) for comparison.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvpool.common.errors import ErrorCode
from kvpool.master.config import MasterConfig
from kvpool.master.state import MasterState
from kvpool.master.types import SegmentSpec
from kvpool.tools.argtypes import fraction, non_negative_int, positive_int

__all__ = ["EvictionRun", "add_arguments", "run", "run_once"]

_STORE = "bench-store"
_SEGMENT = 1
_CLIENT = "bench"
_HEARTBEAT_S = 0.5


@dataclass(frozen=True)
class EvictionRun:
    """One run's figures (latencies in microseconds per put call of ``batch`` keys)."""

    objects: int
    batch: int
    offered_keys_per_s: float
    free_p50_us: float
    free_p99_us: float
    full_p50_us: float
    full_p99_us: float
    p50_ratio: float
    p99_ratio: float
    evicted: int
    examined_per_freed: float
    evict_us_per_freed: float
    index_objects: int
    free_keys_per_s: float = 0.0
    """Keys put per second in the timed free phase (the offered rate unless the process fell behind)."""
    full_keys_per_s: float = 0.0
    urgent_evictions: int = 0
    """Puts of the full phase that found the pool full and evicted inline (the background had fallen behind)."""
    free_gc_full: int = 0
    """The interpreter's full (generation 2) garbage collections during the timed free phase: each pauses the
    whole process for a time that grows with the objects it holds, and in the open loop delays every call
    scheduled meanwhile, so a p99 may be theirs rather than eviction's."""
    free_gc_max_ms: float = 0.0
    full_gc_full: int = 0
    full_gc_max_ms: float = 0.0


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class _Background(threading.Thread):
    """The master's maintenance loop (eviction above the watermark) and a store's heartbeat."""

    def __init__(self, state: MasterState, interval_s: float) -> None:
        super().__init__(name="bench-eviction", daemon=True)
        self._state = state
        self._interval_s = interval_s
        self._halt = threading.Event()

    def run(self) -> None:
        state = self._state
        ack = 0
        next_beat = 0.0
        progress = state.tiers.progress  # set by a put that evicted inline, as the master's maintenance waits
        while not self._halt.is_set():
            progress.wait(self._interval_s)
            progress.clear()
            if state.needs_eviction():
                state.evict()
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + _HEARTBEAT_S
                freed = state.heartbeat(_STORE, [_SEGMENT], ack).freed
                if freed:
                    ack = freed[-1][2]

    def stop(self) -> None:
        self._halt.set()
        self._state.tiers.progress.set()
        self.join()


class _GcWatch:
    """Times the interpreter's full (generation 2) garbage collections (a ``gc.callbacks`` entry)."""

    def __init__(self) -> None:
        self._pauses: list[float] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._pauses.append(time.perf_counter() - self._started)

    def take(self) -> list[float]:
        """The pauses (seconds) since the last take."""
        pauses, self._pauses = self._pauses, []
        return pauses


class _Writer:
    """Puts numbered keys of one size in batches, timing each call."""

    def __init__(self, state: MasterState, object_bytes: int, batch: int) -> None:
        self._state = state
        self._size = object_bytes
        self._batch = batch
        self._next = 0

    def put(self, keys: int, timed: list[float] | None = None, rate: float = 0.0) -> float:
        """Put ``keys`` keys; returns the seconds it took. With ``rate`` (keys/s) the calls are paced at
        that offered load and each latency runs from the call's scheduled start (a call that starts late
        because an earlier one was slow counts its wait)."""
        state, size, batch = self._state, self._size, self._batch
        clock = time.perf_counter
        interval = batch / rate if rate else 0.0
        began = clock()
        for n, _ in enumerate(range(0, keys, batch)):
            names = [f"k{i}" for i in range(self._next, self._next + batch)]
            self._next += batch
            scheduled = began + n * interval
            ahead = scheduled - clock()
            if ahead > 0:
                time.sleep(ahead)
            started = scheduled if interval else clock()
            results = state.put_start(_CLIENT, names, [size] * batch)
            ok = [k for k, r in zip(names, results, strict=True) if r.code == ErrorCode.OK]
            state.put_end(_CLIENT, ok, [1] * len(ok))
            if timed is not None:
                timed.append((clock() - started) * 1e6)
            if len(ok) != batch:
                codes = sorted({r.code.name for r in results if r.code != ErrorCode.OK})
                raise RuntimeError(f"put refused ({', '.join(codes)}): the evictor did not keep up")
        return clock() - began


def run_once(objects: int, object_bytes: int, batch: int, measure: int, exact: bool, load: float) -> EvictionRun:
    config = MasterConfig(eviction_sample_factor=0) if exact else MasterConfig()
    state = MasterState(config)
    aligned = (object_bytes + 63) & ~63
    capacity = math.ceil(objects / config.eviction_high_watermark) * aligned
    spec = SegmentSpec(_SEGMENT, "bench", _STORE, capacity, "127.0.0.1:1", "", b"bench-secret-0123456789abcdef012")
    if state.mount_segment(spec).code != ErrorCode.OK:
        raise RuntimeError("mount failed")
    background = _Background(state, config.eviction_interval_s)
    gc_watch = _GcWatch()
    gc.callbacks.append(gc_watch)
    background.start()
    try:
        writer = _Writer(state, object_bytes, batch)
        writer.put(objects - 2 * measure)
        rate = load * measure / writer.put(measure)  # the ceiling: this process's unpaced put rate
        free: list[float] = []
        gc_watch.take()
        free_seconds = writer.put(measure, free, rate)
        free_gc = gc_watch.take()
        writer.put(measure, None, rate)
        before = state.eviction_work()
        full: list[float] = []
        gc_watch.take()
        full_seconds = writer.put(2 * measure, full, rate)
        full_gc = gc_watch.take()
        work = state.eviction_work()
    finally:
        background.stop()
        gc.callbacks.remove(gc_watch)
    evicted = work.evicted - before.evicted
    examined = work.examined - before.examined
    seconds = work.cpu_seconds - before.cpu_seconds
    free_p50, free_p99 = _percentile(free, 0.5), _percentile(free, 0.99)
    full_p50, full_p99 = _percentile(full, 0.5), _percentile(full, 0.99)
    return EvictionRun(
        objects=objects,
        batch=batch,
        offered_keys_per_s=round(rate),
        free_p50_us=round(free_p50, 1),
        free_p99_us=round(free_p99, 1),
        full_p50_us=round(full_p50, 1),
        full_p99_us=round(full_p99, 1),
        p50_ratio=round(full_p50 / free_p50, 3),
        p99_ratio=round(full_p99 / free_p99, 3),
        evicted=evicted,
        examined_per_freed=round(examined / evicted, 2) if evicted else 0.0,
        evict_us_per_freed=round(seconds * 1e6 / evicted, 2) if evicted else 0.0,
        index_objects=state.stats().objects,
        free_keys_per_s=round(measure / free_seconds),
        full_keys_per_s=round(2 * measure / full_seconds),
        urgent_evictions=work.urgent_calls - before.urgent_calls,
        free_gc_full=len(free_gc),
        free_gc_max_ms=round(max(free_gc, default=0.0) * 1e3, 1),
        full_gc_full=len(full_gc),
        full_gc_max_ms=round(max(full_gc, default=0.0) * 1e3, 1),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--objects", type=positive_int, nargs="+", default=[100_000], help="objects at the watermark (100000)"
    )
    parser.add_argument("--object-bytes", type=positive_int, default=512, help="bytes per object (512)")
    parser.add_argument("--batch", type=positive_int, default=8, help="keys per put call (8)")
    parser.add_argument(
        "--measure", type=non_negative_int, default=0, help="keys timed per phase (0 = 5%% of the objects, >= 5000)"
    )
    parser.add_argument("--runs", type=positive_int, default=3, help="runs per object count (median reported)")
    parser.add_argument(
        "--load",
        type=fraction,
        default=0.2,
        help="offered put rate, as a fraction of this process's unpaced put rate with free space (0.2); "
        "0 = closed loop: unpaced puts, each latency the call's own duration",
    )
    parser.add_argument("--exact", action="store_true", help="exact LRU (eviction_sample_factor 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _median_run(runs: list[EvictionRun]) -> dict[str, Any]:
    rows = [asdict(r) for r in runs]
    return {name: statistics.median(row[name] for row in rows) for name in rows[0]}


def run(args: argparse.Namespace) -> int:
    results: list[dict[str, Any]] = []
    for objects in args.objects:
        measure = args.measure or max(5_000, objects // 20)
        measure = max(args.batch, min(measure, objects // 4)) // args.batch * args.batch
        runs = [
            run_once(objects, args.object_bytes, args.batch, measure, args.exact, args.load) for _ in range(args.runs)
        ]
        summary = _median_run(runs)
        summary["mode"] = "exact" if args.exact else "sampled"
        summary["runs"] = [asdict(r) for r in runs]
        results.append(summary)
    if args.json:
        print(json.dumps({"results": results}))
        return 0
    print(f"put latency of one call of {args.batch} keys, free vs full and evicting (medians of {args.runs} runs)")
    print(
        f"  {'objects':>10}{'free p50':>10}{'free p99':>10}{'full p50':>10}{'full p99':>10}{'p50 x':>7}{'p99 x':>7}"
        f"{'exam/freed':>12}{'us/freed':>10}{'inline':>8}"
    )
    for r in results:
        print(
            f"  {r['objects']:>10,}{r['free_p50_us']:>10.1f}{r['free_p99_us']:>10.1f}{r['full_p50_us']:>10.1f}"
            f"{r['full_p99_us']:>10.1f}{r['p50_ratio']:>7.2f}{r['p99_ratio']:>7.2f}{r['examined_per_freed']:>12.1f}"
            f"{r['evict_us_per_freed']:>10.2f}{r['urgent_evictions']:>8.0f}"
        )
    return 0
