"""Posting cost of the RDMA client (decisions 0021, 0027): client CPU microseconds per work request, with the
FAKE NIC's checks and copies taken out, for a HiCache-like batch (128 pages of 64 KiB), posted three ways,
interleaved round by round so machine load hits them alike: one work request at a time and as chained lists
from Python (the FAKE NIC's Python posting), and through the compiled verbs layer (kvpool.transfer._verbs:
the chain built in C and posted through ibv_post_send into the fake provider; skipped where not built). Where
Debian's pyverbs imports, also what building a pyverbs SendWR costs against refilling a reused one.

    PYTHONPATH=src:. python benchmarks/rdma_post_cost.py [--rounds 5] [--batches 20] [--json] [--cross-process]

``--cross-process`` adds the same comparison against a real store process over the cross-process FAKE NIC
(``KVPOOL_VERBS=fake``): a client's ``batch_get_into`` of 128 registered 64 KiB pages, posted natively and
from Python.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from kvpool.common.clock import Deadline
from kvpool.common.grants import GrantOp, new_secret, sign
from kvpool.transfer.base import Replica, TransferRequest
from kvpool.transfer.rdma import RdmaResponder, RdmaTransport
from kvpool.transfer.verbs import Opcode, WorkRequest
from kvpool.transfer.verbs_fake import FakeFabric, FakeVerbs
from kvpool.transfer.verbs_native import native_built

PAGE = 64 << 10
PAGES = 128
SEG_ID = 0xB0B
FAR_FUTURE_MS = 4_000_000_000_000


def _post_us(chained: bool, batches: int, native: bool = False) -> float:
    """post_us_per_wr of a fresh transport moving ``batches`` batches of 128 x 64 KiB READs."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from tests.support.rdma_rig import ControlServer, _Segment

    fabric = FakeFabric()
    segment = _Segment(PAGES * PAGE)
    secret = new_secret()
    store_verbs = FakeVerbs(fabric, devices=("fake_store",), native=native)
    responder = RdmaResponder(store_verbs, {SEG_ID: segment}, {SEG_ID: secret})
    server = ControlServer(responder)
    transport = RdmaTransport(FakeVerbs(fabric, devices=("fake_client",), native=native), send_queue_depth=PAGES)
    transport.note_store_info(server.endpoint, {"rdma": responder.advertisement()})
    buf = bytearray(PAGES * PAGE)
    view = memoryview(buf)
    transport.register_memory(view)
    requests = []
    for i in range(PAGES):
        key = b"p%d" % i
        mac = sign(secret, GrantOp.READ, SEG_ID, i * PAGE, PAGE, FAR_FUTURE_MS, key)
        replica = Replica(SEG_ID, "n", server.endpoint, "", i * PAGE, PAGE, FAR_FUTURE_MS, mac)
        requests.append(TransferRequest(GrantOp.READ, key, replica, view[i * PAGE : (i + 1) * PAGE]))
    try:
        assert transport.transfer(requests[:1], Deadline(10)) == [0]  # connect outside the figure
        for conn in transport._all_connections:  # noqa: SLF001 - the benchmark switches the posting mode
            conn.chained = chained
            conn.post_seconds, conn.work_requests = 0.0, 0
        fabric.nic_seconds = 0.0
        for _ in range(batches):
            assert transport.transfer(requests, Deadline(30)) == [0] * PAGES
        figure = transport.post_us_per_wr()
        assert figure is not None
        return figure
    finally:
        transport.close()
        server.close()
        responder.close()
        segment.close()


def _ipc_post_us(clients: dict[bool, Any], keys: list[str], native: bool, batches: int) -> float:
    """post_us_per_wr of ``batches`` batch_get_into of 128 x 64 KiB from a real store process over the
    cross-process FAKE NIC, by the client posting natively or from Python."""
    client, views = clients[native]
    rdma = client._transports.transport("rdma")  # noqa: SLF001 - the benchmark reads the transport's figure
    assert client.batch_get_into(keys, views) == [PAGE] * PAGES  # warm: connected, windows cached
    for conn in rdma._all_connections:  # noqa: SLF001
        conn.post_seconds, conn.work_requests = 0.0, 0
    rdma.nic_fabric().nic_seconds = 0.0
    for _ in range(batches):
        assert client.batch_get_into(keys, views) == [PAGE] * PAGES
    figure = rdma.post_us_per_wr()
    assert figure is not None
    return float(figure)


