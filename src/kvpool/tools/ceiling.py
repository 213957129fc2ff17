"""This machine's ceilings: raw loopback TCP between two Python processes, and memcpy.

The data-plane targets are ratios to these numbers (kvpool's transport must reach >= 0.8x the raw TCP
ceiling for 1 MiB and 4 MiB values), so the ceiling is measured the way a careful hand-written Python
client/server would do it, with no kvpool code: one connection, preallocated buffers, TCP_NODELAY, large
socket buffers, a synchronous framed request/response (8-byte request naming the size, the server answers
with ``sendall`` from a preallocated buffer, the client ``recv_into``s a preallocated buffer).

Usage::

    python benchmarks/ceiling.py --json            # all sizes + memcpy, one JSON object
    from kvpool.tools.ceiling import measure_tcp_ceiling, measure_memcpy
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvpool.tools.argtypes import positive_float
from kvpool.transfer.memcopy import page_aligned

SIZES = (64 * 1024, 1 << 20, 4 << 20)
SPREAD_BYTES = 32 << 20
"""Destination span of the spread ceiling: the size of the peer benchmark's registered buffers."""
SOCKET_BUFFER = 4 << 20
_REQ = struct.Struct("<Q")


@dataclass(frozen=True)
class TcpResult:
    size: int
    gbps: float
    p50_us: float
    requests: int


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view, len(view), socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError("peer closed")
        view = view[n:]


def prefaulted(size: int, fill: bytes = b"\0") -> memoryview:
    """A ``size``-byte page-aligned buffer (``memcopy.page_aligned``), every page faulted in (filled with
    ``fill`` repeated).

    The ceiling's buffers start on a page boundary, as a careful client's do: the kernel's copy of socket
    data into user memory runs 2-3x slower on some CPUs (AMD Zen: ``rep movsb``) when the destination is
    1-63 bytes past the source modulo 4 KiB. A large ``bytearray`` starts 16 bytes into its page (glibc's
    chunk header), which would hand the ceiling that slow copy: docs/benchmarks.md, "A copy that depends
    on where the buffer starts".
    """
    buf = page_aligned(size)
    buf[:] = (fill * (size // len(fill) + 1))[:size]
    return buf


def _serve(max_size: int) -> None:
    """Server process: answer each 8-byte request (a size) with that many bytes; size 0 ends."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
    listener.close()
    _tune(conn)
    payload = prefaulted(max_size, os.urandom(1024))
    req = bytearray(_REQ.size)
    with conn:
        while True:
            try:
                _recv_exact(conn, memoryview(req))
            except ConnectionError:
                return
            (size,) = _REQ.unpack(req)
            if size == 0:
                return
            conn.sendall(payload[:size])


class RawTcpPeer:
    """A raw server process and one tuned connection to it; ``measure`` can be called many times (so other
    benchmarks can interleave ceiling slices with their own, and compare under the same machine load)."""

    def __init__(self, max_size: int = max(SIZES)) -> None:
        self.max_size = max_size
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.tools.ceiling", "--serve", str(max_size)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        port = int(self._proc.stdout.readline())
        self._sock = socket.create_connection(("127.0.0.1", port))
        _tune(self._sock)
        self._dest = prefaulted(max_size)
        self._spread: memoryview | None = None

    @property
    def server_pid(self) -> int:
        """The raw server process (benchmarks that count CPU time count it with the caller's)."""
        return self._proc.pid

    def measure(self, size: int, seconds: float, spread: bool = False) -> TcpResult:
        """Synchronous ``size``-byte responses for about ``seconds``: GB/s and p50 latency.

        By default every response lands in the same page-aligned buffer, which stays hot in the TLB and
        the caches.
        ``spread`` lands them in successive slices of a 32 MiB shared anonymous mapping (4 KiB pages, as
        the peer benchmark's buffers are), the destination a system's batched get writes into.
        """
        if not 0 < size <= self.max_size:
            raise ValueError(f"size must be in (0, {self.max_size}]")
        sock, request = self._sock, _REQ.pack(size)
        dests = [self._dest[:size]]
        if spread:
            if self._spread is None:
                self._spread = prefaulted(SPREAD_BYTES, b"\1")
            view = self._spread
            dests = [view[off : off + size] for off in range(0, SPREAD_BYTES - size + 1, size)]
        for i in range(max(5, len(dests))):  # warm up: TCP window growth, page faults of the destination
            sock.sendall(request)
            _recv_exact(sock, dests[i % len(dests)])
        latencies: list[float] = []
        start = now = time.perf_counter()
        end = start + seconds
        i = 0
        while now < end:
            sock.sendall(request)
            _recv_exact(sock, dests[i % len(dests)])
            i += 1
            after = time.perf_counter()
            latencies.append(after - now)
            now = after
        latencies.sort()
        return TcpResult(
            size,
            len(latencies) * size / (now - start) / 1e9,
            latencies[len(latencies) // 2] * 1e6,
            len(latencies),
        )

    def close(self) -> None:
        try:
            self._sock.sendall(_REQ.pack(0))
            self._sock.close()
        finally:
            self._proc.wait(timeout=10)
            if self._proc.stdout is not None:
                self._proc.stdout.close()

    def __enter__(self) -> RawTcpPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def measure_tcp(size: int, seconds: float = 2.0, spread: bool = False) -> TcpResult:
    """Throughput and p50 latency of synchronous ``size``-byte responses over one loopback connection
    (``spread``: landing across a 32 MiB 4 KiB-page buffer, see ``RawTcpPeer.measure``)."""
    with RawTcpPeer(size) as peer:
        return peer.measure(size, seconds, spread)


def measure_tcp_ceiling(size: int, seconds: float = 2.0) -> float:
    """Raw loopback TCP GB/s (1e9 bytes/s) for ``size``-byte synchronous responses."""
    return measure_tcp(size, seconds).gbps


def measure_tcp_spread_ceiling(size: int, seconds: float = 2.0) -> float:
    """The same, with responses landing across a 32 MiB 4 KiB-page buffer (``RawTcpPeer.measure``)."""
    return measure_tcp(size, seconds, spread=True).gbps


def measure_memcpy(size: int = 64 << 20, repeats: int = 20) -> float:
    """numpy memcpy GB/s of ``size`` bytes (best of ``repeats``, pages already faulted)."""
    src = np.frombuffer(os.urandom(1 << 20), dtype=np.uint8)
    src = np.tile(src, max(1, size >> 20))[:size]
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return size / best / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seconds", type=positive_float, default=2.0, help="seconds per TCP size")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        _serve(args.serve)
        return 0
    tcp = [measure_tcp(size, args.seconds) for size in SIZES]
    with RawTcpPeer() as peer:
        spread = [peer.measure(size, args.seconds, spread=True) for size in SIZES[1:]]
    memcpy = measure_memcpy()
    if args.json:
        print(
            json.dumps(
                {
                    "tcp": [asdict(r) for r in tcp],
                    "tcp_spread": [asdict(r) for r in spread],
                    "memcpy_gbps": round(memcpy, 3),
                }
            )
        )
    else:
        for r in tcp:
            print(f"tcp {r.size:>9} B: {r.gbps:6.2f} GB/s  p50 {r.p50_us:8.1f} us  ({r.requests} requests)")
        for r in spread:
            print(f"tcp {r.size:>9} B into a 32 MiB 4 KiB-page buffer: {r.gbps:6.2f} GB/s  p50 {r.p50_us:8.1f} us")
        print(f"memcpy 64 MiB: {memcpy:6.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
