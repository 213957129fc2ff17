"""``kvpool master --kv-events``: pages stored and removed in the pool arrive as SGLang KV events.

A real master publishes; the test subscribes with ZMQ and decodes every batch with SGLang 0.5.23's own
``KVEventBatch`` msgspec decoder (sglang/srt/disaggregation/kv_events.py), so a field or tag SGLang's
consumers would not accept fails here. Needs pyzmq, msgspec and sglang (scripts/install-conformance-deps.sh):
skipped without them, failed under CI.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvpool.common.keys import Namespace, page_keys
from kvpool.tools.local_cluster import LocalCluster
from tests.conformance.sglang_shim import install_light_sglang, require
from tests.support.cluster import client

pytestmark = [pytest.mark.conformance, pytest.mark.integration]

PAGE = 16


@pytest.fixture(scope="module")
def sgl() -> SimpleNamespace:
    require("zmq", "msgspec", "sglang")
    install_light_sglang()
    import msgspec
    import zmq
    from sglang.srt.disaggregation.kv_events import (  # type: ignore[import-untyped]
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        StorageMedium,
    )
    from sglang.srt.mem_cache.utils import hash_str_to_int64  # type: ignore[import-untyped]

    return SimpleNamespace(
        zmq=zmq,
        decoder=msgspec.msgpack.Decoder(type=KVEventBatch),
        Stored=BlockStored,
        Removed=BlockRemoved,
        Cleared=AllBlocksCleared,
        EXTERNAL=StorageMedium.EXTERNAL.value,
        hash64=hash_str_to_int64,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def events_cluster(
    sgl: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalCluster, str]]:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    c = LocalCluster(
        stores=1,
        store_size="16MiB",
        base_dir=tmp_path_factory.mktemp("kv-events"),
        master_args=("--kv-events", endpoint, "--kv-events-page-size", str(PAGE)),
    )
    try:
        yield c.start(), endpoint
    finally:
        c.stop()


class Subscriber:
    """A ZMQ SUB decoding each batch with SGLang's decoder; ``until`` waits on a condition with a deadline."""

    def __init__(self, sgl: SimpleNamespace, endpoint: str) -> None:
        self.sgl = sgl
        self.sock = sgl.zmq.Context.instance().socket(sgl.zmq.SUB)
        self.sock.setsockopt(sgl.zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.events: list[Any] = []
        self.seqs: list[int] = []

    def until(self, done: Any, timeout: float = 20.0) -> None:
        end = time.monotonic() + timeout
        while not done():
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"events did not arrive in {timeout} s: {self.events}")
            if self.sock.poll(int(min(left, 0.2) * 1000)):
                _topic, seq, payload = self.sock.recv_multipart()
                self.seqs.append(int.from_bytes(seq, "big"))
                self.events.extend(self.sgl.decoder.decode(payload).events)

    def hashes(self, kind: type) -> set[int]:
        return {h for e in self.events if isinstance(e, kind) for h in e.block_hashes}

    def close(self) -> None:
        self.sock.close(0)


def test_stored_and_removed_pages_arrive_as_sglang_events(sgl: SimpleNamespace, events_cluster: Any) -> None:
    cluster, endpoint = events_cluster
    sub = Subscriber(sgl, endpoint)
    ns = Namespace(model="events-model", tp_rank=0)
    other_rank = Namespace(model="events-model", tp_rank=1)
    pages = page_keys(list(range(4 * PAGE)), PAGE)
    want = {sgl.hash64(p) for p in pages}
    try:
        with client(cluster.master) as pool:
            # A PUB drops what it sends before the subscription is through: put a probe page until
            # its event arrives, so the stream is live before the pages under test are written.
            probe = Namespace(model="probe").object_keys("f" * 64)
            probe_hash = sgl.hash64("f" * 64)
            end = time.monotonic() + 20
            while True:
                pool.batch_remove(probe, force=True)
                assert pool.batch_put(probe, [b"p" * 64] * len(probe)) == [0] * len(probe)
                try:
                    sub.until(lambda: probe_hash in sub.hashes(sgl.Stored), timeout=0.5)
                    break
                except AssertionError:
                    assert time.monotonic() < end, "the subscriber never received the probe"

            keys = [k for p in pages for k in ns.object_keys(p)] + [k for p in pages for k in other_rank.object_keys(p)]
            assert pool.batch_put(keys, [b"x" * 256] * len(keys)) == [0] * len(keys)
            sub.until(lambda: want <= sub.hashes(sgl.Stored))
            stored = [e for e in sub.events if isinstance(e, sgl.Stored) and set(e.block_hashes) & want]
            assert all(e.medium == sgl.EXTERNAL for e in stored)
            assert all(e.block_size == PAGE for e in stored)
            # One event per page, not one per object: rank 1 and the V halves stand behind rank 0's K.
            assert sorted(h for e in stored for h in e.block_hashes) == sorted(want)

            assert pool.batch_remove(ns.object_keys(pages[2]), force=True) == [0, 0]
            sub.until(lambda: sgl.hash64(pages[2]) in sub.hashes(sgl.Removed))
            removed = [e for e in sub.events if isinstance(e, sgl.Removed)]
            assert all(e.medium == sgl.EXTERNAL for e in removed)
            assert sub.hashes(sgl.Removed) & want == {sgl.hash64(pages[2])}
        assert sub.seqs == sorted(sub.seqs)
    finally:
        sub.close()


def test_a_full_queue_drops_counts_and_then_clears(sgl: SimpleNamespace) -> None:
    from kvpool.master.kv_events import KvEventPublisher, KvEventsConfig

    ns = Namespace(model="m")
    pub = KvEventPublisher(KvEventsConfig(f"tcp://127.0.0.1:{_free_port()}", queue_calls=2, flush_s=0.01))
    # Not started: nothing drains the queue, as with a publisher that cannot keep up.
    start = time.monotonic()
    for i in range(1000):
        pub.record(ns.object_keys(f"{i:064x}"), ())
    assert time.monotonic() - start < 1.0  # the master's side never waits
    assert pub.dropped_keys == 998 * 2
    events = pub._collect()
    assert isinstance(events[0], dict)
    assert events[0]["type"] == "AllBlocksCleared"  # subscribers are told to forget what they missed
    assert [e["type"] for e in events[1:]] == ["BlockStored"]
    assert events[1]["block_hashes"] == [sgl.hash64(f"{i:064x}") for i in range(2)]


@pytest.mark.parametrize(
    ("key", "page"),
    [
        ("tag_model_" + "a" * 64 + "_0_k", "a" * 64),  # MHA, TP rank 0
        ("tag_model_" + "a" * 64 + "_1_k", None),  # another rank: the same page
        ("tag_model_" + "a" * 64 + "_0_v", None),  # the V half
        ("model_" + "b" * 64 + "__k", "b" * 64),  # MLA
        ("model_" + "c" * 64 + "_0_0_k", "c" * 64),  # MHA with PP
        ("model_" + "c" * 64 + "_0_1_k", None),  # PP rank 1
        ("vllm-m-tp0of1-pp0of1_" + "d" * 64 + "_ok", "d" * 64),  # vLLM connector marker
        ("plain-key", None),
        ("model_short_0_k", None),
    ],
)
def test_which_keys_stand_for_a_page(key: str, page: str | None) -> None:
    from kvpool.master.kv_events import page_hash_of

    assert page_hash_of(key) == page
