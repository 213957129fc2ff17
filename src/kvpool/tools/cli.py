"""``kvpool``: run a master or a store, a local cluster, the demo and the benchmarks.

kvpool master [--port 50051] [--etcd h1:p1,...]     one master (or an HA replica)
kvpool store --master ADDR --size 4GiB              one store (one per NUMA node)
kvpool local up|status|down                         a whole cluster as local processes
kvpool demo                                         local cluster + an agent workload, then stop
kvpool bench transfer|trace|...                     benchmarks (print ratios to this machine's ceilings)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvpool.common import config as cfg
from kvpool.common import envs
from kvpool.common.errors import KvPoolError
from kvpool.common.log import setup_logging
from kvpool.tools.argtypes import non_negative_int, positive_float, positive_int, size

# name -> (module, help); each module has add_arguments(parser) and run(args) -> int.
BENCHES: dict[str, tuple[str, str]] = {
    "transfer": ("kvpool.tools.bench_transfer", "put/get GB/s against the raw loopback TCP ceiling"),
    "trace": (
        "kvpool.tools.bench_trace_pool",
        "replay a Mooncake trace: pool vs private caches vs oracle hit rate",
    ),
    "placement": ("kvpool.tools.bench_placement", "allocator utilisation; how fast a new store fills up"),
    "prefetch": ("kvpool.tools.bench_prefetch", "prefetch hidden behind compute; engine-thread latency"),
    "failover": (
        "kvpool.tools.bench_failover",
        "kill the leader master under load: recovery time and objects kept",
    ),
    "metadata": (
        "kvpool.tools.bench_metadata",
        "master hot path: exists/prefix/get-replicas rates, framed vs gRPC",
    ),
    "master-memory": (
        "kvpool.tools.bench_metadata:memory",
        "master RSS per object at N objects, lookup speed",
    ),
    "batch": ("kvpool.tools.bench_batch", "one call of 100,000 keys of 4 KiB, put and get, vs chunks by hand"),
    "soak": (
        "kvpool.tools.bench_soak",
        "client processes, mixed checked workload, a store restart: errors, RSS",
    ),
    "ssd": (
        "kvpool.tools.bench_ssd",
        "SSD tier: demotion, burst kept fraction and SSD reads against the disk's direct bandwidth",
    ),
}
BENCHES["eviction"] = (
    "kvpool.tools.bench_eviction",
    "master put p50/p99 with the pool full and evicting vs free; eviction work per freed object",
)
BENCHES["serve"] = (
    "kvpool.tools.bench_serve",
    "replay a trace over N prefill instances: TTFT and goodput under an SLO, no cache/private/pool",
)


def _cmd_master(args: argparse.Namespace) -> int:
    from kvpool.master.config import MasterConfig
    from kvpool.master.run import serve

    setup_logging("master")
    return serve(cfg.from_args(MasterConfig, args), args.ready_file)


def _cmd_store(args: argparse.Namespace) -> int:
    from kvpool.store.config import StoreConfig
    from kvpool.store.service import serve

    setup_logging("store")
    return serve(cfg.from_args(StoreConfig, args), args.ready_file)


def _cmd_local(args: argparse.Namespace) -> int:
    from kvpool.tools import local_cluster as lc

    base = Path(args.dir) if args.dir else lc.default_dir()
    if args.action == "up":
        return _local_up(args, base)
    if args.action == "status":
        doc = lc.load_status(base)
        if args.json:
            print(json.dumps(doc))
        else:
            print(f"master {doc['master']}  (dir {base})")
            for p in doc["processes"]:
                state = "up" if p["alive"] else "DEAD"
                print(f"  {p['role']:<7} pid {p['pid']:<8} {p['address']:<22} {p['node']:<16} {state}")
        return 0
    pids = lc.down(base)
    from kvpool.common import local_context

    local_context.clear(str(base))
    print(json.dumps({"stopped": pids}) if args.json else f"stopped {len(pids)} processes")
    return 0


def _local_up(args: argparse.Namespace, base: Path) -> int:
    """Start a fresh local cluster (or one keeping its state), return once it serves, and make it the
    tools' default cluster (common/local_context.py)."""
    from kvpool.common import local_context
    from kvpool.tools import local_cluster as lc

    if (base / "cluster.json").exists() and any(p["alive"] for p in lc.load_status(base)["processes"]):
        print(f"a local cluster is already running in {base} (kvpool local down first)", file=sys.stderr)
        return 1
    if not args.keep_state:
        lc.reset_state(base)
    if args.stores == 0:
        print("kvpool local: WARNING: --stores 0: no store, so nothing can be stored until one joins", file=sys.stderr)
    cluster = lc.LocalCluster(
        stores=args.stores,
        store_size=args.size,
        base_dir=base,
        ha=args.ha,
        master_args=tuple(args.master_arg),
        store_args=tuple(args.store_arg),
        token_file=args.token_file,
        groups=args.groups,
        masters=args.masters,
    ).start()
    try:
        kept = lc.kept_state(cluster) if args.keep_state else {}
        lc.wait_serving(cluster.master, cluster.token_file, can_store=args.stores > 0, timeout=args.ready_timeout)
    except BaseException:
        cluster.stop()
        raise
    local_context.write(
        local_context.LocalContext(
            master=cluster.master,
            directory=str(base),
            token_file=cluster.token_file,
            cluster=cluster.cluster,
            master_pids=[p.pid for p in cluster.masters],
        )
    )
    doc = {**cluster.status(), "kept": kept}
    if args.json:
        print(json.dumps(doc))
        return 0
    print(f"kvpool local cluster up in {base}")
    for p in doc["processes"]:
        print(f"  {p['role']:<7} pid {p['pid']:<8} {p['address']}  {p['node']}")
    if args.keep_state:
        what = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in kept.items())
        print(f"kept the state of the last run ({what or 'nothing was stored'})")
    print(f"\nkvpool-admin and PoolClient.from_env() use this cluster; or:  export KVPOOL_MASTER={doc['master']}")
    if args.token_file:
        print(f"               export KVPOOL_TOKEN_FILE={Path(args.token_file).resolve()}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvpool.tools.demo import run

    return run(args)


def _bench_entry(
    name: str,
) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
    """(add_arguments, run) of a benchmark: "module" or "module:variant" (add_<variant>_arguments, run_<variant>)."""
    import importlib

    module_name, _, variant = BENCHES[name][0].partition(":")
    module = importlib.import_module(module_name)
    if variant:
        return getattr(module, f"add_{variant}_arguments"), getattr(module, f"run_{variant}")
    return module.add_arguments, module.run


def _cmd_bench(args: argparse.Namespace) -> int:
    return int(_bench_entry(args.bench)[1](args))


def build_parser() -> argparse.ArgumentParser:
    from kvpool.master.config import MasterConfig
    from kvpool.store.config import StoreConfig

    parser = argparse.ArgumentParser(
        prog="kvpool", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    master = sub.add_parser("master", help="run a master")
    cfg.add_arguments(master, MasterConfig)
    master.add_argument("--ready-file", default="", help=argparse.SUPPRESS)
    master.set_defaults(func=_cmd_master)

    store = sub.add_parser("store", help="run a store")
    cfg.add_arguments(store, StoreConfig)
    store.add_argument("--ready-file", default="", help=argparse.SUPPRESS)
    store.set_defaults(func=_cmd_store)

    local = sub.add_parser("local", help="a local multi-process cluster")
    local.add_argument("action", choices=("up", "status", "down"))
    local.add_argument("--stores", type=non_negative_int, default=2, help="stores to start (default 2)")
    local.add_argument("--size", type=size, default="512MiB", help="segment size of each store (default 512MiB)")
    local.add_argument("--ha", action="store_true", help="start etcd and 3 masters")
    local.add_argument(
        "--groups",
        type=positive_int,
        default=1,
        help="shard groups (with --ha; decision 0080): each group elects its own leader among its masters",
    )
    local.add_argument("--masters", type=positive_int, default=3, help="masters per shard group with --ha (default 3)")
    local.add_argument("--dir", default="", help="cluster directory (default: a per-user temp dir)")
    local.add_argument("--json", action="store_true", help="print JSON")
    local.add_argument("--master-arg", action="append", default=[], help="extra argument for each master")
    local.add_argument("--store-arg", action="append", default=[], help="extra argument for each store")
    local.add_argument(
        "--token-file",
        default="",
        help="require this cluster token on every plane (masters and stores get it; clients read KVPOOL_TOKEN_FILE)",
    )
    local.add_argument(
        "--keep-state",
        action="store_true",
        help="keep the last run's state (etcd: drains, cluster config) instead of starting fresh; says what it kept",
    )
    local.add_argument(
        "--ready-timeout", type=positive_float, default=120.0, help="seconds `up` waits for a put and a get to work"
    )
    local.set_defaults(func=_cmd_local)

    from kvpool.tools import demo

    demo_parser = sub.add_parser("demo", help="run an agent workload on a local cluster and print hit rates")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=_cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (_module, help_text) in BENCHES.items():
        bench_parser = bench_sub.add_parser(name, help=help_text)
        _bench_entry(name)[0](bench_parser)
        bench_parser.set_defaults(func=_cmd_bench)

    env = sub.add_parser("env", help="list the environment variables kvpool reads")
    env.set_defaults(func=lambda a: _print_env())
    return parser


def _print_env() -> int:
    for var in envs.ALL:
        print(f"{var.name:<26} {var.doc} (default {var.default!r})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KvPoolError as exc:
        print(f"kvpool: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
