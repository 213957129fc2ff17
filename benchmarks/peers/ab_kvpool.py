#!/usr/bin/env python3
"""A/B of two kvpool client sources against one cluster: the peer workloads of ``_workload.py`` run by
``kvpool_worker.py`` processes importing kvpool from ``--base-src`` and from ``--new-src`` in turn (the
order alternates every round, after one untimed pass that faults in the store's memory), so that both meet
the same cluster and the same background load.

    git archive <commit> src | tar -x -C /tmp/base     # plus the built .so files of src/, copied alike
    .venv/bin/python benchmarks/peers/ab_kvpool.py --base-src /tmp/base/src [--rounds 4] [--seconds 1]

The cluster (one store) runs from the kvpool this script imports; with ``--whole`` each side gets a
cluster of its own, started from its own source (master and store included), so that a change to the
store or the master is measured too. ``--workloads x128`` runs only the workloads whose label contains
one of the given strings. Prints, per workload, the median GB/s of each side, its samples and new/base.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
KiB, MiB = 1 << 10, 1 << 20
# (op, value size, keys per call)
WORKLOADS = (
    ("get_first", 64 * KiB, 1),
    ("get_bytes", 64 * KiB, 1),
    ("get_bytes", 1 * MiB, 1),
    ("get_bytes", 4 * MiB, 1),
    ("get_first", 1 * MiB, 1),
    ("get_first", 4 * MiB, 1),
    ("get_first", 64 * KiB, 128),
    ("put", 64 * KiB, 1),
    ("put", 64 * KiB, 128),
    ("get", 64 * KiB, 128),
)


def label(op: str, size: int, batch: int) -> str:
    return f"{op} {size // KiB}KiB x{batch}"


def run_worker(
    src: str, master: str, ns: str, seconds: float, workloads: tuple[tuple[str, int, int], ...] = WORKLOADS
) -> list[dict[str, Any]]:
    # The re-read rows (op "get") read a data set of 64 MiB per value size, written once per worker.
    sizes = sorted({size for op, size, _ in workloads if op == "get"})
    spec: list[dict[str, Any]] = [
        {"cmd": "prepare", "ns": ns, "sizes": sizes, "dataset_bytes": 64 * MiB if sizes else 0, "exists_keys": 10}
    ]
    if sizes:  # read once, untimed: the timed reads are re-reads, as in run.py
        spec.append({"cmd": "warm", "fill_bytes": 0})
    spec += [
        {"cmd": "run", "op": op, "size": size, "batch": batch, "seconds": seconds, "min_calls": 3}
        for op, size, batch in workloads
    ]
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run(
        [sys.executable, str(HERE / "kvpool_worker.py"), "--master", master, "--spec", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    if out.returncode or not all(a.get("ok") for a in answers):
        raise RuntimeError(f"worker of {src} failed:\n{out.stderr[-2000:]}")
    return answers[len(spec) - len(workloads) + 1 :]  # after the ready line and the untimed answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--base-src", required=True, help="the src/ directory of the base kvpool")
    parser.add_argument("--new-src", default=str(HERE.parents[1] / "src"), help="default: this checkout's src/")
    parser.add_argument("--rounds", type=int, default=4, help="an even number gives each side the first turn as often")
    parser.add_argument("--seconds", type=float, default=1.0, help="timed seconds per workload per round")
    parser.add_argument(
        "--workloads",
        default="",
        help="comma-separated substrings: only the workloads whose label (e.g. "
        "'get_first 64KiB x128') contains one of them",
    )
    parser.add_argument("--whole", action="store_true", help="a cluster per side, run from that side's source")
    args = parser.parse_args(argv)
    if args.rounds < 1 or not args.seconds > 0:
        parser.error("--rounds must be >= 1 and --seconds > 0")
    from kvpool.tools.local_cluster import LocalCluster

    wanted = [w.strip() for w in args.workloads.split(",") if w.strip()]
    workloads = tuple(w for w in WORKLOADS if not wanted or any(x in label(*w) for x in wanted))
    if not workloads:
        parser.error(f"no workload matches {args.workloads!r}")
    sides = {"base": args.base_src, "new": args.new_src}
    samples: dict[tuple[str, int, int, str], list[float]] = {}
    with ExitStack() as stack:
        masters: dict[str, str] = {}
        for side in ("base", "new") if args.whole else ("new",):
            env = {"PYTHONPATH": sides[side]} if args.whole else None
            base_dir = Path(tempfile.mkdtemp(prefix=f"kvpool-ab-{side}-"))
            cluster = stack.enter_context(LocalCluster(stores=1, store_size="768MiB", base_dir=base_dir, env=env))
            masters[side] = cluster.master
            run_worker(sides[side], cluster.master, "warm", args.seconds / 4, workloads)  # pages faulted in, untimed
        for rnd in range(args.rounds):
            for side in ("base", "new") if rnd % 2 == 0 else ("new", "base"):
                master = masters.get(side, masters["new"])
                rows = run_worker(sides[side], master, f"{side}{rnd}", args.seconds, workloads)
                for (op, size, batch), row in zip(workloads, rows, strict=True):
                    samples.setdefault((op, size, batch, side), []).append(row["gbps"])
    clusters = "a cluster per side" if args.whole else "one cluster"
    print(f"load average now {os.getloadavg()[0]:.2f}; {clusters}; GB/s, medians of {args.rounds} rounds")
    for op, size, batch in workloads:
        base, new = samples[(op, size, batch, "base")], samples[(op, size, batch, "new")]
        ratio = statistics.median(new) / statistics.median(base)
        print(
            f"{op:<10} {size // KiB:>5} KiB x{batch:<4} base {statistics.median(base):.3f} {base}  "
            f"new {statistics.median(new):.3f} {new}  new/base {ratio:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
