"""``kvpool bench ssd``: the SSD tier against the disk it writes to, measured in the same run.

It measures the disk's direct (``O_DIRECT``) write and read bandwidth in ``--dir`` (one stream of 4 MiB
blocks, as ``dd oflag=direct bs=4M`` does), then starts a local cluster of a master and one store with
``--dram`` of DRAM and an SSD tier of ``--ssd`` in ``--dir``, and for each of ``--runs`` runs:

* **burst**: one client puts ``--burst-factor`` x DRAM of ``--object``-byte values as fast as it can, in
  batches of ``--batch``; the latency of each batched put is recorded (``put_p99_ms_during_burst``);
* **demotion**: the master's ``demoted_bytes`` is sampled every 10 ms from the start of the burst until the
  backlog is empty; ``demote_gbps`` is the bytes demoted over the time from the first to the last demotion
  (the sustained rate: puts outrun the disk, so demotion is what sets the pace);
* **kept**: the fraction of the burst's keys that exist afterwards (``burst_kept_fraction``);
* **SSD reads**: the page cache of the tier's data file is dropped (``posix_fadvise``), then the burst's keys
  that live only on SSD are read back in batches of ``--batch`` with ``batch_get_into`` (the client verifies
  each value's checksum; the bench checks each value's first bytes): ``ssd_read_gbps``;
* **promotion**: the burst's objects still in DRAM are removed, then a second leased lookup of a batch of
  SSD-only objects (half the DRAM's worth; the SSD reads above were the first) makes the master schedule
  their promotion (``--promote-after-hits 2``); ``promote_gbps`` is their bytes over the time from that
  lookup until the master has every promotion's result (the store's O_DIRECT reads into its segment);
* then everything is removed, so the next run starts from an empty pool.

``--burst-policy`` picks the master's ``--ssd-burst-policy``: ``backpressure`` (the default: puts are held
back, nothing is dropped) or ``drop-coldest`` (puts are never held back; ``burst_dropped`` counts the
objects dropped instead, and ``burst_kept_fraction`` shows what that costs). Each figure is the median of
the runs; ``runs`` has every run's figures (the noise).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpool.master.burst import BURST_POLICIES
from kvpool.tools.argtypes import positive_float, positive_int, size_bytes

DISK_PROBE_BYTES = 256 << 20
DISK_BLOCK = 4 << 20
SAMPLE_S = 0.01


@dataclass
class RunResult:
    demote_gbps: float
    burst_kept_fraction: float
    ssd_read_gbps: float
    put_p99_ms_during_burst: float
    burst_seconds: float
    demoted_bytes: int
    read_bytes: int
    puts_backpressured: int
    dram_dropped: int
    burst_dropped: int = 0
    promote_gbps: float = 0.0
    promoted: int = 0


@dataclass
class Report:
    disk_write_gbps: float
    disk_read_gbps: float
    demote_gbps: float
    burst_kept_fraction: float
    ssd_read_gbps: float
    put_p99_ms_during_burst: float
    demote_ratio: float
    ssd_read_ratio: float
    directory: str
    object_bytes: int
    dram_bytes: int
    ssd_bytes: int
    runs: list[dict[str, Any]] = field(default_factory=list)
    burst_policy: str = "backpressure"
    promote_gbps: float = 0.0
    promote_ratio: float = 0.0
    """promote_gbps / disk_read_gbps."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir",
        default="",
        help="directory on the disk to measure (default: a temporary directory under the current one)",
    )
    parser.add_argument("--dram", type=size_bytes, default="64MiB", help="the store's DRAM segment (default 64MiB)")
    parser.add_argument("--ssd", type=size_bytes, default="1GiB", help="the store's SSD tier (default 1GiB)")
    parser.add_argument("--object", type=size_bytes, default="256KiB", help="value size (default 256KiB)")
    parser.add_argument("--batch", type=positive_int, default=16, help="values per batched put/get (default 16)")
    parser.add_argument(
        "--burst-factor", type=positive_float, default=4.0, help="the burst puts this many x DRAM (default 4)"
    )
    parser.add_argument(
        "--burst-policy",
        default="backpressure",
        choices=BURST_POLICIES.names(),
        help="the master's --ssd-burst-policy (default backpressure)",
    )
    parser.add_argument("--runs", type=positive_int, default=3, help="runs; medians are reported (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


# ---------------------------------------------------------------------- the disk's own bandwidth


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes)
    buf.write(os.urandom(4096) * (nbytes // 4096))
    return buf


def measure_disk(directory: Path, total: int = DISK_PROBE_BYTES) -> tuple[float, float]:
    """(direct write GB/s, direct read GB/s) of one stream of 4 MiB blocks in ``directory``."""
    path = directory / "disk-probe"
    buf = _aligned_buffer(DISK_BLOCK)
    view = memoryview(buf)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    fd = os.open(path, flags, 0o600)
    try:
        started = time.perf_counter()
        for offset in range(0, total, DISK_BLOCK):
            os.pwrite(fd, view, offset)
        os.fsync(fd)
        write_s = time.perf_counter() - started
        os.posix_fadvise(fd, 0, total, os.POSIX_FADV_DONTNEED)
        started = time.perf_counter()
        for offset in range(0, total, DISK_BLOCK):
            os.preadv(fd, [view], offset)
        read_s = time.perf_counter() - started
    finally:
        os.close(fd)
        view.release()
        buf.close()
        path.unlink(missing_ok=True)
    return total / write_s / 1e9, total / read_s / 1e9


# ---------------------------------------------------------------------- one run against the pool


class _Sampler(threading.Thread):
    """Samples the master's tier counters every SAMPLE_S: (time, demoted bytes, backlog bytes)."""

    def __init__(self, master: str) -> None:
        super().__init__(name="bench-ssd-sampler", daemon=True)
        from kvpool.client import PoolClient

        self._pool = PoolClient(master)
        self.samples: list[tuple[float, float, float]] = []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(SAMPLE_S):
            extra = self._pool.stats().extra
            self.samples.append(
                (time.monotonic(), extra.get("demoted_bytes", 0.0), extra.get("demote_pending_bytes", 0.0))
            )

    def stop(self) -> None:
        self._done.set()
        self.join()
        self._pool.close()


def _demote_rate(samples: list[tuple[float, float, float]]) -> tuple[float, int]:
    """(GB/s from the first to the last sample in which demoted bytes grew, bytes demoted)."""
    first = samples[0][1]
    growing = [(t, b) for (t, b, _), (_, prev, _) in zip(samples[1:], samples, strict=False) if b > prev]
    if len(growing) < 2:
        return 0.0, int(samples[-1][1] - first)
    start_t = max(t for t, b, _ in samples if b <= first)  # the last sample before demotion began
    end_t, end_b = growing[-1]
    return (end_b - first) / (end_t - start_t) / 1e9, int(end_b - first)


def _settled(pool: Any, dram: int) -> bool:
    stats = pool.stats()
    extra = stats.extra
    return not extra.get("tier_tasks_pending", 0) and not extra.get("demote_pending_bytes", 0) and stats.used <= dram


def one_run(master: str, data_file: Path, args: argparse.Namespace, run: int) -> RunResult:
    from kvpool.client import PoolClient
    from kvpool.common.errors import batch_failure
    from kvpool.tools.ceiling import prefaulted

    obj, batch = args.object, args.batch
    count = int(args.burst_factor * args.dram) // obj
    keys = [f"ssd-bench-{run}-{i}" for i in range(count)]
    region = prefaulted(obj * batch, os.urandom(4096))
    buffers = [region[i * obj : (i + 1) * obj] for i in range(batch)]
    latencies: list[float] = []
    with PoolClient(master) as pool:
        before = pool.stats().extra
        sampler = _Sampler(master)
        sampler.start()
        burst_started = time.perf_counter()
        for start in range(0, count, batch):
            part = keys[start : start + batch]
            for i, buf in enumerate(buffers[: len(part)]):
                buf[:8] = (start + i).to_bytes(8, "little")
            t0 = time.perf_counter()
            codes = pool.batch_put_from(part, buffers[: len(part)], timeout=30.0)
            latencies.append(time.perf_counter() - t0)
            if any(c != 0 for c in codes):
                raise batch_failure("burst put failed", [c for c in codes if c != 0])
        # (drop-coldest: a dropped key reads as missing below, which is what burst_kept_fraction counts)
        burst_s = time.perf_counter() - burst_started
        deadline = time.monotonic() + 120.0
        while not _settled(pool, args.dram) and time.monotonic() < deadline:
            time.sleep(SAMPLE_S)  # a benchmark polling for the backlog to drain, not a test
        time.sleep(5 * SAMPLE_S)  # two more samples after the last demotion
        sampler.stop()
        demote_gbps, demoted = _demote_rate(sampler.samples)
        present = [k for k, e in zip(keys, pool.batch_exists(keys), strict=True) if e > 0]
        read_gbps, read_bytes = _read_ssd(pool, present, data_file, obj, batch)
        promote_gbps, promoted = _promote(pool, present, args.dram // 2 // obj, obj)
        after = pool.stats().extra
        pool.remove_all(force=True)
        wait_until = time.monotonic() + 60.0
        while pool.stats().extra.get("ssd_used_bytes", 0) and time.monotonic() < wait_until:
            time.sleep(SAMPLE_S)
    latencies.sort()
    return RunResult(
        demote_gbps,
        len(present) / count,
        read_gbps,
        latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e3,
        burst_s,
        demoted,
        read_bytes,
        int(after.get("puts_backpressured", 0) - before.get("puts_backpressured", 0)),
        int(after.get("dram_dropped", 0) - before.get("dram_dropped", 0)),
        int(after.get("burst_dropped", 0) - before.get("burst_dropped", 0)),
        promote_gbps,
        promoted,
    )


def _ssd_only(pool: Any, keys: list[str]) -> list[str]:
    from kvpool.common.clock import Deadline
    from kvpool.proto import frames
    from kvpool.proto import master_pb2 as pb

    out: list[str] = []
    for start in range(0, len(keys), 512):
        part = keys[start : start + 512]
        request = pb.BatchGetReplicasRequest(keys=part, no_lease=True)
        resp = pool._master.call(frames.Op.BATCH_GET_REPLICAS, request, Deadline(10.0))
        out += [k for k, r in zip(part, resp.results, strict=True) if r.replicas and all(d.tier for d in r.replicas)]
    return out


def _promote(pool: Any, keys: list[str], most: int, obj: int) -> tuple[float, int]:
    """Promote up to ``most`` SSD-only objects among ``keys`` (already read once) as the master schedules
    it: (GB/s from the second leased lookup until every promotion is reported, objects promoted)."""
    from kvpool.common.clock import Deadline
    from kvpool.proto import frames
    from kvpool.proto import master_pb2 as pb

    on_ssd = set(_ssd_only(pool, keys))
    in_dram = [k for k in keys if k not in on_ssd]
    for start in range(0, len(in_dram), 512):  # room in DRAM: a promotion never evicts
        pool.batch_remove(in_dram[start : start + 512], force=True)
    chosen = [k for k in keys if k in on_ssd][:most]
    if not chosen:
        return 0.0, 0

    def reported() -> tuple[int, int]:
        extra = pool.stats().extra
        return int(extra.get("promotions", 0)), int(extra.get("promote_failures", 0))

    ok0, failed0 = reported()
    started = time.perf_counter()
    for start in range(0, len(chosen), 512):  # the second read of each: the master queues its promotion
        request = pb.BatchGetReplicasRequest(keys=chosen[start : start + 512])
        pool._master.call(frames.Op.BATCH_GET_REPLICAS, request, Deadline(10.0))
    deadline = time.monotonic() + 60.0
    ok, failed = ok0, failed0
    while ok - ok0 + failed - failed0 < len(chosen) and time.monotonic() < deadline:
        time.sleep(SAMPLE_S / 10)  # a benchmark polling the master's counters, not a test
        ok, failed = reported()
    elapsed = time.perf_counter() - started
    return (ok - ok0) * obj / elapsed / 1e9, ok - ok0


def _read_ssd(pool: Any, keys: list[str], data_file: Path, obj: int, batch: int) -> tuple[float, int]:
    """Batched reads of the SSD-only objects among ``keys``, the tier's page cache dropped first."""
    from kvpool.common.errors import batch_failure
    from kvpool.tools.ceiling import prefaulted

    on_ssd = _ssd_only(pool, keys)
    if not on_ssd:
        return 0.0, 0
    fd = os.open(data_file, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    region = prefaulted(obj * batch)
    buffers = [region[i * obj : (i + 1) * obj] for i in range(batch)]
    started = time.perf_counter()
    for start in range(0, len(on_ssd), batch):
        part = on_ssd[start : start + batch]
        codes = pool.batch_get_into(part, buffers[: len(part)], timeout=30.0)
        if any(c != obj for c in codes):
            raise batch_failure("SSD read failed", [c for c in codes if c != obj])
        for key, buf in zip(part, buffers, strict=False):
            if int.from_bytes(buf[:8], "little") != int(key.rsplit("-", 1)[1]):
                raise AssertionError(f"{key} read back another value")
    elapsed = time.perf_counter() - started
    return len(on_ssd) * obj / elapsed / 1e9, len(on_ssd) * obj


# ---------------------------------------------------------------------- the command


def measure(args: argparse.Namespace, directory: Path) -> Report:
    from kvpool.tools.local_cluster import LocalCluster

    disk = [measure_disk(directory) for _ in range(args.runs)]
    ssd_dir = directory / "ssd"
    master_args = ("--promote-after-hits", "2", "--ssd-burst-policy", args.burst_policy)
    cluster = LocalCluster(stores=0, base_dir=directory / "cluster", master_args=master_args)
    cluster.start()
    results: list[RunResult] = []
    try:
        cluster.add_store(size=str(args.dram), extra=("--ssd-dir", str(ssd_dir), "--ssd-size", str(args.ssd)))
        for run in range(args.runs):
            result = one_run(cluster.master, ssd_dir / "data.kvs", args, run)
            results.append(result)
            print(f"  run {run}: {json.dumps(asdict(result))}", file=sys.stderr)
    finally:
        cluster.stop()
    disk_write = statistics.median(w for w, _ in disk)
    disk_read = statistics.median(r for _, r in disk)
    demote = statistics.median(r.demote_gbps for r in results)
    ssd_read = statistics.median(r.ssd_read_gbps for r in results)
    promote = statistics.median(r.promote_gbps for r in results)
    return Report(
        disk_write,
        disk_read,
        demote,
        statistics.median(r.burst_kept_fraction for r in results),
        ssd_read,
        statistics.median(r.put_p99_ms_during_burst for r in results),
        demote / disk_write if disk_write else 0.0,
        ssd_read / disk_read if disk_read else 0.0,
        str(directory),
        args.object,
        args.dram,
        args.ssd,
        [{"disk_write_gbps": w, "disk_read_gbps": r, **asdict(x)} for (w, r), x in zip(disk, results, strict=True)],
        args.burst_policy,
        promote,
        promote / disk_read if disk_read else 0.0,
    )


def run(args: argparse.Namespace) -> int:
    own = not args.dir
    directory = Path(tempfile.mkdtemp(prefix=".kvpool-bench-ssd-", dir=".")) if own else Path(args.dir)
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        report = measure(args, directory)
    finally:
        if own:
            shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        print(json.dumps(asdict(report)))
        return 0
    print(
        f"disk ({report.directory}): direct write {report.disk_write_gbps:.2f} GB/s, read {report.disk_read_gbps:.2f}"
    )
    print(f"demotion        {report.demote_gbps:.2f} GB/s  ({report.demote_ratio:.2f} x disk write)")
    print(f"burst kept      {report.burst_kept_fraction:.4f}   put p99 {report.put_p99_ms_during_burst:.1f} ms")
    print(f"SSD reads       {report.ssd_read_gbps:.2f} GB/s  ({report.ssd_read_ratio:.2f} x disk read)")
    print(f"promotion       {report.promote_gbps:.2f} GB/s  ({report.promote_ratio:.2f} x disk read)")
    print(f"burst policy    {report.burst_policy}")
    return 0
