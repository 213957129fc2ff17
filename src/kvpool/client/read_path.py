"""The read path of ``PoolClient``: the lookup (lease cache, hints, the master) with speculative reads by
key alongside it, the landing buffer of ``batch_get``, reading each object from one replica with fallbacks
and suspicion of stores that hang, verification against lease and checksum, and the read counters.

A mixin of ``PoolClient`` (pool_client.py), not a separate object: ``batch_get`` and ``batch_get_into`` call
these methods, which work on the client's master connection, transports, lease cache, speculation and
counters. The attributes they use are declared below and assigned by ``PoolClient.__init__``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import cast

from kvpool.client.call_parts import _Counters, _keyed, _Resolved, _resolved
from kvpool.client.config import ClientConfig
from kvpool.client.group_router import GroupRouter
from kvpool.client.lease_cache import LeaseCache
from kvpool.client.master_client import MasterClient
from kvpool.client.read_by_key import SpeculativeReads
from kvpool.client.store_failures import StoreFailureReporter
from kvpool.common.clock import Clock, Deadline
from kvpool.common.errors import ErrorCode, KvPoolError, as_code
from kvpool.common.grants import GrantOp
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from kvpool.transfer.base import Replica, TransferRequest
from kvpool.transfer.registry import TransportSet

# The largest per-thread landing buffer of batch_get kept between calls (every thread that calls get keeps
# one: an engine's thread pool must not hold gigabytes); a larger call allocates a buffer of its own.
_SCRATCH_KEEP = 16 << 20
_SPECULATIVE_BATCH_PART = 256 << 10
"""A batch is read by key while the master answers (decision 0031) only when every buffer is at most this
long: small pages, which one connection moves as fast as the striped lanes would."""

# How long a store whose replica did not answer within its share of a read's deadline is read last.
_SUSPECT_S = 5.0


class ReadPathMixin:
    """The steps of a batch read after its buffers are checked (see the module docstring)."""

    config: ClientConfig
    _clock: Clock
    _master: MasterClient | GroupRouter
    _transports: TransportSet
    _counters: _Counters
    _leases: LeaseCache
    _suspects: dict[str, float]
    _suspects_lock: threading.Lock
    _scratch: threading.local
    _speculation: SpeculativeReads
    _store_failures: StoreFailureReporter
    _deadline: Callable[[float | None], Deadline]

    def _lookup(
        self, keys: Sequence[str], deadline: Deadline, views: list[memoryview] | None
    ) -> tuple[list[_Resolved], list[int], dict[int, list[Replica]], list[int | None] | None]:
        """``_get_replicas``; for keys this client holds no location of, speculative reads by key (decision
        0031) into ``views`` go to the expected store first: per key, the object's size where the master's
        answer confirmed it (that read is done), else None; None when none were sent."""
        sent = None
        if views is not None and self._speculates(keys, views):
            sent = self._speculation.send(keys, [len(v) for v in views], deadline)
        results, cached, hinted = self._get_replicas(keys, deadline)
        got = None
        if sent is not None and views is not None:
            got = self._speculation.finish(sent, results, views, deadline)
            self._count_reads([size for size in got if size is not None])
        if (got is None or got[0] is None) and not cached and results[0].replicas:
            self._speculation.learn(self._transports.revalidating(results[0].replicas))  # where objects live
        return results, cached, hinted, got

    def _speculates(self, keys: Sequence[str], views: list[memoryview]) -> bool:
        """Whether to read ``keys`` by key while the master answers: a store to ask, no key with a location
        here, and (for a batch) small pages only."""
        if self._speculation.target() is None:
            return False
        if len(keys) > 1 and (
            not self.config.speculative_batches or any(len(v) > _SPECULATIVE_BATCH_PART for v in views)
        ):
            return False
        return not any(self._leases.knows(key) for key in keys)

    def _read_rest(
        self,
        keys: Sequence[str],
        results: list[_Resolved],
        cached: list[int],
        hinted: dict[int, list[Replica]],
        views: list[memoryview],
        got: list[int | None],
        deadline: Deadline,
    ) -> list[int]:
        """``_read_resolved`` of the keys a speculative read did not settle; the others keep their sizes."""
        rest = [i for i, size in enumerate(got) if size is None]
        codes = [size or 0 for size in got]
        if rest:
            in_cache = set(cached)
            for i, code in zip(
                rest,
                self._read_resolved(
                    [keys[i] for i in rest],
                    [results[i] for i in rest],
                    [j for j, i in enumerate(rest) if i in in_cache],
                    {j: hinted[i] for j, i in enumerate(rest) if i in hinted},
                    [views[i] for i in rest],
                    deadline,
                ),
                strict=True,
            ):
                codes[i] = code
        return codes

    def _landing_views(self, sizes: list[int]) -> tuple[memoryview, list[memoryview]]:
        """This thread's read buffer (grown to the call's total and kept up to ``_SCRATCH_KEEP`` bytes;
        a larger call gets a buffer of its own) and one slice of it per size."""
        total = sum(sizes)
        scratch = self._scratch
        buf: bytearray | None = getattr(scratch, "buf", None)
        if buf is None or len(buf) < total:
            buf = bytearray(total)
            if total <= _SCRATCH_KEEP:
                scratch.buf = buf
        landing = memoryview(buf)
        views = []
        offset = 0
        for size in sizes:
            views.append(landing[offset : offset + size])
            offset += size
        return landing, views

    def _get_replicas(
        self, keys: Sequence[str], deadline: Deadline, use_cache: bool = True, renewal: bool = False
    ) -> tuple[list[_Resolved], list[int], dict[int, list[Replica]]]:
        """One result per key (a failed master call gives results carrying its code: UNAVAILABLE, ...),
        the positions answered from the lease cache, which asks the master only for the others, and of
        those the ones answered from a hint (an ended lease), with the replicas to revalidate them on.
        A ``renewal``'s answers are not cached if this client dropped entries meanwhile (a removal)."""
        leases = self._leases
        drops = leases.drops if renewal else None
        found: list[_Resolved | None] = (
            [leases.get(key) for key in keys] if use_cache and leases.enabled else [None] * len(keys)
        )
        hinted: dict[int, list[Replica]] = {}
        if use_cache and leases.keeps_hints and None in found:
            for i, r in enumerate(found):
                hint = leases.hint(keys[i]) if r is None else None
                if hint is not None and (replicas := self._transports.revalidating(hint.replicas)):
                    found[i] = hint
                    hinted[i] = replicas
                    leases.hint_used(keys[i])
        cached = [i for i, r in enumerate(found) if r is not None]
        if len(cached) > len(hinted):
            self._counters.add(lease_cache_hits=len(cached) - len(hinted))
        if len(cached) < len(keys):
            missing = [i for i, r in enumerate(found) if r is None]
            asked = [keys[i] for i in missing] if cached else list(keys)
            try:
                resp = self._master.call(
                    frames.Op.BATCH_GET_REPLICAS, _keyed(pb.BatchGetReplicasRequest, asked), deadline
                )
                answers = [_resolved(r) for r in resp.results]
            except KvPoolError as exc:
                self._counters.add(degraded_calls=1)
                answers = [_Resolved(int(exc.code))] * len(asked)
            readable = []
            for i, key, result in zip(missing, asked, answers, strict=True):
                found[i] = result
                if result.code == ErrorCode.OK:
                    readable.append((key, result))
            leases.put_many(readable, unless_dropped_since=drops)
        return cast(list[_Resolved], found), cached, hinted  # every position is filled now

    def _renew_leases(self, keys: list[str]) -> None:
        """The lease renewer's call: fresh leases (and descriptors) for cached objects still being read.
        An object gone meanwhile leaves the cache; while the master cannot be reached, the entries stay
        and end with their leases."""
        results, _, _ = self._get_replicas(keys, self._deadline(None), use_cache=False, renewal=True)
        gone = [key for key, r in zip(keys, results, strict=True) if r.code == ErrorCode.OBJECT_NOT_FOUND]
        if gone:
            self._leases.drop(gone)
        self._counters.add(lease_renewals=sum(1 for r in results if r.code == ErrorCode.OK))

    def _read_resolved(
        self,
        keys: Sequence[str],
        results: list[_Resolved],
        cached: list[int],
        hinted: dict[int, list[Replica]],
        views: list[memoryview],
        deadline: Deadline,
    ) -> list[int]:
        """Read every resolved key; a read from a cached lease (or a hint) that failed is resolved again
        at the master."""
        codes = self._read_all(keys, results, views, deadline, hinted)
        if hinted:
            refused = sum(1 for i in hinted if codes[i] < 0)
            self._counters.add(revalidated_reads=len(hinted) - refused, revalidations_refused=refused)
        retry = [i for i in cached if codes[i] < 0]
        if retry and not deadline.expired():
            retry_keys = [keys[i] for i in retry]
            self._leases.drop(retry_keys)
            fresh, _, _ = self._get_replicas(retry_keys, deadline, use_cache=False)
            for i, code in zip(
                retry, self._read_all(retry_keys, fresh, [views[i] for i in retry], deadline), strict=True
            ):
                codes[i] = code
        self._count_reads(codes)
        return codes

    def _read_all(
        self,
        keys: Sequence[str],
        results: list[_Resolved],
        views: list[memoryview],
        deadline: Deadline,
        hinted: dict[int, list[Replica]] | None = None,
    ) -> list[int]:
        """Read each found object from one replica, falling back to the next replica on failure; a
        ``hinted`` one (its lease has ended) only from the given replicas, as a revalidated read."""
        hinted = hinted or {}
        codes = [0] * len(keys)
        pending: dict[int, list[Replica]] = {}
        for i, r in enumerate(results):
            if r.code:
                codes[i] = int(as_code(r.code))
            elif len(views[i]) < r.size:
                codes[i] = int(ErrorCode.BUFFER_TOO_SMALL)
            elif not r.replicas:
                codes[i] = int(ErrorCode.OBJECT_NOT_FOUND)
            elif i in hinted:
                pending[i] = self._unsuspected_first(hinted[i])
            else:
                replicas = r.replicas
                pending[i] = (
                    self._unsuspected_first(self._transports.order(replicas)) if len(replicas) > 1 else list(replicas)
                )
        while pending:
            batch = {i: replicas.pop(0) for i, replicas in pending.items()}
            attempt = self._attempt_deadline(deadline, min(len(pending[i]) for i in batch))
            # The transport verifies each object's checksum as soon as its bytes land.
            requests = [
                TransferRequest(
                    GrantOp.READ,
                    keys[i].encode(),
                    rep,
                    views[i] if len(views[i]) == results[i].size else views[i][: results[i].size],
                    results[i].checksum,
                    True,
                    i in hinted,
                )
                for i, rep in batch.items()
            ]
            transferred = self._transports.transfer(requests, attempt)
            self._store_failures.note(requests, transferred)
            # One clock reading for the round: every transfer of it has ended before this (_verify).
            now_ms = self._clock.wall_ms()
            for (i, rep), code in zip(batch.items(), transferred, strict=True):
                result = results[i]
                if code == ErrorCode.OK and (i in hinted or now_ms <= result.lease_expiry_ms):
                    codes[i] = result.size  # landed, checksum verified, and the lease (or the store) vouches
                    del pending[i]
                    continue
                if code == ErrorCode.TIMEOUT and attempt is not deadline:
                    self._suspect(rep)
                code = self._verify(code, result, i in hinted)
                codes[i] = result.size if code == ErrorCode.OK else int(code)
                if code == ErrorCode.OK or not pending[i] or deadline.expired():
                    del pending[i]
        return codes

    def _attempt_deadline(self, deadline: Deadline, fallbacks: int) -> Deadline:
        """The deadline of one round of reads: when every object of the round has ``fallbacks`` (>= 1)
        other replicas left, an equal share of what is left of the call's deadline (of the configured
        timeout, for a call without one), so that a replica that does not answer (a hung store) leaves
        time to read another; otherwise the call's deadline."""
        if fallbacks < 1:
            return deadline
        remaining = deadline.remaining()
        budget = self.config.timeout_s if remaining is None else remaining
        return Deadline(budget / (fallbacks + 1))

    def _suspect(self, replica: Replica) -> None:
        """A replica's store did not answer within its share: read its other objects from elsewhere
        first for a while (it is still tried, last, where it is the only one left)."""
        with self._suspects_lock:
            self._suspects[replica.tcp_endpoint] = time.monotonic() + _SUSPECT_S

    def _unsuspected_first(self, replicas: Sequence[Replica]) -> list[Replica]:
        """``replicas`` (in read preference), those on stores suspected of hanging moved last."""
        if not self._suspects:
            return list(replicas)
        now = time.monotonic()
        with self._suspects_lock:
            for endpoint in [e for e, until in self._suspects.items() if until <= now]:
                del self._suspects[endpoint]
            suspects = set(self._suspects)
        return sorted(replicas, key=lambda r: r.tcp_endpoint in suspects)

    def _verify(self, code: ErrorCode, result: _Resolved, revalidated: bool = False) -> ErrorCode:
        """The transport checked the bytes against the checksum; the lease must still hold too, unless
        the store revalidated the read (it held exactly this object when it sent the bytes)."""
        if code == ErrorCode.CHECKSUM_MISMATCH:
            self._counters.add(checksum_mismatches=1)
        if code != ErrorCode.OK or revalidated:
            return code
        if self._clock.wall_ms() > result.lease_expiry_ms:
            # The lease ran out during the transfer: the object may have been evicted and its range
            # rewritten while we read it, so these bytes cannot be trusted even if the checksum matched.
            self._counters.add(lease_expired=1)
            return ErrorCode.LEASE_EXPIRED
        return ErrorCode.OK

    def _count_reads(self, codes: list[int]) -> None:
        ok = got = misses = 0
        for code in codes:
            if code >= 0:
                ok += 1
                got += code
            elif code == ErrorCode.OBJECT_NOT_FOUND:
                misses += 1
        self._counters.add(gets=ok, get_bytes=got, get_misses=misses, get_errors=len(codes) - ok - misses)
