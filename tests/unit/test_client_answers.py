"""The client's conversion of the master's lookup answers into plain tuples (built field by field with
tuple.__new__, for speed): the same values as the named tuples' own constructors give."""

from __future__ import annotations

from kvpool.client.call_parts import _Resolved, _resolved
from kvpool.proto import master_pb2 as pb
from kvpool.transfer.base import Replica, replica_of


def test_a_converted_answer_equals_the_one_the_constructors_build() -> None:
    result = pb.GetReplicasResult(code=0, size=65_537, checksum=2**64 - 1, lease_expiry_ms=1_700_000_000_123)
    for i, tier in enumerate((0, 1)):
        result.replicas.add(
            segment_id=7 + i,
            node=f"node-{i}",
            tcp_endpoint=f"127.0.0.1:{4000 + i}",
            shm_path=f"/dev/shm/seg{i}",
            offset=4096 * i,
            length=65_537,
            expiry_ms=1_700_000_000_000 + i,
            mac=bytes([i]) * 32,
            tier=tier,
        )
    converted = _resolved(result)
    expected = _Resolved(
        result.code,
        result.size,
        result.checksum,
        result.lease_expiry_ms,
        tuple(replica_of(d) for d in result.replicas),
    )
    assert converted == expected
    assert type(converted) is _Resolved
    assert all(type(r) is Replica and len(r) == len(Replica._fields) for r in converted.replicas)
    assert converted.replicas[1].tier == 1
    assert converted.replicas[0].mac == b"\0" * 32


def test_a_refused_key_converts_with_no_replicas() -> None:
    converted = _resolved(pb.GetReplicasResult(code=-300))
    assert converted == _Resolved(-300)
    assert converted.replicas == ()
