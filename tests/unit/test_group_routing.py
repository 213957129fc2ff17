"""Shard groups, pure parts (decision 0080): the key -> group function, the client's split and merge, the
router over per-group links (a named fake link per group, no sockets), and G kept in etcd (the fake
coordinator)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter
from typing import Any

import pytest

from kvpool.client.group_router import GroupRouter, merge_prefix, merge_response, split_request
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.etcd import cluster_prefix
from kvpool.common.groups import (
    group_count_key,
    group_of,
    group_scope,
    read_group_count,
    record_group_count,
    split_by_group,
)
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from tests.support.fake_coordinator import FakeCoordinator

KEYS = [f"{i:064x}_0_k" for i in range(2000)]


def _groups_in_child(keys: list[str], groups: int, hash_seed: str) -> list[int]:
    code = (
        "import json, sys; from kvpool.common.groups import group_of; "
        f"print(json.dumps([group_of(k, {groups}) for k in json.load(sys.stdin)]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(keys), capture_output=True, text=True, env=env, check=True
    )
    groups_of: list[int] = json.loads(out.stdout)
    return groups_of


def test_group_of_is_the_same_in_every_process() -> None:
    keys = KEYS[:300]
    here = [group_of(k, 4) for k in keys]
    assert _groups_in_child(keys, 4, "1") == here
    assert _groups_in_child(keys, 4, "12345") == here  # Python's salted hash() would differ here


@pytest.mark.parametrize("groups", [2, 3, 4])
def test_group_of_balances_keys(groups: int) -> None:
    counts = Counter(group_of(k, groups) for k in KEYS)
    assert set(counts) == set(range(groups))
    mean = len(KEYS) / groups
    assert all(abs(n - mean) < 0.1 * mean for n in counts.values()), counts


def test_one_group_owns_everything_and_bytes_route_like_text() -> None:
    assert {group_of(k, 1) for k in KEYS[:100]} == {0}
    assert all(group_of(k, 3) == group_of(k.encode(), 3) for k in KEYS[:100])


def test_split_by_group_keeps_every_position_once_in_order() -> None:
    keys = KEYS[:50]
    parts = split_by_group(keys, 3)
    assert sorted(i for part in parts for i in part) == list(range(50))
    for g, part in enumerate(parts):
        assert part == sorted(part)
        assert all(group_of(keys[i], 3) == g for i in part)


def test_group_scope_keys_live_under_the_cluster() -> None:
    assert group_scope("c1", 0, 1) == "c1"  # one group: the keys of today
    assert cluster_prefix(group_scope("c1", 1, 2)) == "/kvpool/c1/groups/1/"
    with pytest.raises(KvPoolError) as err:
        group_scope("c1", 2, 2)
    assert err.value.code == ErrorCode.INVALID_ARGUMENT
    with pytest.raises(KvPoolError):
        cluster_prefix("c1/groups/x")


def test_split_request_carries_only_its_keys_values() -> None:
    request = pb.BatchPutStartRequest(client_id="c", keys=["a", "b", "c"], sizes=[1, 2, 3])
    part = split_request(frames.Op.BATCH_PUT_START, request, [0, 2])
    assert list(part.keys) == ["a", "c"]
    assert list(part.sizes) == [1, 3]
    assert part.client_id == "c"
    assert list(request.keys) == ["a", "b", "c"]  # the caller's request is untouched


def test_merge_prefix_takes_the_earliest_first_miss() -> None:
    # keys 0..5; group A holds positions 0,2,4 and group B 1,3,5.
    assert merge_prefix(6, [([0, 2, 4], 3), ([1, 3, 5], 3)]) == 6
    assert merge_prefix(6, [([0, 2, 4], 3), ([1, 3, 5], 1)]) == 3  # B misses position 3
    assert merge_prefix(6, [([0, 2, 4], 1), ([1, 3, 5], 3)]) == 2
    assert merge_prefix(6, [([0, 2, 4], 3), ([1, 3, 5], None)]) == 1  # B failed: its first key is a miss
    assert merge_prefix(3, [([], 0), ([0, 1, 2], 2)]) == 2


def test_merge_response_puts_answers_back_in_order_and_fails_only_the_failed_group() -> None:
    ok = pb.Status()
    a = pb.BatchCodesResponse(status=ok, codes=[0, -100])
    merged = merge_response(
        frames.Op.BATCH_REMOVE, 4, [([1, 3], a, ErrorCode.OK), ([0, 2], None, ErrorCode.UNAVAILABLE)]
    )
    assert list(merged.codes) == [ErrorCode.UNAVAILABLE, 0, ErrorCode.UNAVAILABLE, -100]
    exists = pb.BatchExistsResponse(status=ok, exists=[True, False])
    merged = merge_response(frames.Op.BATCH_EXISTS, 3, [([0, 2], exists, ErrorCode.OK), ([1], None, ErrorCode.TIMEOUT)])
    assert list(merged.exists) == [True, False, False]
    replicas = pb.BatchGetReplicasResponse(status=ok, results=[pb.GetReplicasResult(code=0, size=7)])
    merged = merge_response(
        frames.Op.BATCH_GET_REPLICAS, 2, [([1], replicas, ErrorCode.OK), ([0], None, ErrorCode.UNAVAILABLE)]
    )
    assert [r.code for r in merged.results] == [ErrorCode.UNAVAILABLE, 0]
    assert merged.results[1].size == 7


class FakeGroupMaster:
    """A fake master link for one group (stands in for MasterClient over a socket): it keeps a set of
    keys, refuses keys of other groups as a real group master does, and can be taken down."""

    def __init__(self, group: int, groups: int) -> None:
        self.group, self.groups = group, groups
        self.keys: set[str] = set()
        self.down = False
        self.calls: list[tuple[int, list[str]]] = []
        self.threads: set[str] = set()
        self.info: Any = None

    def call(self, op: frames.Op, request: Any, deadline: Deadline) -> Any:
        keys = list(getattr(request, "keys", []))
        self.calls.append((op, keys))
        self.threads.add(threading.current_thread().name)
        if self.down:
            raise KvPoolError(ErrorCode.UNAVAILABLE, f"group {self.group} is down")
        if any(group_of(k, self.groups) != self.group for k in keys):
            raise KvPoolError(ErrorCode.WRONG_GROUP, "mis-routed")
        if op == frames.Op.BATCH_EXISTS:
            found = [k in self.keys for k in keys]
            if request.prefix:
                return pb.BatchExistsResponse(prefix_length=(found + [False]).index(False))
            return pb.BatchExistsResponse(exists=found)
        if op == frames.Op.BATCH_REMOVE:
            codes = [0 if k in self.keys else int(ErrorCode.OBJECT_NOT_FOUND) for k in keys]
            self.keys -= set(keys)
            return pb.BatchCodesResponse(codes=codes)
        if op == frames.Op.GET_STATS:
            return pb.StatsResponse(objects=len(self.keys), role="leader")
        raise KvPoolError(ErrorCode.NOT_SUPPORTED, "not in this fake")

    def close(self) -> None:
        self.down = True


def _router(groups: int) -> tuple[GroupRouter, list[FakeGroupMaster]]:
    fakes = [FakeGroupMaster(g, groups) for g in range(groups)]
    return GroupRouter(fakes), fakes  # type: ignore[arg-type]


def test_router_sends_each_key_to_its_group_and_merges_in_order() -> None:
    router, fakes = _router(3)
    present = KEYS[:30:2]
    for k in present:
        fakes[group_of(k, 3)].keys.add(k)
    answer = router.call(frames.Op.BATCH_EXISTS, pb.BatchExistsRequest(keys=KEYS[:30]), Deadline(5.0))
    assert list(answer.exists) == [k in present for k in KEYS[:30]]
    assert all(len(f.calls) == 1 for f in fakes)  # one round trip per group
    stats = router.call(frames.Op.GET_STATS, pb.StatsRequest(), Deadline(5.0))
    assert stats.objects == len(present)
    router.close()


def test_router_prefix_length_is_one_round_trip_per_group() -> None:
    router, fakes = _router(2)
    keys = KEYS[:40]
    for k in keys[:25]:
        fakes[group_of(k, 2)].keys.add(k)
    answer = router.call(frames.Op.BATCH_EXISTS, pb.BatchExistsRequest(keys=keys, prefix=True), Deadline(5.0))
    assert answer.prefix_length == 25
    assert [len(f.calls) for f in fakes] == [1, 1]
    router.close()


def test_router_one_group_down_fails_only_its_keys() -> None:
    router, fakes = _router(2)
    fakes[0].down = True
    keys = KEYS[:20]
    for k in keys:
        fakes[group_of(k, 2)].keys.add(k)
    codes = router.call(frames.Op.BATCH_REMOVE, pb.BatchRemoveRequest(keys=keys), Deadline(5.0)).codes
    assert list(codes) == [ErrorCode.UNAVAILABLE if group_of(k, 2) == 0 else 0 for k in keys]
    only_up = [k for k in KEYS[20:60] if group_of(k, 2) == 1]
    fakes[1].keys.update(only_up)
    answer = router.call(frames.Op.BATCH_EXISTS, pb.BatchExistsRequest(keys=only_up), Deadline(5.0))
    assert all(answer.exists)  # a batch of one group's keys never touches the other group
    fakes[1].down = True
    with pytest.raises(KvPoolError) as err:  # no group answered: the call fails as with one master
        router.call(frames.Op.BATCH_EXISTS, pb.BatchExistsRequest(keys=keys), Deadline(5.0))
    assert err.value.code == ErrorCode.UNAVAILABLE
    router.close()


def test_router_never_hides_a_misroute() -> None:
    router, fakes = _router(2)
    fakes[1].groups = 3  # this group's master counts differently: it refuses what it is sent
    keys = [k for k in KEYS if group_of(k, 2) == 1 and group_of(k, 3) != 1][:1] + KEYS[:10]
    with pytest.raises(KvPoolError) as err:
        router.call(frames.Op.BATCH_EXISTS, pb.BatchExistsRequest(keys=keys), Deadline(5.0))
    assert err.value.code == ErrorCode.WRONG_GROUP
    router.close()


def test_group_count_is_recorded_once_and_a_different_count_is_refused() -> None:
    etcd = FakeCoordinator()
    assert read_group_count(etcd, "c1") == 1
    record_group_count(etcd, "c1", 1)
    assert etcd.get(group_count_key("c1")) is None  # a single-group cluster writes nothing
    record_group_count(etcd, "c2", 2)
    record_group_count(etcd, "c2", 2)  # the next master of the same cluster agrees
    assert read_group_count(etcd, "c2") == 2
    for wrong in (1, 3):
        with pytest.raises(KvPoolError) as err:
            record_group_count(etcd, "c2", wrong)
        assert err.value.code == ErrorCode.GROUP_MISMATCH
        assert "has 2 master group(s)" in err.value.message
