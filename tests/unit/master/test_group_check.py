"""A master of shard group g refuses every keyed call holding one key of another group (decision 0080),
wherever in the batch that key is: the compiled check (kvpool.master._index) hashes every key, and
agrees with common/groups.py's group_of. Real MasterState and handlers; the requests go through their
wire encoding."""

from __future__ import annotations

from typing import Any

import pytest
from master_scenario import Cluster, MiB

from kvpool.common.errors import ErrorCode
from kvpool.common.groups import group_of
from kvpool.master import service, shards
from kvpool.master.service import MasterHandlers, Role
from kvpool.proto import master_pb2 as pb

GROUPS = 2
MINE = 1
KEYS = [f"{i:064x}_0_k" for i in range(3000)] + ["é-ü-漢字-🙂", "a\nb\0c", "x" * 600, ""]


@pytest.fixture(params=["native", "python"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "python":
        monkeypatch.setattr(shards, "_native_lookup", None)
        monkeypatch.setattr(shards, "_native_group_lookup", None)
        monkeypatch.setattr(service, "_native_foreign", None)
    elif shards._native_group_lookup is None or service._native_foreign is None:
        pytest.skip("kvpool.master._index is not built here")
    return str(request.param)


def _handlers() -> tuple[MasterHandlers, list[str], list[str]]:
    c = Cluster(segments={1: 64 * MiB}, groups=GROUPS, group=MINE)
    mine = [k for k in KEYS if group_of(k, GROUPS) == MINE][:511]
    others = [k for k in KEYS if group_of(k, GROUPS) != MINE]
    assert c.put(*mine, size=64) == [ErrorCode.OK] * len(mine)
    return MasterHandlers(c.state, c.config, Role(), {}), mine, others


def _call(handlers: MasterHandlers, method: str, request: Any, response_type: type) -> Any:
    return handlers.dispatch(method, type(request).FromString(request.SerializeToString()), response_type)


CALLS: list[tuple[str, Any, type]] = [
    ("BatchExists", lambda keys: pb.BatchExistsRequest(keys=keys), pb.BatchExistsResponse),
    ("BatchExists", lambda keys: pb.BatchExistsRequest(keys=keys, prefix=True), pb.BatchExistsResponse),
    ("BatchGetReplicas", lambda keys: pb.BatchGetReplicasRequest(keys=keys), pb.BatchGetReplicasResponse),
    ("BatchRemove", lambda keys: pb.BatchRemoveRequest(keys=keys), pb.BatchCodesResponse),
    ("Pin", lambda keys: pb.PinRequest(keys=keys, unpin=True), pb.BatchCodesResponse),
    (
        "BatchPutStart",
        lambda keys: pb.BatchPutStartRequest(client_id="w", keys=keys, sizes=[64] * len(keys)),
        pb.BatchPutStartResponse,
    ),
    (
        "BatchPutEnd",
        lambda keys: pb.BatchPutEndRequest(client_id="w", keys=keys, checksums=[0] * len(keys)),
        pb.BatchCodesResponse,
    ),
]


@pytest.mark.parametrize(("method", "build", "response_type"), CALLS, ids=lambda v: v if isinstance(v, str) else "")
def test_one_stray_key_anywhere_in_a_batch_refuses_it(impl: str, method: str, build: Any, response_type: type) -> None:
    handlers, mine, others = _handlers()
    for position in (0, 7, 255, 510):  # a sample of 16 of 511 keys would miss most of these positions
        keys = [*mine[:position], others[position], *mine[position:510]]
        answer = _call(handlers, method, build(keys), response_type)
        assert answer.status.code == ErrorCode.WRONG_GROUP, (method, position)
        assert f"{others[position][:64]!r} belongs to shard group {1 - MINE} of {GROUPS}" in answer.status.message
    assert handlers.state.stats().objects == len(mine)  # nothing was removed, pinned or put


def test_a_batch_of_the_masters_own_keys_is_served(impl: str) -> None:
    handlers, mine, _others = _handlers()
    answer = _call(handlers, "BatchExists", pb.BatchExistsRequest(keys=mine), pb.BatchExistsResponse)
    assert answer.status.code == ErrorCode.OK
    assert list(answer.exists) == [True] * len(mine)
    prefix = _call(handlers, "BatchExists", pb.BatchExistsRequest(keys=mine, prefix=True), pb.BatchExistsResponse)
    assert prefix.prefix_length == len(mine)


def test_the_compiled_group_check_agrees_with_group_of() -> None:
    if shards._native_group_lookup is None or service._native_foreign is None:
        pytest.skip("kvpool.master._index is not built here")
    from kvpool.master._index import foreign, lookup

    objects: tuple[dict[str, Any], ...] = ({},)
    for groups in (2, 3, 7, 64):
        for group in range(min(groups, 4)):
            expected = next((i for i, k in enumerate(KEYS) if group_of(k, groups) != group), -1)
            assert foreign(KEYS, groups, group) == expected
            assert foreign(tuple(KEYS), groups, group) == expected
            found = lookup(KEYS, objects, groups, group)
            assert found == (expected if expected >= 0 else [None] * len(KEYS))
            own = [k for k in KEYS if group_of(k, groups) == group]
            assert foreign(own, groups, group) == -1
            assert lookup(own, objects, groups, group) == [None] * len(own)
    assert foreign(KEYS, 1, 0) == -1
    with pytest.raises(ValueError, match="group must be in"):
        foreign(KEYS, 2, 2)
    with pytest.raises(TypeError, match="keys must be str"):
        foreign([b"bytes"], 2, 0)
