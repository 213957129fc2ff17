"""The client's routing over shard groups (decision 0080): one MasterClient per group behind the
MasterClient interface the pool client uses.

A keyed batch is split by ``group_of``; each group's part goes to its own leader, in parallel (one
worker thread per group besides the caller's), and the answers are merged back in the caller's order.
A group that cannot be reached fails only its own keys (with the call's code), so losing one group's
leader leaves every other group's keys served. ``prefix_length`` stays one round trip per group: each
group answers the first miss of its subsequence and the client takes the earliest in global positions.

With one group ``connect_master`` returns the plain MasterClient: a single-group cluster pays nothing.
The split and merge functions are pure (tested without sockets).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvpool.client.config import ClientConfig
from kvpool.client.master_client import MasterClient
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.groups import check_group_count, group_scope, read_group_count, split_by_group
from kvpool.common.log import get_logger
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb

log = get_logger(__name__)

# Request fields that hold one value per key, by op: a group's part carries its keys' values only.
PER_KEY_REQUEST_FIELDS: dict[int, tuple[str, ...]] = {
    frames.Op.BATCH_PUT_START: ("keys", "sizes"),
    frames.Op.BATCH_PUT_END: ("keys", "checksums"),
    frames.Op.BATCH_PUT_REVOKE: ("keys",),
    frames.Op.BATCH_GET_REPLICAS: ("keys",),
    frames.Op.BATCH_EXISTS: ("keys",),
    frames.Op.BATCH_REMOVE: ("keys",),
    frames.Op.PIN: ("keys",),
}
# Failures that are the caller's configuration, not one group's outage: never hidden as per-key codes.
_WHOLE_CALL_FAILURES = frozenset({ErrorCode.GROUP_MISMATCH, ErrorCode.WRONG_GROUP, ErrorCode.INVALID_ARGUMENT})


def split_request(op: int, request: Any, positions: Sequence[int]) -> Any:
    """The part of a keyed ``request`` that holds only the keys at ``positions`` (other fields copied)."""
    per_key = PER_KEY_REQUEST_FIELDS[op]
    part = type(request)(
        **{name: [values[i] for i in positions] for name in per_key for values in [getattr(request, name)]}
    )
    for descriptor, value in request.ListFields():
        if descriptor.name in per_key:
            continue
        if descriptor.message_type is not None:
            getattr(part, descriptor.name).CopyFrom(value)
        else:
            setattr(part, descriptor.name, value)
    return part


def merge_prefix(n_keys: int, parts: Sequence[tuple[Sequence[int], int | None]]) -> int:
    """The global prefix length from each group's (positions, prefix length of its subsequence or None
    when the group failed): the earliest first miss over the groups."""
    first_miss = n_keys
    for positions, prefix in parts:
        if not positions:
            continue
        answered = 0 if prefix is None else prefix
        if answered < len(positions):
            first_miss = min(first_miss, positions[answered])
    return first_miss


def merge_response(
    op: int, n_keys: int, parts: Sequence[tuple[Sequence[int], Any | None, ErrorCode]], prefix: bool = False
) -> Any:
    """One response of ``op`` for ``n_keys`` keys from each group's (positions, response or None, its
    failure code): every key gets its own group's answer, or that group's failure."""
    _name, _req, resp_type = frames.RPC_METHODS[op]
    ok = [response for _, response, _ in parts if response is not None]
    merged = resp_type(status=ok[0].status) if ok else resp_type()
    if op == frames.Op.BATCH_EXISTS:
        if prefix:
            merged.prefix_length = merge_prefix(
                n_keys, [(pos, None if r is None else int(r.prefix_length)) for pos, r, _ in parts]
            )
            return merged
        exists = [False] * n_keys
        for positions, response, _code in parts:
            if response is not None:
                for i, found in zip(positions, response.exists, strict=True):
                    exists[i] = found
        merged.exists.extend(exists)
        return merged
    if resp_type is pb.BatchCodesResponse:
        codes = [0] * n_keys
        for positions, response, code in parts:
            values = response.codes if response is not None else [int(code)] * len(positions)
            for i, value in zip(positions, values, strict=True):
                codes[i] = value
        merged.codes.extend(codes)
        return merged
    result_type = pb.PutStartResult if op == frames.Op.BATCH_PUT_START else pb.GetReplicasResult
    results: list[Any] = [None] * n_keys
    for positions, response, code in parts:
        values = response.results if response is not None else [result_type(code=int(code))] * len(positions)
        for i, value in zip(positions, values, strict=True):
            results[i] = value
    merged.results.extend(results)
    return merged


def merge_stats(responses: Sequence[pb.StatsResponse]) -> pb.StatsResponse:
    """The cluster's stats: counters summed over the groups; role and leader are group 0's."""
    merged = pb.StatsResponse()
    merged.CopyFrom(responses[0])
    for other in responses[1:]:
        for name in ("objects", "capacity", "used", "hits", "misses", "evictions", "evicted_bytes", "puts"):
            setattr(merged, name, getattr(merged, name) + getattr(other, name))
        merged.reclaimed_puts += other.reclaimed_puts
        merged.segments.extend(other.segments)
        merged.masters.extend(other.masters)
        for key, value in other.extra.items():
            merged.extra[key] = merged.extra.get(key, 0.0) + value
    return merged


class GroupRouter:
    """Several groups' MasterClients behind one MasterClient-like link. Thread-safe."""

    def __init__(self, clients: Sequence[MasterClient]) -> None:
        self.clients = list(clients)
        self.groups = len(self.clients)
        self._pool = ThreadPoolExecutor(max_workers=self.groups, thread_name_prefix="kvpool-group")

    @property
    def info(self) -> pb.ClusterInfoResponse | None:
        return self.clients[0].info

    def call(self, op: frames.Op, request: Any, deadline: Deadline) -> Any:
        if op in PER_KEY_REQUEST_FIELDS:
            return self._keyed_call(op, request, deadline)
        if op == frames.Op.GET_STATS:
            return merge_stats(self._everywhere(op, request, deadline))
        if op == frames.Op.REMOVE_ALL:
            answers = self._everywhere(op, request, deadline)
            return pb.RemoveAllResponse(status=answers[0].status, removed=sum(a.removed for a in answers))
        if op == frames.Op.REPORT_STORE_FAILURES:
            answers = self._everywhere(op, request, deadline)
            suspected = sorted({s for a in answers for s in a.suspected})
            return pb.ReportStoreFailuresResponse(status=answers[0].status, suspected=suspected)
        return self.clients[0].call(op, request, deadline)

    def _keyed_call(self, op: frames.Op, request: Any, deadline: Deadline) -> Any:
        keys = request.keys
        positions = split_by_group(keys, self.groups)
        used = [g for g in range(self.groups) if positions[g]]
        if len(used) == 1:  # the whole batch is one group's: no split, no merge, no thread hop
            return self.clients[used[0]].call(op, request, deadline)
        jobs = [(g, split_request(op, request, positions[g])) for g in used]
        outcomes = self._run_parallel([(self.clients[g].call, (op, part, deadline)) for g, part in jobs])
        parts: list[tuple[Sequence[int], Any | None, ErrorCode]] = []
        failures: list[KvPoolError] = []
        for (g, _part), (response, error) in zip(jobs, outcomes, strict=True):
            if error is not None:
                if error.code in _WHOLE_CALL_FAILURES:
                    raise error
                failures.append(error)
            parts.append((positions[g], response, error.code if error is not None else ErrorCode.OK))
        if len(failures) == len(jobs):
            raise failures[0]  # no group answered: the call failed as it would with one master
        prefix = op == frames.Op.BATCH_EXISTS and bool(request.prefix)
        return merge_response(op, len(keys), parts, prefix)

    def _everywhere(self, op: frames.Op, request: Any, deadline: Deadline) -> list[Any]:
        outcomes = self._run_parallel([(client.call, (op, request, deadline)) for client in self.clients])
        for _response, error in outcomes:
            if error is not None:
                raise error
        return [response for response, _ in outcomes]

    def _run_parallel(
        self, calls: Sequence[tuple[Callable[..., Any], tuple[Any, ...]]]
    ) -> list[tuple[Any, KvPoolError | None]]:
        """Run the calls, the last on the caller's thread and the others on the pool; (answer, failure) each."""
        futures: list[Future[Any]] = [self._pool.submit(fn, *args) for fn, args in calls[:-1]]
        outcomes: list[tuple[Any, KvPoolError | None]] = []
        last_fn, last_args = calls[-1]
        last = _outcome(lambda: last_fn(*last_args))
        for future in futures:
            outcomes.append(_outcome(future.result))
        outcomes.append(last)
        return outcomes

    def batch_limits(self, deadline: Deadline) -> tuple[int, int]:
        return self.clients[0].batch_limits(deadline)

    def grpc_call(self, method: str, request: Any, timeout: float = 10.0) -> Any:
        return self.clients[0].grpc_call(method, request, timeout)

    def invalidate(self) -> None:
        for client in self.clients:
            client.invalidate()

    @property
    def degraded(self) -> bool:
        return any(client.degraded for client in self.clients)

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self._pool.shutdown(wait=False)


