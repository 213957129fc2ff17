"""Revalidated reads (decision 0014) against ranges that are freed and reused all the time.

A reader re-reads every object once per pass, and its passes come further apart than a lease (1.2 s
leases, usable for 0.2 s), so nearly every read goes to the store from a hint. Meanwhile a writer
force-removes half of the objects every half second and puts new ones of the same size, which take over
exactly the freed ranges (best fit). Every value is a function of its key, so every read is
checked: a read - of a live object or of one removed since the reader's last pass - returns that key's
bytes or a miss, never another object's bytes, whichever way the race
between the store's inventory check, the reused range and the client's checksum goes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from kvpool.tools.local_cluster import LocalCluster
from kvpool.tools.workload import expected_value
from tests.support.cluster import FAST_MASTER, client

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

VALUE = 64 << 10
LIVE = 48  # objects alive at any time; the store holds 2x that
SECONDS = 4.0


def test_hinted_reads_never_return_another_objects_bytes(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(
        stores=1, store_size=str(2 * LIVE * VALUE), master_args=FAST_MASTER + ("--lease-ttl-s", "1.2")
    )
    keys = [f"gen0-{i}" for i in range(LIVE)]
    removed: list[str] = []  # read too: the reader's hints on them point at reused ranges
    wrong: list[str] = []
    reads = [0, 0]  # values read, misses
    stop = threading.Event()
    with client(cluster.master) as reader, client(cluster.master) as writer:
        assert writer.batch_put([*keys], [expected_value(k, VALUE) for k in keys]) == [0] * LIVE

        def read_loop() -> None:
            buf = bytearray(VALUE)
            while not stop.is_set():
                for key in keys + removed[-LIVE:]:
                    n = reader.get_into(key, buf)
                    if n == VALUE:
                        reads[0] += 1
                        if bytes(buf) != expected_value(key, VALUE):
                            wrong.append(key)
                    else:
                        reads[1] += 1
                stop.wait(0.7)  # past the entries' usable life: the next pass reads from hints

        thread = threading.Thread(target=read_loop, daemon=True)
        thread.start()
        generation = 0
        end = time.monotonic() + SECONDS
        try:
            while time.monotonic() < end:
                time.sleep(0.5)  # paces the generations of the writer: a load, not a wait for a state
                generation += 1
                for i in range(0, LIVE, 2):  # replace half of the objects, one by one
                    old, new = keys[i], f"gen{generation}-{i}"
                    assert writer.remove(old, force=True) == 0
                    assert writer.put(new, expected_value(new, VALUE)) == 0
                    keys[i] = new
                    removed.append(old)
        finally:
            stop.set()
            thread.join(10)
        assert not thread.is_alive()
        m = reader.metrics()
    assert wrong == [], f"{len(wrong)} reads returned another object's bytes"
    assert reads[0] > 0, reads
    assert m["revalidated_reads"] > 0, m
    assert m["revalidations_refused"] + m["checksum_mismatches"] > 0, m  # reused ranges were really hit
