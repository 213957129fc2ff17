"""Master memory per object at up to 10 M objects, in process:
`python benchmarks/master_memory_inprocess.py [--objects 10000000] [--path put|feed] [--json]`.

`kvpool bench master-memory` fills a real master process over the framed protocol, which takes about
40 min for 10 M objects on a loaded 2-core machine; this fills the same core (`MasterState`, the index a
master and each warm standby hold) directly, with the same HiCache keys (64 hex chars plus a rank
suffix), 4 KiB objects on one segment and 64-bit checksums, and reports the process's RSS growth per
object at each checkpoint. ``--path put``: put_start + put_end, as a leader indexes new objects;
``--path feed``: a warm standby's `StandbyIndex` applying store feed deltas of 50,000 commits (the
adoption a re-mount does too; about 3x faster). The keys exist only in the index (each batch's list is
dropped after use), so they are counted, as in the master.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

from kvpool.common.clock import SYSTEM_CLOCK
from kvpool.master.config import MasterConfig
from kvpool.master.standby import StandbyIndex
from kvpool.master.state import MasterState
from kvpool.master.types import InventoryItem, SegmentSpec
from kvpool.tools.bench_metadata import OBJECT_BYTES, hicache_key

BATCH = 1000
FEED_BATCH = 50_000


def checksum_of(i: int) -> int:
    return (i * 0x9E3779B97F4A7C15 + 1) & 0xFFFF_FFFF_FFFF_FFFF  # a full 64-bit int, as on the wire


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fill(state: MasterState, start: int, stop: int) -> None:
    for first in range(start, stop, BATCH):
        numbers = range(first, min(stop, first + BATCH))
        keys = [hicache_key(i) for i in numbers]
        started = state.put_start("bench", keys, [OBJECT_BYTES] * len(keys))
        assert all(r.code == 0 for r in started), started[0]
        state.put_end("bench", keys, [checksum_of(i) for i in numbers])


def feed(standby: StandbyIndex, epoch: str, start: int, stop: int) -> None:
    for first in range(start, stop, FEED_BATCH):
        changes = [
            (InventoryItem(hicache_key(i), i * OBJECT_BYTES, OBJECT_BYTES, checksum_of(i)), False)
            for i in range(first, min(stop, first + FEED_BATCH))
        ]
        result = standby.delta("bench", 1, epoch, changes)
        assert result.code == 0, result
        assert result.adopted == len(changes), result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--objects", type=int, default=10_000_000)
    parser.add_argument("--path", choices=("put", "feed"), default="put")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # Eviction never runs here (no maintenance loop), and leases are not taken: every object stays.
    state = MasterState(MasterConfig(), SYSTEM_CLOCK)
    spec = SegmentSpec(
        id=1,
        node="bench",
        store_id="bench",
        size=args.objects * OBJECT_BYTES * 2,
        tcp_endpoint="127.0.0.1:9",
        shm_path="",
        secret=b"\x01" * 32,
    )
    standby = StandbyIndex(state, lambda: True)
    if args.path == "feed":
        synced = standby.sync(spec, [])
        assert synced.code == 0, synced
    else:
        assert state.mount_segment(spec, [], False).code == 0
    gc.collect()
    base = rss_bytes()
    checkpoints = sorted(
        {
            n
            for n in (1_000_000, 2_000_000, 3_000_000, 4_000_000, 5_000_000, 7_000_000, args.objects)
            if n <= args.objects
        }
    )
    rows = []
    done = 0
    started = time.perf_counter()
    for target in checkpoints:
        if args.path == "feed":
            feed(standby, standby.epoch, done, target)
        else:
            fill(state, done, target)
        done = target
        gc.collect()
        grown = rss_bytes() - base
        rows.append(
            {
                "objects": done,
                "rss_growth_bytes": grown,
                "bytes_per_object": grown / done,
                "seconds": time.perf_counter() - started,
            }
        )
        print(f"{done:>11,} objects: {grown / done:6.1f} B/object", file=sys.stderr)
    assert state.stats().objects == args.objects
    doc = {"path": args.path, "rows": rows, "rss_bytes": rss_bytes(), "target_bytes_per_object": 400}
    print(json.dumps(doc) if args.json else "\n".join(str(r) for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