def _outcome(fn: Callable[[], Any]) -> tuple[Any, KvPoolError | None]:
    try:
        return fn(), None
    except KvPoolError as exc:
        return None, exc


def cluster_groups(cfg: ClientConfig) -> int:
    """The cluster's group count as this client must route by: etcd's record (checked against an explicit
    ``cfg.groups``), or ``cfg.groups`` (default 1) for a host:port master or while etcd cannot be read."""
    wanted = cfg.groups
    if wanted:
        check_group_count(wanted)
    if not cfg.master.startswith("etcd://"):
        if wanted > 1:
            raise KvPoolError(
                ErrorCode.INVALID_ARGUMENT, f"groups={wanted} needs an etcd:// master address to find each group"
            )
        return 1
    from kvpool.common.etcd import EtcdClient
    from kvpool.common.leader_watch import parse_master_address

    _kind, endpoints = parse_master_address(cfg.master)
    assert isinstance(endpoints, list)
    try:
        with EtcdClient(endpoints, timeout=2.0) as etcd:
            recorded = read_group_count(etcd, cfg.cluster, timeout=2.0)
    except KvPoolError as exc:
        log.warning("cannot read the cluster's group count from etcd (%s); routing over %d group(s)", exc, wanted or 1)
        return wanted or 1
    if wanted and wanted != recorded:
        raise KvPoolError(
            ErrorCode.GROUP_MISMATCH,
            f"this client was configured for {wanted} shard group(s); cluster {cfg.cluster!r} has {recorded}",
        )
    return recorded


def connect_master(cfg: ClientConfig) -> MasterClient | GroupRouter:
    """The pool client's master link: one MasterClient for one group, a GroupRouter for several."""
    groups = cluster_groups(cfg)

    def client_for(group: int) -> MasterClient:
        return MasterClient(
            cfg.master,
            token_file=cfg.token_file,
            cluster=group_scope(cfg.cluster, group, groups),
            tls_ca=cfg.tls_ca,
            breaker_backoff_s=cfg.breaker_backoff_s,
            breaker_max_backoff_s=cfg.breaker_max_backoff_s,
            spin_us=cfg.spin_us,
            group=(group, groups),
        )

    if groups == 1:
        return client_for(0)
    return GroupRouter([client_for(g) for g in range(groups)])
