"""A checked, mixed client workload for chaos tests and the soak benchmark.

Every value is a function of its key (``expected_value``), so any reader in any process can tell a
wrong read from a right one without a shared table, across store restarts and failovers. Every call
is timed against the timeout it was given, so a test can assert that no call ran past its deadline.

In-process: ``MixedWorkload(client, prefix).run_for(seconds)`` on a few threads. As a child process
(``python -m kvpool.tools.workload --master ... --out result.json``), which is how the soak benchmark
and the network-partition test (a client inside a network namespace) run it; the result file is the
JSON of :class:`WorkloadResult`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpool.common.errors import ErrorCode, strerror

PUT_FINISH_GRACE_S = 1.0
"""PoolClient gives PutEnd/PutRevoke at least this long even when the transfers used up the caller's
timeout (a put whose bytes landed should not be lost to a tight budget), so a put may end this much
past its timeout by design; puts are checked against timeout + this grace."""


def expected_value(key: str, size: int) -> bytes:
    """The value stored under ``key`` by every writer of this workload (SHAKE-128 of the key)."""
    return hashlib.shake_128(key.encode()).digest(size)


# ---------------------------------------------------------------------- latency and deadlines
class Histogram:
    """Log-spaced latency buckets (5 % wide) from 1 us: mergeable across processes, fixed size."""

    RATIO = 1.05

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.total = 0

    def record(self, micros: float) -> None:
        bucket = 0 if micros <= 1.0 else int(math.log(micros) / math.log(self.RATIO)) + 1
        self.counts[bucket] = self.counts.get(bucket, 0) + 1
        self.total += 1

    def merge(self, other: dict[str, int] | dict[int, int]) -> None:
        for bucket, n in other.items():
            self.counts[int(bucket)] = self.counts.get(int(bucket), 0) + n
            self.total += n

    def percentile(self, p: float) -> float:
        """The upper edge (us) of the bucket holding the p-th percentile; 0 when empty."""
        if not self.total:
            return 0.0
        rank = max(1, math.ceil(p / 100.0 * self.total))
        seen = 0
        for bucket in sorted(self.counts):
            seen += self.counts[bucket]
            if seen >= rank:
                return 1.0 if bucket == 0 else self.RATIO**bucket
        return self.RATIO ** max(self.counts)


@dataclass
class WorkloadResult:
    """What one workload (a thread, a process, or all of them merged) did and saw."""

    ops: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    wrong_reads: int = 0
    reads_checked: int = 0
    lost: int = 0  # acknowledged objects later found missing (a store died with them)
    puts_ok: int = 0
    overruns: int = 0  # calls that took longer than their timeout (+ grace for puts) + slack
    worst_overrun_s: float = 0.0  # the largest (duration - allowed) seen, even within slack
    latency: dict[int, int] = field(default_factory=dict)  # Histogram buckets

    def merge(self, other: WorkloadResult) -> None:
        self.ops += other.ops
        for code, n in other.errors.items():
            self.errors[code] = self.errors.get(code, 0) + n
        self.wrong_reads += other.wrong_reads
        self.reads_checked += other.reads_checked
        self.lost += other.lost
        self.puts_ok += other.puts_ok
        self.overruns += other.overruns
        self.worst_overrun_s = max(self.worst_overrun_s, other.worst_overrun_s)
        hist = self.histogram()
        hist.merge(other.latency)
        self.latency = dict(hist.counts)

    def histogram(self) -> Histogram:
        hist = Histogram()
        hist.merge(self.latency)
        return hist

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> WorkloadResult:
        result = cls(**{k: v for k, v in doc.items() if k != "latency"})
        result.latency = {int(k): int(v) for k, v in doc.get("latency", {}).items()}
        return result


class MixedWorkload:
    """One thread's share of the workload: puts, checked gets, exists and removes of its own keys."""

    def __init__(
        self,
        client: Any,
        prefix: str,
        value_bytes: int = 16 << 10,
        timeout_s: float = 2.0,
        slack_s: float = 0.5,
        max_live: int = 2000,
        batch: int = 4,
        seed: int | None = None,
        mix: tuple[float, float, float, float] = (0.35, 0.40, 0.15, 0.10),
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.value_bytes = value_bytes
        self.timeout_s = timeout_s
        self.slack_s = slack_s
        self.max_live = max_live  # keep the pool below its eviction watermark: misses must mean loss
        self.batch = batch
        # Weights of put, get, exists, remove (normalised); (0, 1, 0, 0) is a pure checked reader.
        total = sum(mix)
        if total <= 0 or min(mix) < 0:
            raise ValueError("mix weights must be >= 0 and not all 0")
        self.thresholds = [sum(mix[: i + 1]) / total for i in range(4)]
        self.rng = random.Random(seed)
        self.live: list[str] = []
        self.result = WorkloadResult()
        self._hist = Histogram()
        self._next = 0

    # ---- bookkeeping
    def _timed(self, call: Callable[[], Any], allowed_s: float) -> Any:
        started = time.monotonic()
        value = call()
        took = time.monotonic() - started
        self._hist.record(took * 1e6)
        self.result.ops += 1
        over = took - allowed_s
        self.result.worst_overrun_s = max(self.result.worst_overrun_s, over)
        if over > self.slack_s:
            self.result.overruns += 1
        return value

    def _error(self, code: int) -> None:
        name = strerror(code)
        self.result.errors[name] = self.result.errors.get(name, 0) + 1

    def _new_keys(self, n: int) -> list[str]:
        keys = [f"{self.prefix}-{self._next + i}" for i in range(n)]
        self._next += n
        return keys

    # ---- operations
    def put(self, n: int | None = None) -> list[str]:
        """Put ``n`` new keys (their expected values); returns the acknowledged ones."""
        keys = self._new_keys(n or self.rng.randint(1, self.batch))
        values = [expected_value(k, self.value_bytes) for k in keys]
        codes = self._timed(
            lambda: self.client.batch_put_from(keys, values, timeout=self.timeout_s),
            self.timeout_s + PUT_FINISH_GRACE_S,
        )
        acked = []
        for key, code in zip(keys, codes, strict=True):
            if code == 0:
                acked.append(key)
            else:
                self._error(code)
        self.live.extend(acked)
        self.result.puts_ok += len(acked)
        return acked

    def get(self, keys: list[str] | None = None) -> None:
        """Read keys this workload acknowledged; a value unlike the expected one is a wrong read."""
        keys = keys or self.rng.sample(self.live, min(len(self.live), self.rng.randint(1, self.batch)))
        if not keys:
            return
        values = self._timed(lambda: self._get_with_codes(keys), self.timeout_s)
        for key, (code, value) in zip(keys, values, strict=True):
            if code == ErrorCode.OBJECT_NOT_FOUND:
                self._lose(key)
            elif code < 0:
                self._error(code)
            else:
                self.result.reads_checked += 1
                if value != expected_value(key, self.value_bytes):
                    self.result.wrong_reads += 1

    def _get_with_codes(self, keys: list[str]) -> list[tuple[int, bytes]]:
        buffers = [bytearray(self.value_bytes) for _ in keys]
        codes = self.client.batch_get_into(keys, buffers, timeout=self.timeout_s)
        return [(code, bytes(buf[:code]) if code >= 0 else b"") for code, buf in zip(codes, buffers, strict=True)]

    def _lose(self, key: str) -> None:
        self._error(int(ErrorCode.OBJECT_NOT_FOUND))
        self.result.lost += 1
        if key in self.live:
            self.live.remove(key)

    def exists(self) -> None:
        keys = self.rng.sample(self.live, min(len(self.live), self.batch)) + self._new_keys(1)  # + one miss
        codes = self._timed(lambda: self.client.batch_exists(keys, timeout=self.timeout_s), self.timeout_s)
        for code in codes:
            if code < 0:
                self._error(code)

    def remove(self) -> None:
        if not self.live:
            return
        key = self.live.pop(self.rng.randrange(len(self.live)))
        code = self._timed(lambda: self.client.batch_remove([key], timeout=self.timeout_s)[0], self.timeout_s)
        # A leased object (another reader) or an already-lost one is not an error of the pool.
        if code < 0 and code not in (ErrorCode.OBJECT_HAS_LEASE, ErrorCode.OBJECT_NOT_FOUND):
            self._error(code)

    def step(self) -> None:
        roll = self.rng.random()
        put_t, get_t, exists_t, _ = self.thresholds
        if roll < put_t or (not self.live and put_t > 0):
            if len(self.live) < self.max_live:
                self.put()
            else:
                self.remove()
        elif roll < get_t:
            self.get()
        elif roll < exists_t:
            self.exists()
        else:
            self.remove()

    def run_for(self, seconds: float, stop: threading.Event | None = None) -> WorkloadResult:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (stop is not None and stop.is_set()):
            self.step()
        return self.snapshot()

    def snapshot(self) -> WorkloadResult:
        self.result.latency = dict(self._hist.counts)
        return self.result


def run_threads(
    client: Any, prefix: str, threads: int, seconds: float, stop: threading.Event | None = None, **kwargs: Any
) -> WorkloadResult:
    """``threads`` MixedWorkloads on one client for ``seconds``; their merged result."""
    workloads = [MixedWorkload(client, f"{prefix}-t{i}", seed=i, **kwargs) for i in range(threads)]
    runners = [threading.Thread(target=w.run_for, args=(seconds, stop), daemon=True) for w in workloads]
    for t in runners:
        t.start()
    for t in runners:
        t.join()
    total = WorkloadResult()
    for w in workloads:
        total.merge(w.snapshot())
    return total


class BackgroundLoad:
    """``threads`` MixedWorkloads running on one client until ``stop()``; ``ops`` for waiting on progress."""

    def __init__(self, client: Any, prefix: str, threads: int = 3, **kwargs: Any) -> None:
        self.workloads = [MixedWorkload(client, f"{prefix}-t{i}", seed=i, **kwargs) for i in range(threads)]
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=w.run_for, args=(1e9, self._stop), daemon=True) for w in self.workloads
        ]

    @property
    def ops(self) -> int:
        return sum(w.result.ops for w in self.workloads)

    def start(self) -> BackgroundLoad:
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float = 30.0) -> WorkloadResult:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        total = WorkloadResult()
        for w in self.workloads:
            total.merge(w.snapshot())
        return total


# ---------------------------------------------------------------------- as a child process
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a checked mixed kvpool workload (chaos tests, soak)")
    parser.add_argument("--master", required=True)
    parser.add_argument("--prefix", default="w")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--value-bytes", type=int, default=16 << 10)
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--slack", type=float, default=0.5)
    parser.add_argument("--max-live", type=int, default=2000)
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    args = parser.parse_args(argv)

    from kvpool.client import ClientConfig, PoolClient

    config = ClientConfig(
        master=args.master,
        use_shm=False,
        timeout_s=args.timeout,
        breaker_backoff_s=0.1,
        breaker_max_backoff_s=0.5,
    )
    with PoolClient(config=config) as client:
        result = run_threads(
            client,
            args.prefix,
            args.threads,
            args.duration,
            value_bytes=args.value_bytes,
            timeout_s=args.timeout,
            slack_s=args.slack,
            max_live=args.max_live,
        )
    Path(args.out).write_text(json.dumps(asdict(result)))
    print(json.dumps({"ops": result.ops, "wrong_reads": result.wrong_reads}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
