"""Where the CPU goes: kvpool's batched transfers per GB moved against the raw TCP ceiling's, and the
layers of a single 64 KiB get.

    .venv/bin/python benchmarks/cpu_budget.py [--runs 3] [--seconds 2] [--json] [--store-args "..."]

**Batched** (1 MiB and 4 MiB values, 32 MiB a call). For the raw loopback RPC of ``benchmarks/ceiling.py``
(one Python client, one Python server; ``ceiling`` lands every answer in one hot buffer, as the peer
benchmark's ceiling does, ``ceiling_spread`` across a 32 MiB buffer of 4 KiB pages) and for kvpool's
``batch_get_into`` / ``batch_put_from`` (a LocalCluster of one master and one store process, the client in
this process, TCP only), /proc is sampled around the timed calls only. Each row gives GB/s, the cores busy
machine-wide (user + system + irq + softirq, from /proc/stat), the core-seconds spent per GB moved, each
process's cores, and ``cpu_bound_gbps`` = this machine's cores / core-seconds per GB: the rate the same work
could reach if every core did nothing else. kvpool's ``cpu_bound_gbps`` divided by the ceiling's *measured*
GB/s is the most kvpool could reach against that ceiling on this machine at its present cost per byte.

**Single 64 KiB gets**, one at a time, p50 and mean of four layers, each adding one part:

1. ``raw_rpc``: the ceiling's raw Python RPC;
2. ``bare_frames``: READ frames written by hand against kvpool's store data plane (a store process of
   ``benchmarks/dataplane_quick.py``, whose harness signs the grants), so the store's Python is added;
3. ``transport``: kvpool's ``TcpTransport`` against the same store;
4. ``pool_client``: ``PoolClient.get_into`` of keys whose read leases it holds, in the LocalCluster.

The differences between neighbouring layers are the costs of the store's, the transport's and the
client's code. Every figure is a median over ``--runs`` rounds; the systems alternate within a round.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from benchmarks.dataplane_quick import Store, call_latencies, start_store  # noqa: E402
from kvpool.client import ClientConfig, PoolClient  # noqa: E402
from kvpool.common.checksum import checksum  # noqa: E402
from kvpool.common.clock import Deadline  # noqa: E402
from kvpool.common.grants import GrantOp  # noqa: E402
from kvpool.proto.frames import DESC, HEADER, HEADER_SIZE, MAGIC, Op  # noqa: E402
from kvpool.store.config import StoreConfig  # noqa: E402
from kvpool.tools.argtypes import positive_float, positive_int  # noqa: E402
from kvpool.tools.ceiling import RawTcpPeer  # noqa: E402
from kvpool.tools.local_cluster import LocalCluster  # noqa: E402
from kvpool.transfer.base import TransferRequest  # noqa: E402
from kvpool.transfer.tcp import TcpTransport, recv_all_into, tune_socket  # noqa: E402

CALL_BYTES = 32 << 20
SIZES = (1 << 20, 4 << 20)
SINGLE = 64 << 10
SINGLE_KEYS = 256
GET_DATASET_CALLS = 4  # each size's get data set: 4 calls' worth (128 MiB), read in turn
PUT_BLOCK_CALLS = 8  # puts are removed every 8 calls (256 MiB), off the clock
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_NCPU = os.cpu_count() or 1


# ---------------------------------------------------------------------- CPU accounting
def _machine_busy_s() -> float:
    """Busy CPU-seconds of the whole machine so far: user + nice + system + irq + softirq."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / _CLK_TCK