def _ipc_rounds(rounds: int, batches: int) -> dict[str, Any]:
    """Both posting paths against one real store process (KVPOOL_VERBS=fake), interleaved round by round."""
    import tempfile

    from kvpool.client import ClientConfig, PoolClient
    from kvpool.tools.local_cluster import LocalCluster

    with tempfile.TemporaryDirectory() as state:
        os.environ["KVPOOL_VERBS"] = "fake"
        os.environ["KVPOOL_FAKE_VERBS_DIR"] = state
        cluster = LocalCluster(stores=1, store_size="64MiB").start()
        clients: dict[bool, Any] = {}
        try:
            keys = [f"page-{i}" for i in range(PAGES)]
            for native in (False, True):
                os.environ["KVPOOL_NATIVE_VERBS"] = "1" if native else "0"  # read when the client opens its NIC
                client = PoolClient(config=ClientConfig(master=cluster.master, use_rdma=True, use_shm=False))
                region = bytearray(PAGES * PAGE)
                client.register_buffer(region)
                views = [memoryview(region)[i * PAGE : (i + 1) * PAGE] for i in range(PAGES)]
                clients[native] = (client, views)
            put = clients[False][0].batch_put_from(keys, [os.urandom(PAGE) for _ in range(PAGES)])
            assert put == [0] * PAGES
            python = [0.0] * rounds
            native_figures = [0.0] * rounds
            for n in range(rounds):
                python[n] = _ipc_post_us(clients, keys, False, batches)
                native_figures[n] = _ipc_post_us(clients, keys, True, batches)
        finally:
            for client, _ in clients.values():
                client.close()
            cluster.stop()
    return {
        "chained_post_us_per_wr": statistics.median(python),
        "native_post_us_per_wr": statistics.median(native_figures),
        "ratio_native_to_chained": statistics.median(n / c for n, c in zip(native_figures, python, strict=True)),
        "rounds": {"chained": python, "native": native_figures},
    }


def _pyverbs_us() -> dict[str, float] | None:
    """CPU microseconds to build a pyverbs SendWR+SGE, and to refill a reused one (None without pyverbs)."""
    try:
        from kvpool.transfer.verbs import PvSendChain, pv_send_wr
    except ImportError:
        return None
    try:
        import pyverbs.wr  # noqa: F401
    except ImportError:
        return None
    wrs = [WorkRequest(i, Opcode.RDMA_READ, 0x1000 + i * PAGE, PAGE, 11, 0x2000 + i * PAGE, 22) for i in range(PAGES)]
    n = 50
    started = time.thread_time()
    for _ in range(n):
        for wr in wrs:
            pv_send_wr(wr)
    build = (time.thread_time() - started) / (n * PAGES) * 1e6
    chain = PvSendChain()
    chain.build(wrs)
    started = time.thread_time()
    for _ in range(n):
        chain.build(wrs)
    refill = (time.thread_time() - started) / (n * PAGES) * 1e6
    return {"build_us_per_wr": build, "refill_us_per_wr": refill}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=20, help="batches of 128 x 64 KiB per figure")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--cross-process",
        action="store_true",
        help="also measure against a real store process over the cross-process FAKE NIC (batch_get_into)",
    )
    args = parser.parse_args()
    one: list[float] = []
    chained: list[float] = []
    native: list[float] = []
    for _ in range(args.rounds):
        one.append(_post_us(False, args.batches))
        chained.append(_post_us(True, args.batches))
        if native_built():
            native.append(_post_us(True, args.batches, native=True))
    out: dict[str, Any] = {
        "one_by_one_post_us_per_wr": statistics.median(one),
        "chained_post_us_per_wr": statistics.median(chained),
        "ratio_chained_to_one_by_one": statistics.median(c / o for c, o in zip(chained, one, strict=True)),
        "native_post_us_per_wr": statistics.median(native) if native else None,
        "ratio_native_to_chained": (
            statistics.median(n / c for n, c in zip(native, chained, strict=True)) if native else None
        ),
        "rounds": args.rounds,
        "pyverbs": _pyverbs_us(),
    }
    if args.cross_process and native_built():
        out["cross_process"] = _ipc_rounds(args.rounds, args.batches)
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
