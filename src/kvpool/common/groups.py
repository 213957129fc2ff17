"""Shard groups (docs/decisions/0080-shard-groups.md): the one key -> group function and the group's etcd scope.

A cluster has G master groups, fixed when it is created and recorded in etcd under
``/kvpool/<cluster>/group-count``. Group g elects its own leader under ``/kvpool/<cluster>/groups/<g>/`` and
owns the keys with ``group_of(key, G) == g``. Clients, masters, stores and tools all import this module, so
there is exactly one routing function. With G = 1 nothing changes: the scope is the cluster itself, no
etcd key is written, and ``group_of`` is never computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import xxhash

from kvpool.common.coordinator import Coordinator
from kvpool.common.errors import ErrorCode, KvPoolError

__all__ = [
    "MAX_GROUPS",
    "check_group_count",
    "check_master_group",
    "group_count_key",
    "group_of",
    "group_scope",
    "read_group_count",
    "record_group_count",
    "split_by_group",
    "wrong_group",
]

MAX_GROUPS = 64
"""Most groups a cluster may have (each group is a set of master processes and a share of every store)."""


def group_of(key: str | bytes, groups: int) -> int:
    """The group that owns ``key``: xxhash64 of its UTF-8 bytes, mod ``groups``.

    Stable across processes, hosts and Python versions (never Python's ``hash()``, which is salted per
    process)."""
    if groups <= 1:
        return 0
    raw = key.encode() if isinstance(key, str) else key
    return int(xxhash.xxh64_intdigest(raw) % groups)


def wrong_group(key: str, groups: int, mine: int) -> KvPoolError:
    """The refusal of a call holding ``key``, which is not group ``mine``'s (decision 0080)."""
    return KvPoolError(
        ErrorCode.WRONG_GROUP,
        f"key {key[:64]!r} belongs to shard group {group_of(key, groups)} of {groups}; this master serves group {mine}",
    )


def split_by_group(keys: Sequence[str], groups: int) -> list[list[int]]:
    """For each group, the positions of ``keys`` it owns, in their order (empty lists included)."""
    positions: list[list[int]] = [[] for _ in range(groups)]
    digest = xxhash.xxh64_intdigest  # group_of inlined: this runs per key of every batch a client sends
    for i, key in enumerate(keys):
        positions[digest(key.encode()) % groups].append(i)
    return positions


def check_group_count(groups: int) -> int:
    if not 1 <= groups <= MAX_GROUPS:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"groups must be in 1..{MAX_GROUPS}, not {groups}")
    return groups


def group_scope(cluster: str, group: int, groups: int) -> str:
    """The cluster name group ``group``'s election, registrations and intents live under in etcd.

    One group: the cluster itself (existing single-group clusters keep their keys)."""
    if groups <= 1:
        return cluster
    if not 0 <= group < groups:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"group {group} is not in 0..{groups - 1}")
    return f"{cluster}/groups/{group}"


def group_count_key(cluster: str) -> str:
    from kvpool.common.etcd import cluster_prefix

    return cluster_prefix(cluster) + "group-count"


def read_group_count(etcd: Coordinator, cluster: str, *, timeout: float | None = None) -> int:
    """The cluster's G as recorded in etcd; 1 when none is recorded (a cluster from before groups)."""
    kv = etcd.get(group_count_key(cluster), timeout=timeout)
    if kv is None:
        return 1
    try:
        return check_group_count(int(kv.value))
    except (ValueError, KvPoolError):
        raise KvPoolError(
            ErrorCode.ETCD_ERROR, f"{group_count_key(cluster)} holds {kv.value!r}, not a group count"
        ) from None


def record_group_count(etcd: Coordinator, cluster: str, groups: int) -> None:
    """A master's check at start: record G if this is the cluster's first master with groups, else refuse
    a G that differs from the recorded one (G is fixed when the cluster is created)."""
    key = group_count_key(cluster)
    recorded = read_group_count(etcd, cluster)
    existing = etcd.get(key)
    if existing is None and groups > 1:
        won, _rev, existing = etcd.create_if_absent(key, str(groups))
        if won:
            return
        recorded = int(existing.value) if existing is not None else 1
    if recorded != groups:
        raise KvPoolError(
            ErrorCode.GROUP_MISMATCH,
            f"cluster {cluster!r} has {recorded} master group(s) (recorded in etcd at {key}); "
            f"this master was started with --groups {groups}",
        )


def check_master_group(info: Any, expected_group: int, expected_groups: int, address: str) -> None:
    """A client's (or store's) check of a master's cluster-info answer: the master must serve the group
    the caller routes to it, in a cluster of the G the caller routes by. A master from before groups
    reports 0 groups: it serves one group."""
    groups = int(getattr(info, "groups", 0)) or 1
    group = int(getattr(info, "group", 0))
    if groups != expected_groups or group != expected_group:
        raise KvPoolError(
            ErrorCode.GROUP_MISMATCH,
            f"master {address} serves group {group} of {groups}, but this client routes keys over "
            f"{expected_groups} group(s) and sent group {expected_group}'s calls there"
            + ("; connect through etcd:// so that keys reach their group" if groups > 1 else ""),
        )
