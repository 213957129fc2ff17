"""``kvpool bench soak``: client processes run a mixed, checked workload against a local cluster while a
store is killed and restarted in the middle; prints what they did and what the servers cost.

Each client process (``kvpool.tools.workload``) runs several threads of puts, byte-checked gets,
exists and removes of its own keys. Printed: operations, errors by code (OBJECT_NOT_FOUND counts objects
lost with the killed store), wrong reads (must be 0), p50/p99 call latency, and the peak RSS (VmHWM) of
every server process. Store RSS includes the segment's shared-memory pages it has touched.

``--json`` prints exactly ``{"ops", "errors": {code: n}, "wrong_reads", "p50_us", "p99_us",
"peak_rss_bytes": {process: n}}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.tools.argtypes import positive_float, positive_int, size
from kvpool.tools.workload import WorkloadResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=positive_float, default=60.0, help="seconds of load (default 60)")
    parser.add_argument("--clients", type=positive_int, default=3, help="client processes (default 3)")
    parser.add_argument("--threads", type=positive_int, default=2, help="threads per client process (default 2)")
    parser.add_argument("--stores", type=positive_int, default=2, help="stores (default 2)")
    parser.add_argument("--store-size", type=size, default="128MiB", help="segment size of each store (default 128MiB)")
    parser.add_argument("--value-bytes", type=positive_int, default=16 << 10, help="object size (default 16 KiB)")
    parser.add_argument(
        "--timeout", type=positive_float, default=2.0, help="deadline of every client call (default 2 s)"
    )
    parser.add_argument(
        "--restart-at",
        type=float,
        default=0.5,
        help="kill and restart a store at this fraction of the run (default 0.5; <0 = never)",
    )
    parser.add_argument("--dir", default="", help="cluster directory (default: a temp dir, removed after)")
    parser.add_argument("--json", action="store_true", help="print the JSON summary only")


def read_peak_rss(pid: int) -> int:
    """VmHWM of ``pid`` in bytes (the kernel's own peak RSS), 0 when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


@dataclass
class RssWatcher:
    """Samples VmHWM of the cluster's server processes every ``interval`` s (a restarted process is a
    new name, so the killed one keeps its last sample)."""

    cluster: Any
    interval: float = 0.5
    peaks: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> None:
        for proc in list(self.cluster.processes):
            if proc.role in ("master", "store"):
                self.peaks[proc.name] = max(self.peaks.get(proc.name, 0), read_peak_rss(proc.pid))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rss-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()


Client = tuple[subprocess.Popen[bytes], Path]


def _spawn_clients(args: argparse.Namespace, master: str, base: Path) -> list[Client]:
    clients = []
    for i in range(args.clients):
        out = base / f"client-{i}.json"
        cmd = [
            sys.executable,
            "-m",
            "kvpool.tools.workload",
            "--master",
            master,
            "--prefix",
            f"c{i}",
            "--threads",
            str(args.threads),
            "--duration",
            str(args.duration),
            "--value-bytes",
            str(args.value_bytes),
            "--timeout",
            str(args.timeout),
            "--out",
            str(out),
        ]
        log = open(base / f"client-{i}.log", "wb")  # noqa: SIM115 - closed with the process below
        clients.append(
            (
                subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                ),
                out,
            )
        )
        log.close()  # the child holds its own descriptor
    return clients


def _restart_a_store(cluster: Any, watcher: RssWatcher) -> None:
    victim = cluster.stores[0]
    watcher.sample()  # its last peak, before it is gone
    cluster.kill(victim)
    cluster.restart(victim)


def _wait_clients(clients: list[Client], timeout: float) -> WorkloadResult:
    total = WorkloadResult()
    deadline = time.monotonic() + timeout
    for proc, out in clients:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.returncode != 0 or not out.exists():
            total.errors["CLIENT_PROCESS_FAILED"] = total.errors.get("CLIENT_PROCESS_FAILED", 0) + 1
            continue
        total.merge(WorkloadResult.from_json(json.loads(out.read_text())))
    return total


def soak(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    """Run one soak in ``base``; the summary document."""
    from kvpool.tools.local_cluster import LocalCluster

    # Short store expiry and put reclaim: the killed store's objects turn into clean misses quickly.
    master_args = ("--store-ttl-s", "3", "--put-timeout-s", "5")
    with LocalCluster(
        stores=args.stores, store_size=args.store_size, base_dir=base / "cluster", master_args=master_args
    ) as cluster:
        watcher = RssWatcher(cluster)
        watcher.start()
        clients = _spawn_clients(args, cluster.master, base)
        try:
            if 0 <= args.restart_at <= 1:
                time.sleep(args.duration * args.restart_at)  # a schedule, not a wait for a condition
                _restart_a_store(cluster, watcher)
            total = _wait_clients(clients, args.duration + 120.0)
        finally:
            for proc, _ in clients:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            watcher.stop()
    hist = total.histogram()
    return {
        "ops": total.ops,
        "errors": dict(sorted(total.errors.items())),
        "wrong_reads": total.wrong_reads,
        "p50_us": round(hist.percentile(50), 1),
        "p99_us": round(hist.percentile(99), 1),
        "peak_rss_bytes": dict(sorted(watcher.peaks.items())),
    }


def run(args: argparse.Namespace) -> int:
    if args.dir:
        base = Path(args.dir)
        base.mkdir(parents=True, exist_ok=True)
        doc = soak(args, base)
    else:
        with tempfile.TemporaryDirectory(prefix="kvpool-soak-") as tmp:
            doc = soak(args, Path(tmp))
    if args.json:
        print(json.dumps(doc))
    else:
        print(
            f"soak {args.duration:.0f} s, {args.clients} client processes x {args.threads} threads, "
            f"{args.stores} stores (one killed and restarted at {args.restart_at:.0%}):"
        )
        print(f"  operations      {doc['ops']}")
        print(f"  errors          {doc['errors'] or 'none'}")
        print(f"  wrong reads     {doc['wrong_reads']}")
        print(f"  latency         p50 {doc['p50_us']:.0f} us, p99 {doc['p99_us']:.0f} us")
        for name, rss in doc["peak_rss_bytes"].items():
            print(f"  peak RSS        {name:<10} {rss / 2**20:.1f} MiB")
    failed = doc["wrong_reads"] or doc["errors"].get("CLIENT_PROCESS_FAILED", 0)
    return 1 if failed else 0
