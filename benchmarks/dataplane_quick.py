"""Quick data-path benchmark: TcpTransport against a DataPlaneServer in another process.

Prints batched put/get GB/s for 1 MiB and 4 MiB values, single 64 KiB get p50 latency, and each as a
ratio to this machine's raw loopback TCP ceiling (benchmarks/ceiling.py). The test harness plays the
master: it signs the grants with the segment's secret.

    PYTHONPATH=src python benchmarks/dataplane_quick.py [--json] [--seconds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from benchmarks.ceiling import measure_tcp  # noqa: E402
from kvpool.common.clock import Deadline  # noqa: E402
from kvpool.common.grants import GrantOp, make_grant, new_secret  # noqa: E402
from kvpool.transfer.base import Replica, TransferRequest  # noqa: E402
from kvpool.transfer.tcp import SOCKET_BUFFER, TcpTransport  # noqa: E402

SEGMENT_BYTES = 160 << 20
BATCH_BYTES = 64 << 20


def serve(size: int, socket_buffer: int) -> None:
    """Store process: one segment, one data plane; prints its coordinates, serves until stdin closes."""
    from kvpool.store.dataplane import DataPlaneServer
    from kvpool.store.inventory import Inventory
    from kvpool.store.segment import ShmSegment

    secret = new_secret()
    seg = ShmSegment.create("/dev/shm", f"kvpool-bench-{os.getpid()}", size)
    seg.prefault()
    server = DataPlaneServer("127.0.0.1", 0, {seg.id: seg}, {seg.id: secret}, Inventory(),
                             socket_buffer=socket_buffer)
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


def start_store(size: int = SEGMENT_BYTES, socket_buffer: int = SOCKET_BUFFER) -> Store:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(size), "--sockbuf", str(socket_buffer)],
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    return Store(proc, f"127.0.0.1:{info['port']}", info["segment_id"], bytes.fromhex(info["secret"]))


def _requests(store: Store, op: GrantOp, buffers: list[memoryview], size: int) -> list[TransferRequest]:
    return [TransferRequest(op, b"bench-%d" % i, store.replica(op, b"bench-%d" % i, i * size, size), buf)
            for i, buf in enumerate(buffers)]


def _run_for(transport: TcpTransport, reqs: list[TransferRequest], seconds: float) -> float:
    """GB/s of repeating one batch for about ``seconds``."""
    nbytes = sum(r.replica.length for r in reqs)
    codes = transport.transfer(reqs, Deadline(30))  # warm-up: connections, window growth
    assert all(c == 0 for c in codes), codes
    rounds = 0
    start = time.perf_counter()
    while True:
        codes = transport.transfer(reqs, Deadline(30))
        assert all(c == 0 for c in codes), codes
        rounds += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return rounds * nbytes / elapsed / 1e9


def batched(store: Store, transport: TcpTransport, size: int, seconds: float) -> dict[str, float]:
    count = BATCH_BYTES // size
    src = np.random.default_rng(0).integers(0, 256, size * count, dtype=np.uint8)
    dst = np.zeros_like(src)
    srcs = [memoryview(src[i * size:(i + 1) * size].data) for i in range(count)]
    dsts = [memoryview(dst[i * size:(i + 1) * size].data) for i in range(count)]
    put = _run_for(transport, _requests(store, GrantOp.WRITE, srcs, size), seconds)
    get = _run_for(transport, _requests(store, GrantOp.READ, dsts, size), seconds)
    assert np.array_equal(src, dst), "bytes differ"
    return {"put_gbps": put, "get_gbps": get, "batch": count}


def single_get(store: Store, transport: TcpTransport, size: int, seconds: float) -> dict[str, float]:
    src = memoryview(os.urandom(size))
    dst = memoryview(bytearray(size))
    assert transport.transfer(_requests(store, GrantOp.WRITE, [src], size), Deadline(5)) == [0]
    reqs = _requests(store, GrantOp.READ, [dst], size)
    for _ in range(50):
        transport.transfer(reqs, Deadline(5))
    lat: list[float] = []
    end = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        codes = transport.transfer(reqs, Deadline(5))
        t1 = time.perf_counter()
        assert codes == [0], codes
        lat.append(t1 - t0)
        if t1 >= end:
            break
    assert dst == src
    lat.sort()
    p50 = lat[len(lat) // 2]
    return {"p50_us": p50 * 1e6, "p99_us": lat[int(len(lat) * 0.99)] * 1e6, "gbps_at_p50": size / p50 / 1e9}


def run(seconds: float, connections: int, stripe: int, window: int,
        socket_buffer: int = SOCKET_BUFFER, inflight: int = 2 << 20) -> dict[str, Any]:
    store = start_store(socket_buffer=socket_buffer)
    transport = TcpTransport(connections_per_endpoint=connections, stripe_bytes=stripe, window=window,
                             socket_buffer=socket_buffer, inflight_bytes=inflight)
    try:
        result: dict[str, Any] = {"config": {"connections": connections, "stripe_bytes": stripe,
                                             "window": window, "socket_buffer": socket_buffer,
                                             "inflight_bytes": inflight}}
        for size in (1 << 20, 4 << 20):
            result[f"batch_{size >> 20}MiB"] = batched(store, transport, size, seconds)
        result["single_64KiB_get"] = single_get(store, transport, 64 << 10, seconds)
    finally:
        transport.close()
        store.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description="kvpool TCP data-path quick benchmark")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--stripe", type=int, default=1 << 20)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--sockbuf", type=int, default=SOCKET_BUFFER)
    parser.add_argument("--inflight", type=int, default=2 << 20)
    parser.add_argument("--no-ceiling", action="store_true")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.sockbuf)
        return 0
    result = run(args.seconds, args.connections, args.stripe, args.window, args.sockbuf, args.inflight)
    if not args.no_ceiling:
        ceilings = {size: measure_tcp(size, args.seconds) for size in (64 << 10, 1 << 20, 4 << 20)}
        result["ceiling"] = {f"{s >> 10}KiB": {"gbps": c.gbps, "p50_us": c.p50_us}
                             for s, c in ceilings.items()}
        for size in (1 << 20, 4 << 20):
            b = result[f"batch_{size >> 20}MiB"]
            b["put_ratio"] = b["put_gbps"] / ceilings[size].gbps
            b["get_ratio"] = b["get_gbps"] / ceilings[size].gbps
        single = result["single_64KiB_get"]
        single["ratio_to_raw_64KiB"] = single["gbps_at_p50"] / ceilings[64 << 10].gbps
    if args.json:
        print(json.dumps(result, default=lambda x: round(x, 3) if isinstance(x, float) else x))
    else:
        for name, value in result.items():
            print(f"{name}: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in value.items()) if isinstance(value, dict) else value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
