"""The standby feed encodes a batch of changes once for every standby: the serialized changes followed by
one standby's epoch must decode as the whole StandbyDeltaRequest (protobuf merges concatenated messages)."""

from __future__ import annotations

from kvpool.proto import master_pb2 as pb
from kvpool.store.inventory import InventoryEntry
from kvpool.store.standby_feed import _entry, _epoch_only


def test_shared_changes_and_a_per_standby_epoch_decode_as_one_request() -> None:
    changes = [(InventoryEntry(3, b"k1", 0, 512, 11), False), (InventoryEntry(3, b"k2", 512, 64, 12), True)]
    shared = pb.StandbyDeltaRequest(
        store_id="s", segment_id=3, changes=[_entry(e) for e, _ in changes], removed=[r for _, r in changes]
    ).SerializeToString()
    for epoch in ("epoch-a", "epoch-b"):
        request = pb.StandbyDeltaRequest.FromString(shared + _epoch_only(epoch))
        assert (request.store_id, request.segment_id, request.epoch) == ("s", 3, epoch)
        assert [(c.key, c.offset, c.length, c.checksum) for c in request.changes] == [
            ("k1", 0, 512, 11),
            ("k2", 512, 64, 12),
        ]
        assert list(request.removed) == [False, True]
