"""Several NICs with the in-process FAKE NIC (decision 0022): a large request is cut across every rail, a
small one stays on the rail whose device sits on the buffer's NUMA node, and a striped write is RECORDed once
after all its parts landed."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode
from kvpool.common.grants import GrantOp
from kvpool.transfer.rdma import RdmaResponder, RdmaTransport
from kvpool.transfer.rdma_rails import RailsTransport, RdmaResponders, buffer_numa_node, stripe_parts
from kvpool.transfer.verbs import buffer_address
from kvpool.transfer.verbs_fake import FakeFabric, FakeVerbs
from tests.support.rdma_rig import SEG_ID, ControlServer, Rig, _Segment

MiB = 1 << 20


def test_stripe_parts_cut_large_requests_only() -> None:
    assert stripe_parts(MiB - 1, 2, MiB) == [(0, MiB - 1)]
    assert stripe_parts(4 * MiB, 1, MiB) == [(0, 4 * MiB)]
    assert stripe_parts(4 * MiB, 2, MiB) == [(0, 2 * MiB), (2 * MiB, 2 * MiB)]
    odd = stripe_parts(3 * MiB + 5, 3, MiB)
    assert [o for o, _ in odd] == [0, MiB + 4096, 2 * MiB + 8192]
    assert sum(n for _, n in odd) == 3 * MiB + 5
    assert all(o % 4096 == 0 for o, _ in odd)


def test_the_kernel_names_the_node_of_a_buffer() -> None:
    buf = bytearray(8192)
    nodes = sorted(int(n[4:]) for n in os.listdir("/sys/devices/system/node") if n[4:].isdigit())
    assert buffer_numa_node(buffer_address(memoryview(buf))) in nodes


class _Rails:
    def __init__(self, node_of_buffers: int) -> None:
        self.fabric = FakeFabric()
        devices = ("fake_nic_a", "fake_nic_b")
        client_verbs = FakeVerbs(self.fabric, devices=devices, numa_nodes={"fake_nic_a": 1, "fake_nic_b": 0})
        store_verbs = FakeVerbs(self.fabric, devices=("fake_store_a", "fake_store_b"))
        self.segment = _Segment(16 * MiB)
        secret = b"s" * 32
        self.responders = [
            RdmaResponder(store_verbs, {SEG_ID: self.segment}, {SEG_ID: secret}, device=d) for d in store_verbs.devices
        ]
        self.server = ControlServer(RdmaResponders(self.responders))  # type: ignore[arg-type]
        rails = [RdmaTransport(client_verbs, d, rail=i) for i, d in enumerate(devices)]
        self.transport = RailsTransport(
            rails, [client_verbs.numa_node(d) for d in devices], stripe_bytes=MiB, node_of=lambda _: node_of_buffers
        )
        self.transport.note_store_info(self.server.endpoint, {"rdma": self.server.responder.advertisement()})  # type: ignore[union-attr]
        self.rig = Rig(
            self.fabric, client_verbs, store_verbs, self.segment, secret, self.responders[0], self.server, rails[0]
        )

    def per_rail_bytes(self) -> list[int]:
        return [rail.stats.bytes_submitted for rail in self.transport.rails]

    def close(self) -> None:
        self.transport.close()
        self.server.close()
        for responder in self.responders:
            responder.close()
        self.segment.close()


@pytest.fixture
def rails() -> Iterator[_Rails]:
    r = _Rails(node_of_buffers=0)
    yield r
    r.close()


def test_a_large_write_and_read_are_striped_across_both_nics(rails: _Rails) -> None:
    data = os.urandom(4 * MiB + 100)
    write = rails.rig.request(GrantOp.WRITE, b"big", 0, data)
    assert rails.transport.transfer([write], Deadline(10)) == [ErrorCode.OK]
    assert rails.server.records == 1  # one RECORD, after both parts landed
    assert bytes(rails.segment.view[: len(data)]) == data
    back = bytearray(len(data))
    assert rails.transport.transfer([rails.rig.request(GrantOp.READ, b"big", 0, back)], Deadline(10)) == [ErrorCode.OK]
    assert back == data
    half = 2 * MiB + 4096
    assert rails.per_rail_bytes() == [2 * half, 2 * (len(data) - half)]
    # Each client NIC reached the store over its own store NIC.
    assert [r.connections for r in rails.responders] == [1, 1]
    # The posting figure covers both rails, the fake NIC's shared time taken out once (not once per rail).
    seconds = sum(rail.posting_totals()[0] for rail in rails.transport.rails)
    figure = rails.transport.post_us_per_wr()
    assert figure is not None
    assert figure == pytest.approx(max(0.0, seconds - rails.fabric.nic_seconds) / 4 * 1e6)  # 2 rails x 2 ops


def test_a_small_request_stays_on_the_nic_of_its_buffers_numa_node(rails: _Rails) -> None:
    data = os.urandom(64 << 10)
    assert rails.transport.transfer([rails.rig.request(GrantOp.WRITE, b"s", 0, data)], Deadline(10)) == [ErrorCode.OK]
    assert rails.per_rail_bytes() == [0, len(data)]  # fake_nic_b sits on node 0, where the buffer is
    assert [r.connections for r in rails.responders] == [0, 1]


def test_without_a_numa_match_the_first_nic_serves() -> None:
    r = _Rails(node_of_buffers=-1)
    try:
        data = os.urandom(4096)
        assert r.transport.transfer([r.rig.request(GrantOp.WRITE, b"s", 0, data)], Deadline(10)) == [ErrorCode.OK]
        assert r.per_rail_bytes() == [len(data), 0]
    finally:
        r.close()
