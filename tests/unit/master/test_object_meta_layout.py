"""ObjectMeta keeps the lease, further replicas and a soft pin in one slot (master/objects.py): every
combination reads back what was written, and the common object stays a 96-byte record."""

from __future__ import annotations

import sys

from kvpool.master.objects import ObjectMeta, Replica, ReplicaStatus


def test_a_single_replica_object_is_a_96_byte_record_whatever_its_lease() -> None:
    meta = ObjectMeta(4096, 1, 0, now=1.0)
    meta.lease_until = 5.0
    assert sys.getsizeof(meta) == 96
    assert (meta.lease_until, meta.soft_pin_until, meta.extra) == (5.0, 0.0, None)
    assert type(meta._hold) is float  # no out-of-line record for the common object


def test_lease_replicas_and_soft_pin_read_back_in_every_order() -> None:
    meta = ObjectMeta(4096, 1, 0, now=1.0, soft_pin_until=9.0)
    assert (meta.lease_until, meta.soft_pin_until, meta.extra) == (0.0, 9.0, None)
    assert meta.extend_lease(5.0) == 5.0
    assert meta.extend_lease(3.0) == 5.0  # a lease never shrinks
    meta.add_replica(2, 64, True)
    assert meta.replica_list() == [
        Replica(1, 0, ReplicaStatus.PROCESSING),
        Replica(2, 64, ReplicaStatus.COMPLETE),
    ]
    meta.soft_pin_until = 0.0
    assert (meta.lease_until, meta.soft_pin_until, meta.replica_count()) == (5.0, 0.0, 2)
    meta.set_replicas([Replica(1, 0, ReplicaStatus.COMPLETE)])
    assert (meta.lease_until, meta.soft_pin_until, meta.extra) == (5.0, 0.0, None)
    assert type(meta._hold) is float  # back inline once nothing rare is left
    assert meta.extend_lease(7.5) == 7.5
    meta.soft_pin_until = 11.0
    assert (meta.lease_until, meta.soft_pin_until) == (7.5, 11.0)