def _process_cpu_s(pid: int) -> float:
    """User + system CPU-seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


@dataclass
class CpuMeter:
    """Sums CPU time over the timed blocks only (``with meter.timing():``)."""

    pids: dict[str, int]
    seconds: float = 0.0
    machine_s: float = 0.0
    process_s: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def timing(self) -> Iterator[None]:
        machine, procs, started = (
            _machine_busy_s(),
            {n: _process_cpu_s(p) for n, p in self.pids.items()},
            time.perf_counter(),
        )
        yield
        self.seconds += time.perf_counter() - started
        self.machine_s += _machine_busy_s() - machine
        for name, pid in self.pids.items():
            self.process_s[name] = self.process_s.get(name, 0.0) + _process_cpu_s(pid) - procs[name]


@dataclass
class BatchedRow:
    system: str  # "kvpool" | "ceiling" | "ceiling_spread"
    op: str
    size: int
    gbps: float
    busy_cores: float
    core_s_per_gb: float
    cpu_bound_gbps: float
    process_cores: dict[str, float]


def _row(system: str, op: str, size: int, moved: int, meter: CpuMeter) -> BatchedRow:
    gb = moved / 1e9
    per_gb = meter.machine_s / gb if gb else 0.0
    return BatchedRow(
        system,
        op,
        size,
        gb / meter.seconds if meter.seconds else 0.0,
        meter.machine_s / meter.seconds if meter.seconds else 0.0,
        per_gb,
        _NCPU / per_gb if per_gb else 0.0,
        {name: s / meter.seconds for name, s in meter.process_s.items()} if meter.seconds else {},
    )


# ---------------------------------------------------------------------- batched transfers
def measure_ceiling(peer: RawTcpPeer, size: int, seconds: float, spread: bool = False) -> BatchedRow:
    """The raw RPC into one hot buffer ("ceiling", what the acceptance lines divide by) or, ``spread``,
    across a 32 MiB buffer of 4 KiB pages as a batched get lands ("ceiling_spread", for information)."""
    meter = CpuMeter({"client": os.getpid(), "server": peer.server_pid})
    with meter.timing():
        result = peer.measure(size, seconds, spread)
    return _row("ceiling_spread" if spread else "ceiling", "get", size, int(result.gbps * 1e9 * meter.seconds), meter)


class KvpoolBatched:
    """kvpool's batched get and put through one PoolClient, from and into 32 MiB mappings."""

    def __init__(self, cluster: LocalCluster, client: PoolClient) -> None:
        self.client = client
        self.pids = {"client": os.getpid(), "store": cluster.stores[0].pid, "master": cluster.masters[0].pid}
        self._src = mmap.mmap(-1, CALL_BYTES)
        self._src.write(os.urandom(1 << 20) * (CALL_BYTES >> 20))
        self._dst = mmap.mmap(-1, CALL_BYTES)
        self._dst.write(b"\0" * CALL_BYTES)  # fault every page in before any timing
        self._puts = 0
        self._src_views = {size: self._views(self._src, size) for size in SIZES}
        self._dst_views = {size: self._views(self._dst, size) for size in SIZES}
        self._get_keys = {size: [self._keys("get", size, call) for call in range(GET_DATASET_CALLS)] for size in SIZES}
        for size, calls in self._get_keys.items():
            for keys in calls:
                self._put(keys, size)

    def _views(self, buf: mmap.mmap, size: int) -> list[memoryview]:
        view = memoryview(buf)
        return [view[off : off + size] for off in range(0, CALL_BYTES, size)]

    @staticmethod
    def _keys(kind: str, size: int, call: int) -> list[str]:
        return [f"cpu-{kind}-{size}-{call}-{i}" for i in range(CALL_BYTES // size)]

    def _put(self, keys: list[str], size: int) -> None:
        codes = self.client.batch_put_from(keys, self._src_views[size])
        if any(codes):
            raise RuntimeError(f"batched put failed: {sorted(set(codes))}")

    def measure(self, op: str, size: int, seconds: float) -> BatchedRow:
        meter = CpuMeter(self.pids)
        moved = 0
        dst = self._dst_views[size]
        while meter.seconds < seconds:
            if op == "get":
                with meter.timing():
                    for keys in self._get_keys[size]:
                        codes = self.client.batch_get_into(keys, dst)
                        if any(c != size for c in codes):
                            raise RuntimeError(f"batched get failed: {sorted(set(codes))}")
                moved += GET_DATASET_CALLS * CALL_BYTES
                continue
            written = [self._keys(f"put{self._puts}", size, call) for call in range(PUT_BLOCK_CALLS)]
            self._puts += 1
            with meter.timing():
                for keys in written:
                    self._put(keys, size)
            moved += PUT_BLOCK_CALLS * CALL_BYTES
            self.client.batch_remove([k for keys in written for k in keys], force=True)
        return _row("kvpool", op, size, moved, meter)


# ---------------------------------------------------------------------- single gets
@dataclass
class LayerRow:
    layer: str
    p50_us: float
    mean_us: float


def _latency(call: Callable[[int], None], seconds: float) -> tuple[float, float]:
    """(p50, mean) microseconds of ``call(i)`` repeated for about ``seconds`` after a short warm-up."""
    for i in range(200):
        call(i)
    latencies = call_latencies(call, seconds)
    return statistics.median(latencies) * 1e6, statistics.fmean(latencies) * 1e6


class BareFrames:
    """Single READs written by hand: one header + descriptor out, one header + value back."""

    def __init__(self, store: Store) -> None:
        host, port = store.endpoint.rsplit(":", 1)
        self._sock = socket.create_connection((host, int(port)))
        tune_socket(self._sock)
        self._header = memoryview(bytearray(HEADER_SIZE))
        self._value = memoryview(bytearray(SINGLE))
        self._frames = []
        for i in range(SINGLE_KEYS):
            key = b"cpu-single-%d" % i
            r = store.replica(GrantOp.READ, key, i * SINGLE, SINGLE)
            desc = DESC.pack(r.segment_id, r.offset, r.length, r.expiry_ms, 0, 0, SINGLE, len(key), r.mac)
            self._frames.append(HEADER.pack(MAGIC, Op.READ, 0, 0, i, DESC.size + len(key)) + desc + key)

    def get(self, i: int) -> None:
        self._sock.sendall(self._frames[i % SINGLE_KEYS])
        recv_all_into(self._sock, self._header)
        _magic, _op, _flags, status, _req_id, length = HEADER.unpack(self._header)
        if status or length != SINGLE:
            raise RuntimeError(f"bare READ answered status {status}, {length} bytes")
        recv_all_into(self._sock, self._value)

    def close(self) -> None:
        self._sock.close()


class TransportGets:
    """Single READs through kvpool's TcpTransport, checksum-verified as PoolClient asks (the store's
    segment is zero-filled, so every value's checksum is that of 64 KiB of zeros)."""

    def __init__(self, store: Store, spin_us: int) -> None:
        self._transport = TcpTransport(spin_us=spin_us)
        self._buf = memoryview(bytearray(SINGLE))
        zeros = checksum(bytes(SINGLE))
        self._requests = [
            TransferRequest(
                GrantOp.READ,
                b"cpu-single-%d" % i,
                store.replica(GrantOp.READ, b"cpu-single-%d" % i, i * SINGLE, SINGLE),
                self._buf,
                zeros,
                verify=True,
            )
            for i in range(SINGLE_KEYS)
        ]

    def get(self, i: int) -> None:
        code = self._transport.transfer([self._requests[i % SINGLE_KEYS]], Deadline(10))[0]
        if code:
            raise RuntimeError(f"transport READ failed: {code!r}")

    def close(self) -> None:
        self._transport.close()


class ClientGets:
    """Single ``PoolClient.get_into`` calls of keys it wrote (and so holds read leases for)."""

    def __init__(self, client: PoolClient) -> None:
        self._client = client
        self._buf = memoryview(bytearray(SINGLE))
        self._keys = [f"cpu-single-{i}" for i in range(SINGLE_KEYS)]
        value = os.urandom(SINGLE)
        for key in self._keys:
            if client.put(key, value):
                raise RuntimeError("single put failed")

    def get(self, i: int) -> None:
        got = self._client.get_into(self._keys[i % SINGLE_KEYS], self._buf)
        if got != SINGLE:
            raise RuntimeError(f"get_into returned {got}")


# ---------------------------------------------------------------------- the run
def run(runs: int, seconds: float, store_args: tuple[str, ...], progress: Callable[[str], None]) -> dict[str, object]:
    batched: dict[tuple[str, str, int], list[BatchedRow]] = {}
    layers: dict[str, list[tuple[float, float]]] = {}
    with ExitStack() as stack:
        cluster = LocalCluster(stores=1, store_size="1GiB", store_args=store_args).start()
        stack.callback(cluster.stop)
        store = start_store(SINGLE * SINGLE_KEYS, spin_us=StoreConfig().spin_us)
        stack.callback(store.close)
        config = ClientConfig(master=cluster.master, use_shm=False)
        client = stack.enter_context(PoolClient(config=config))
        peer = stack.enter_context(RawTcpPeer())
        kvpool = KvpoolBatched(cluster, client)  # its mappings go with the process (the client holds views)
        bare = BareFrames(store)
        stack.callback(bare.close)
        transport = TransportGets(store, config.spin_us)
        stack.callback(transport.close)
        gets = ClientGets(client)
        for round_no in range(runs):
            progress(f"round {round_no + 1}/{runs}: batched")
            for size in SIZES:
                for op in ("get", "put"):
                    systems = ["kvpool", "ceiling", "ceiling_spread"] if op == "get" else ["kvpool"]
                    for system in systems if round_no % 2 == 0 else reversed(systems):  # who goes first alternates
                        if system == "kvpool":
                            row = kvpool.measure(op, size, seconds)
                        else:
                            row = measure_ceiling(peer, size, seconds, spread=system == "ceiling_spread")
                        batched.setdefault((row.system, row.op, row.size), []).append(row)
            progress(f"round {round_no + 1}/{runs}: single gets")
            raw = peer.measure(SINGLE, seconds)
            layers.setdefault("raw_rpc", []).append((raw.p50_us, SINGLE / raw.gbps / 1e3))
            for name, call in (("bare_frames", bare.get), ("transport", transport.get), ("pool_client", gets.get)):
                layers.setdefault(name, []).append(_latency(call, seconds))
    return _summary(batched, layers, runs, store_args)


def _median_row(rows: list[BatchedRow]) -> BatchedRow:
    names = rows[0].process_cores.keys()
    return BatchedRow(
        rows[0].system,
        rows[0].op,
        rows[0].size,
        statistics.median(r.gbps for r in rows),
        statistics.median(r.busy_cores for r in rows),
        statistics.median(r.core_s_per_gb for r in rows),
        statistics.median(r.cpu_bound_gbps for r in rows),
        {n: statistics.median(r.process_cores[n] for r in rows) for n in names},
    )


def _summary(
    batched: dict[tuple[str, str, int], list[BatchedRow]],
    layers: dict[str, list[tuple[float, float]]],
    runs: int,
    store_args: tuple[str, ...],
) -> dict[str, object]:
    rows = {k: _median_row(v) for k, v in batched.items()}
    bounds = {}
    for size in SIZES:
        ceiling = rows[("ceiling", "get", size)]
        for op in ("get", "put"):
            kv = rows[("kvpool", op, size)]
            bounds[f"{op}_{size >> 20}MiB"] = {
                "kvpool_vs_ceiling": kv.gbps / ceiling.gbps,
                "kvpool_cpu_bound_vs_ceiling": kv.cpu_bound_gbps / ceiling.gbps,
                "kvpool_core_s_per_gb_vs_ceiling": kv.core_s_per_gb / ceiling.core_s_per_gb,
            }
    single = [
        LayerRow(name, statistics.median(p for p, _ in values), statistics.median(m for _, m in values))
        for name, values in layers.items()
    ]
    return {
        "ncpu": _NCPU,
        "runs": runs,
        "store_args": list(store_args),
        "batched": [asdict(r) for r in rows.values()],
        "bounds": bounds,
        "single_get_64KiB": [asdict(r) for r in single],
    }


def _print_table(doc: dict[str, object]) -> None:
    print(f"{doc['ncpu']} cores; medians of {doc['runs']} rounds")
    head = f"{'system':<8} {'op':<4} {'size':>5} {'GB/s':>6} {'cores':>6} {'core-s/GB':>10} {'cpu-bound GB/s':>15}"
    print(head + "  cores by process")
    for r in doc["batched"]:  # type: ignore[attr-defined]
        procs = " ".join(f"{n} {c:.2f}" for n, c in r["process_cores"].items())
        print(
            f"{r['system']:<8} {r['op']:<4} {r['size'] >> 20:>3}Mi {r['gbps']:6.2f} {r['busy_cores']:6.2f} "
            f"{r['core_s_per_gb']:10.3f} {r['cpu_bound_gbps']:15.2f}  {procs}"
        )
    print("against the ceiling's measured GB/s: kvpool measured / kvpool cpu-bound / kvpool core-s per GB")
    for name, b in doc["bounds"].items():  # type: ignore[attr-defined]
        print(
            f"  {name:<8} {b['kvpool_vs_ceiling']:.2f}x / {b['kvpool_cpu_bound_vs_ceiling']:.2f}x / "
            f"{b['kvpool_core_s_per_gb_vs_ceiling']:.2f}x"
        )
    print("single 64 KiB get, one at a time: p50 / mean us (and the step from the layer above)")
    previous = None
    for r in doc["single_get_64KiB"]:  # type: ignore[attr-defined]
        step = f"  (+{r['p50_us'] - previous:.0f} us)" if previous is not None else ""
        print(f"  {r['layer']:<12} {r['p50_us']:7.1f} / {r['mean_us']:7.1f}{step}")
        previous = r["p50_us"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=positive_int, default=3, help="rounds; every figure is the median over them")
    parser.add_argument("--seconds", type=positive_float, default=2.0, help="timed seconds per figure per round")
    parser.add_argument(
        "--store-args",
        default="",
        help='extra arguments of the kvpool store, e.g. "--hugepages 2M --shm-dir /mnt/huge"',
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.seconds <= 0:
        parser.error("--runs must be >= 1 and --seconds > 0")
    doc = run(args.runs, args.seconds, tuple(args.store_args.split()), lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(doc))
    else:
        _print_table(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
