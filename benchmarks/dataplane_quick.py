"""Quick data-path benchmark: TcpTransport against a DataPlaneServer in another process.

Reports batched put/get GB/s of 1 MiB and 4 MiB values (64 MiB per batch, distinct keys and offsets),
single 64 KiB get latency, and each as a ratio to this machine's raw loopback TCP ceiling
(benchmarks/ceiling.py). The ceiling is measured in slices *interleaved* with the transport's slices and
each ratio is taken per round, so a machine shared with other work (load comes and goes) does not skew
the ratios; medians over the rounds are printed. The harness plays the master: it signs the grants.

    PYTHONPATH=src python benchmarks/dataplane_quick.py [--json] [--rounds 5] [--slice 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's BLAS threads must not spin beside the benchmark

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from benchmarks.ceiling import RawTcpPeer  # noqa: E402
from kvpool.common.clock import Deadline  # noqa: E402
from kvpool.common.grants import GrantOp, make_grant, new_secret  # noqa: E402
from kvpool.tools.argtypes import positive_float, positive_int  # noqa: E402
from kvpool.tools.ceiling import prefaulted  # noqa: E402
from kvpool.transfer.base import Replica, TransferRequest  # noqa: E402
from kvpool.transfer.tcp import SOCKET_BUFFER, TcpTransport  # noqa: E402

SEGMENT_BYTES = 160 << 20
BATCH_BYTES = 64 << 20
SINGLE = 64 << 10
LARGE = (1 << 20, 4 << 20)


def serve(size: int, socket_buffer: int, spin_us: int = 0) -> None:
    """Store process: one segment, one data plane; prints its coordinates, serves until stdin closes."""
    from kvpool.store.dataplane import DataPlaneServer
    from kvpool.store.inventory import Inventory
    from kvpool.store.segment import ShmSegment

    secret = new_secret()
    seg = ShmSegment.create("/dev/shm", f"kvpool-bench-{os.getpid()}", size)
    seg.prefault()
    server = DataPlaneServer(
        "127.0.0.1", 0, {seg.id: seg}, {seg.id: secret}, Inventory(), socket_buffer=socket_buffer, spin_us=spin_us
    )
    server.start()
    print(json.dumps({"port": server.port, "segment_id": seg.id, "secret": secret.hex()}), flush=True)
    try:
        sys.stdin.read()
    finally:
        server.stop()
        seg.close()


@dataclass
class Store:
    proc: subprocess.Popen[str]
    endpoint: str
    segment_id: int
    secret: bytes

    def replica(self, op: GrantOp, key: bytes, offset: int, length: int) -> Replica:
        expiry = int(time.time() * 1000) + 3_600_000
        g = make_grant(self.secret, op, self.segment_id, offset, length, expiry, key)
        return Replica(self.segment_id, "bench", self.endpoint, "", offset, length, expiry, g.mac)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_store(size: int = SEGMENT_BYTES, socket_buffer: int = SOCKET_BUFFER, spin_us: int = 0) -> Store:
    """A store process (``serve``); ``spin_us`` as the store's ``--spin-us`` (0: it never polls)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(size), "--sockbuf", str(socket_buffer), "--spin-us", str(spin_us)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    return Store(proc, f"127.0.0.1:{info['port']}", info["segment_id"], bytes.fromhex(info["secret"]))


def _requests(store: Store, op: GrantOp, buffers: list[memoryview], size: int, base: int = 0) -> list[TransferRequest]:
    return [
        TransferRequest(
            op,
            b"bench-%d" % (base + i),
            store.replica(op, b"bench-%d" % (base + i), (base + i) * size, size),
            buf,
        )
        for i, buf in enumerate(buffers)
    ]


def _batch_gbps(transport: TcpTransport, reqs: list[TransferRequest], seconds: float) -> float:
    """GB/s of repeating one batch for about ``seconds``."""
    nbytes = sum(r.replica.length for r in reqs)
    rounds = 0
    start = time.perf_counter()
    while True:
        codes = transport.transfer(reqs, Deadline(30))
        assert not any(codes), codes
        rounds += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return rounds * nbytes / elapsed / 1e9


def call_latencies(call: Callable[[int], None], seconds: float) -> list[float]:
    """Seconds taken by each ``call(i)``, i = 0, 1, ..., called one after another for about ``seconds``."""
    lat: list[float] = []
    end = time.perf_counter() + seconds
    i = 0
    while True:
        t0 = time.perf_counter()
        call(i)
        t1 = time.perf_counter()
        lat.append(t1 - t0)
        i += 1
        if t1 >= end:
            return lat


def _latencies(transport: TcpTransport, reqs: list[TransferRequest], seconds: float) -> list[float]:
    def once(_i: int) -> None:
        codes = transport.transfer(reqs, Deadline(5))
        assert codes == [0], codes

    return call_latencies(once, seconds)


