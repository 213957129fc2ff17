"""The write path of ``PoolClient``: BatchPutStart (with its retries of keys refused for a demotion
backlog), the revoke of starts that went unanswered, writing every replica, and BatchPutEnd / revoke.

A mixin of ``PoolClient`` (pool_client.py), not a separate object: ``batch_put_from`` calls these methods,
which work on the client's master connection, transports, counters and unanswered puts. The attributes they
use are declared below and assigned by ``PoolClient.__init__``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvpool.client.call_parts import _Counters
from kvpool.client.group_router import GroupRouter
from kvpool.client.master_client import MasterClient
from kvpool.client.store_failures import StoreFailureReporter
from kvpool.client.unanswered_puts import UnansweredPuts
from kvpool.common.checksum import LazyChecksum
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode, KvPoolError, as_code
from kvpool.common.log import get_logger
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from kvpool.transfer.base import TransferRequest
from kvpool.transfer.registry import TransportSet

log = get_logger(__name__)

# Codes a put maps to success: the value is immutable and already there (or on its way).
_PUT_OK = {ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS, ErrorCode.OBJECT_NOT_READY}
_REVOKE_TIMEOUT_S = 1.0
"""Deadline of the revoke that follows an unanswered BatchPutStart (the put's own deadline has passed)."""
BACKLOG_FIRST_PAUSE_S = 0.001
BACKLOG_MAX_PAUSE_S = 0.01
"""Pauses before asking again for keys refused with DEMOTION_BACKLOG (PoolClient._start_puts)."""


class WritePathMixin:
    """The steps of a batch put after its buffers are checked (see the module docstring)."""

    client_id: str
    _master: MasterClient | GroupRouter
    _transports: TransportSet
    _counters: _Counters
    _unanswered: UnansweredPuts
    _store_failures: StoreFailureReporter

    def _start_puts(self, request: pb.BatchPutStartRequest, deadline: Deadline) -> pb.BatchPutStartResponse:
        """BatchPutStart. Keys refused with DEMOTION_BACKLOG (DRAM full of objects being demoted to an SSD
        tier: docs/ssd-tier.md) are asked for again after a pause that doubles each time, until the
        deadline; past it they keep that code (the put fails, counted as a put error)."""
        started: pb.BatchPutStartResponse = self._master.call(frames.Op.BATCH_PUT_START, request, deadline)
        pause = BACKLOG_FIRST_PAUSE_S
        while True:
            waiting = [i for i, r in enumerate(started.results) if r.code == ErrorCode.DEMOTION_BACKLOG]
            remaining = deadline.remaining()
            if not waiting or (remaining is not None and remaining <= pause):
                return started
            time.sleep(pause)
            pause = min(2 * pause, BACKLOG_MAX_PAUSE_S)
            again = pb.BatchPutStartRequest(
                keys=[request.keys[i] for i in waiting],
                sizes=[request.sizes[i] for i in waiting],
                client_id=request.client_id,
                config=request.config,
            )
            self._counters.add(put_backlog_retries=len(waiting))
            try:
                answer = self._master.call(frames.Op.BATCH_PUT_START, again, deadline)
            except KvPoolError as exc:  # the deadline ran out during the retry: those keys keep saying why
                self._revoke_unanswered(again.keys, exc)
                return started
            for i, result in zip(waiting, answer.results, strict=True):
                started.results[i].CopyFrom(result)

    def _revoke_unanswered(self, keys: Sequence[str], exc: KvPoolError) -> None:
        """A BatchPutStart whose answer did not come before the deadline may still have been carried out:
        its keys would stay unfinished puts of this client that nobody writes, and a later put of them would
        be answered OBJECT_NOT_READY (counted as success) until the master reclaims them after put_timeout_s:
        an acknowledged put lost. Revoke them (the master leaves keys this client did not start alone). The
        master answers requests one at a time, so the revoke, sent after the start, normally finds it done."""
        if exc.code == ErrorCode.TIMEOUT:  # not when refused, or unreachable (a new leader knows no such put)
            self._abandon(keys)

    def _abandon(self, keys: Sequence[str]) -> None:
        """Revoke puts this client may have started and will not write, and remember them: the revoke may
        fail or overtake the start (client/unanswered_puts.py)."""
        self._unanswered.note(keys)
        try:
            self._revoke(keys, Deadline(_REVOKE_TIMEOUT_S))
        except KvPoolError as revoke_exc:
            log.debug("revoking %d unanswered puts failed (%s): a later put of them does", len(keys), revoke_exc)

    def _revoke(self, keys: Sequence[str], deadline: Deadline) -> None:
        self._master.call(
            frames.Op.BATCH_PUT_REVOKE,
            pb.BatchPutRevokeRequest(client_id=self.client_id, keys=list(keys)),
            deadline,
        )

    def _retake_unanswered(
        self, request: pb.BatchPutStartRequest, started: pb.BatchPutStartResponse, deadline: Deadline
    ) -> None:
        """Keys answered OBJECT_NOT_READY that an unanswered start of this client may hold: revoke them and
        ask again, so that the answer is about a put that someone will finish (raises KvPoolError)."""
        stale = [
            i
            for i, r in enumerate(started.results)
            if self._unanswered.forget(request.keys[i]) and r.code == ErrorCode.OBJECT_NOT_READY
        ]
        if not stale:
            return
        keys = [request.keys[i] for i in stale]
        self._revoke(keys, Deadline(max(deadline.remaining() or 0.0, _REVOKE_TIMEOUT_S)))
        again = pb.BatchPutStartRequest(
            keys=keys, sizes=[request.sizes[i] for i in stale], client_id=request.client_id, config=request.config
        )
        answer = self._start_puts(again, deadline)
        for i, result in zip(stale, answer.results, strict=True):
            started.results[i].CopyFrom(result)

    def _write_all(self, transfers: list[tuple[int, TransferRequest]], deadline: Deadline) -> dict[int, ErrorCode]:
        """Write every replica; a key's code is its first failure (all replicas must land)."""
        outcome: dict[int, ErrorCode] = {}
        results = self._transports.transfer([t for _, t in transfers], deadline)
        self._store_failures.note([t for _, t in transfers], results)
        for (i, _), code in zip(transfers, results, strict=True):
            if outcome.get(i, ErrorCode.OK) == ErrorCode.OK:
                outcome[i] = code
        return outcome

    def _finish_puts(
        self,
        keys: Sequence[str],
        results: Any,
        written: dict[int, ErrorCode],
        sums: list[LazyChecksum],
        codes: list[int],
        deadline: Deadline,
    ) -> None:
        done = [i for i, code in written.items() if code == ErrorCode.OK]
        failed = [i for i, code in written.items() if code != ErrorCode.OK]
        for i in failed:
            codes[i] = int(written[i])
        # PutEnd/PutRevoke get their own short deadline: a put whose data landed must not be lost
        # because the transfers used up the caller's budget.
        finish = Deadline(max(deadline.remaining() or 0.0, 1.0))
        if done:
            try:
                resp = self._master.call(
                    frames.Op.BATCH_PUT_END,
                    pb.BatchPutEndRequest(
                        client_id=self.client_id,
                        keys=[keys[i] for i in done],
                        checksums=[sums[i].value for i in done],
                    ),
                    finish,
                )
                for i, code in zip(done, resp.codes, strict=True):
                    codes[i] = 0 if not code or as_code(code) in _PUT_OK else int(code)
            except KvPoolError as exc:
                for i in done:
                    codes[i] = int(exc.code)
        if failed:
            try:
                self._master.call(
                    frames.Op.BATCH_PUT_REVOKE,
                    pb.BatchPutRevokeRequest(client_id=self.client_id, keys=[keys[i] for i in failed]),
                    finish,
                )
            except KvPoolError as exc:  # the master reclaims abandoned puts after put_timeout
                log.warning("put revoke failed (%s); the master will reclaim the space", exc)
