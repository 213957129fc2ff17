"""A put whose BatchPutStart timed out at the client may still be carried out by the master later: the put
that asks again for the key must then be really stored, never acknowledged on the strength of that orphaned
start (OBJECT_NOT_READY counts as success) and then reclaimed."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from kvpool.common.errors import ErrorCode
from kvpool.tools.local_cluster import LocalCluster, ProcInfo
from tests.support.cluster import client, wait_for

pytestmark = pytest.mark.integration


@contextmanager
def stopped(proc: ProcInfo) -> Iterator[None]:
    """The process frozen (SIGSTOP): requests wait in its sockets until it runs again."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def test_a_put_asked_again_after_an_unanswered_start_is_stored_not_just_acknowledged(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(stores=1, store_size="4MiB")
    keys = [f"orphan-{i}" for i in range(4)]
    values = [os.urandom(8192) for _ in keys]
    with client(cluster.master) as pool:
        assert pool.batch_put(["warm"], [b"w" * 4096]) == [0]  # a pooled connection, like a busy client's
        with stopped(cluster.masters[0]):
            codes = pool.batch_put(keys, values, timeout=0.3)
        assert codes == [ErrorCode.TIMEOUT] * len(keys)
        # The master now runs the start that waited in its socket (and the revoke, if one got through): the
        # keys may be unfinished puts of this client that nobody writes. Asked again, each key must be stored
        # by the new put, not acknowledged because an unfinished put of it exists (OBJECT_NOT_READY).
        wait_for(lambda: pool.batch_put(keys, values, timeout=2.0) == [0] * len(keys), 20, "the puts to go through")
        assert pool.batch_get(keys) == values
        assert pool.batch_exists(keys) == [1] * len(keys)