class Workload:
    """Preallocated sources/destinations and signed requests for every measured case."""

    def __init__(self, store: Store, transport: TcpTransport) -> None:
        rng = np.random.default_rng(0)
        self.src: dict[int, np.ndarray] = {}
        self.dst: dict[int, np.ndarray] = {}
        self.puts: dict[int, list[TransferRequest]] = {}
        self.gets: dict[int, list[TransferRequest]] = {}
        for size in LARGE:
            count = BATCH_BYTES // size
            self.src[size] = rng.integers(0, 256, size * count, dtype=np.uint8)
            # page-aligned, as the ceiling's buffer is (kvpool.tools.ceiling.prefaulted says why)
            self.dst[size] = np.frombuffer(prefaulted(size * count), dtype=np.uint8)
            srcs = [memoryview(self.src[size][i * size : (i + 1) * size].data) for i in range(count)]
            dsts = [memoryview(self.dst[size][i * size : (i + 1) * size].data) for i in range(count)]
            self.puts[size] = _requests(store, GrantOp.WRITE, srcs, size)
            self.gets[size] = _requests(store, GrantOp.READ, dsts, size)
        self.single_src = memoryview(os.urandom(SINGLE))
        self.single_dst = memoryview(bytearray(SINGLE))
        slot = SEGMENT_BYTES // SINGLE - 1  # past the batches
        self.single_put = _requests(store, GrantOp.WRITE, [self.single_src], SINGLE, slot)
        self.single_get = _requests(store, GrantOp.READ, [self.single_dst], SINGLE, slot)
        for reqs in (*self.puts.values(), self.single_put):  # warm up: connections, pages, TCP windows
            assert not any(transport.transfer(reqs, Deadline(30)))
        for reqs in (*self.gets.values(), self.single_get):
            assert not any(transport.transfer(reqs, Deadline(30)))

    def verify(self) -> None:
        for size in LARGE:
            assert np.array_equal(self.src[size], self.dst[size]), f"{size}-byte values differ"
        assert self.single_src == self.single_dst, "64 KiB value differs"


def run(
    rounds: int,
    slice_s: float,
    connections: int,
    stripe: int,
    window: int,
    socket_buffer: int = SOCKET_BUFFER,
    inflight: int | None = None,
) -> dict[str, Any]:
    store = start_store(socket_buffer=socket_buffer)
    transport = TcpTransport(
        connections_per_endpoint=connections,
        stripe_bytes=stripe,
        window=window,
        socket_buffer=socket_buffer,
        inflight_bytes=inflight,
    )
    peer = RawTcpPeer()
    samples: dict[str, list[float]] = defaultdict(list)
    single: list[float] = []
    try:
        work = Workload(store, transport)
        for _ in range(rounds):
            ceiling = {size: peer.measure(size, slice_s) for size in (SINGLE, *LARGE)}
            for size in (SINGLE, *LARGE):
                samples[f"ceiling_{size}_gbps"].append(ceiling[size].gbps)
                samples[f"ceiling_{size}_p50_us"].append(ceiling[size].p50_us)
            for size in LARGE:
                for op, reqs in (("put", work.puts[size]), ("get", work.gets[size])):
                    gbps = _batch_gbps(transport, reqs, slice_s)
                    samples[f"{op}_{size}_gbps"].append(gbps)
                    samples[f"{op}_{size}_ratio"].append(gbps / ceiling[size].gbps)
            lat = sorted(_latencies(transport, work.single_get, slice_s))
            single += lat
            p50 = lat[len(lat) // 2]
            samples["single_p50_us"].append(p50 * 1e6)
            samples["single_ratio"].append(SINGLE / p50 / 1e9 / ceiling[SINGLE].gbps)
        work.verify()
    finally:
        peer.close()
        transport.close()
        store.close()
    med = {k: statistics.median(v) for k, v in samples.items()}
    single.sort()
    p50_all = single[len(single) // 2]
    result: dict[str, Any] = {
        "config": {
            "connections": connections,
            "stripe_bytes": stripe,
            "window": window,
            "socket_buffer": socket_buffer,
            "inflight_bytes": transport.inflight_bytes,
            "rounds": rounds,
            "slice_s": slice_s,
        },
        "ceiling": {
            f"{s >> 10}KiB": {"gbps": med[f"ceiling_{s}_gbps"], "p50_us": med[f"ceiling_{s}_p50_us"]}
            for s in (SINGLE, *LARGE)
        },
        "single_64KiB_get": {
            "p50_us": p50_all * 1e6,
            "p99_us": single[int(len(single) * 0.99)] * 1e6,
            "gbps_at_p50": SINGLE / p50_all / 1e9,
            "ratio_to_raw_64KiB": med["single_ratio"],
        },
    }
    for size in LARGE:
        result[f"batch_{size >> 20}MiB"] = {
            "batch": BATCH_BYTES // size,
            **{f"{op}_{what}": med[f"{op}_{size}_{what}"] for op in ("put", "get") for what in ("gbps", "ratio")},
            **{f"{op}_ratio_min": min(samples[f"{op}_{size}_ratio"]) for op in ("put", "get")},
        }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description="kvpool TCP data-path quick benchmark")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=positive_int, default=5, help="interleaved ceiling/transport rounds")
    parser.add_argument("--slice", type=positive_float, default=0.5, help="seconds per measurement slice")
    parser.add_argument("--connections", type=positive_int, default=4)
    parser.add_argument("--stripe", type=positive_int, default=1 << 20)
    parser.add_argument("--window", type=positive_int, default=16)
    parser.add_argument("--sockbuf", type=positive_int, default=SOCKET_BUFFER)
    parser.add_argument("--inflight", type=positive_int, default=None, help="default: two stripes, >= 2 MiB")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--spin-us", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.sockbuf, args.spin_us)
        return 0
    result = run(args.rounds, args.slice, args.connections, args.stripe, args.window, args.sockbuf, args.inflight)
    if args.json:
        print(json.dumps(result, default=lambda x: round(x, 3) if isinstance(x, float) else x))
        return 0
    for name, value in result.items():
        if isinstance(value, dict):
            print(
                f"{name}: "
                + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in value.items())
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
