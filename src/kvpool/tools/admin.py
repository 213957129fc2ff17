"""``kvpool-admin``: inspect and operate a running cluster.

    kvpool-admin status            cluster summary: leader, stores, DRAM and SSD capacity and use, hit rate
    kvpool-admin nodes             one line per node (segments, status, DRAM and SSD capacity and use, objects)
    kvpool-admin stats             the master's counters (with the SSD tier's: demotions, drops, backlog)
    kvpool-admin leader            the serving master, its view, and every live master with its state
    kvpool-admin evict [--prefix P] [--force]   remove objects (all, or one namespace)
    kvpool-admin drain NODE [--wait] [--timeout S]   move NODE's objects away (DRAINING -> DRAINED)
    kvpool-admin undrain NODE      cancel a drain (or a scale-in's tombstone)
    kvpool-admin scale-in NODE     drain, wait, unmount NODE's segments (the store may stop)
    kvpool-admin rebalance [--max-moves N]   even out used fractions after a scale-out
    kvpool-admin drain-status [NODE]          drain jobs and their progress

The cluster is found from ``--master`` or ``KVPOOL_MASTER`` (``host:port`` or ``etcd://...``), like the
client. Every command prints a table, or one JSON object with ``--json``. Exit codes: 0 ok, 1 the
operation failed, 2 the cluster could not be reached or the arguments are wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.common import envs
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.units import format_size
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from kvpool.tools import admin_ops
from kvpool.tools.argtypes import positive_float

_STATUS_NAMES = {pb.SEGMENT_OK: "OK", pb.SEGMENT_DRAINING: "DRAINING", pb.SEGMENT_DRAINED: "DRAINED"}


def _client_config(args: argparse.Namespace) -> Any:
    from kvpool.client.config import ClientConfig

    master = args.master or envs.KVPOOL_MASTER.get()
    if not master:
        raise KvPoolError(
            ErrorCode.INVALID_ARGUMENT, "no cluster: pass --master, set KVPOOL_MASTER or start one with kvpool local up"
        )
    return ClientConfig(master=master, token_file=args.token_file, cluster=args.cluster)


def _client(args: argparse.Namespace) -> Any:
    """The cluster's master link: with several shard groups, a router whose stats and evict cover them all."""
    from kvpool.client.group_router import connect_master

    return connect_master(_client_config(args))


def _group_client(args: argparse.Namespace, group: int, groups: int) -> Any:
    """Group ``group``'s own master link (the operations that move data run once per group)."""
    from kvpool.client.master_client import MasterClient
    from kvpool.common.groups import group_scope

    cfg = _client_config(args)
    scope = group_scope(cfg.cluster, group, groups)
    return MasterClient(cfg.master, token_file=cfg.token_file, cluster=scope, group=(group, groups))


def _per_group(op: admin_ops.Command, args: argparse.Namespace) -> int:
    """Run a data-moving operation in every shard group, one after another; one document with a part
    per group (``{"groups": [{"group": g, ...}, ...]}``), and the worst exit code."""
    from kvpool.client.group_router import cluster_groups

    groups = cluster_groups(_client_config(args))
    if groups == 1:
        return op(args, _client)
    codes: list[int] = []
    outputs: list[str] = []
    for group in range(groups):
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured):
            codes.append(op(args, functools.partial(_group_client, group=group, groups=groups)))
        outputs.append(captured.getvalue().strip())
    if args.json:
        parts = [{"group": g, **_json_or_text(text)} for g, text in enumerate(outputs)]
        print(json.dumps({"groups": parts}))
    else:
        print("\n".join(f"group {g}:\n{text}" for g, text in enumerate(outputs)))
    return max(codes)


def _json_or_text(text: str) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except ValueError:
        return {"output": text}
    return doc if isinstance(doc, dict) else {"output": doc}


def _stats(args: argparse.Namespace) -> pb.StatsResponse:
    with contextlib.closing(_client(args)) as master:
        stats: pb.StatsResponse = master.call(frames.Op.GET_STATS, pb.StatsRequest(), Deadline(args.timeout))
    return stats


def nodes_doc(stats: pb.StatsResponse) -> dict[str, Any]:
    by_node: dict[str, list[pb.SegmentInfo]] = defaultdict(list)
    for seg in stats.segments:
        by_node[seg.node].append(seg)
    nodes = []
    for node, segs in sorted(by_node.items()):
        states = {_STATUS_NAMES.get(s.status, "UNKNOWN") for s in segs}
        nodes.append(
            {
                "node": node,
                "segments": len(segs),
                "status": states.pop() if len(states) == 1 else "MIXED",
                "capacity": sum(s.size for s in segs if not s.tier),
                "used": sum(s.used for s in segs if not s.tier),
                "ssd_capacity": sum(s.size for s in segs if s.tier),
                "ssd_used": sum(s.used for s in segs if s.tier),
                "objects": sum(s.objects for s in segs),
            }
        )
    return {"nodes": nodes}


TIER_STATS = (
    "ssd_capacity_bytes",
    "ssd_used_bytes",
    "demotions",
    "demoted_bytes",
    "demote_failures",
    "demote_pending_bytes",
    "promotions",
    "promote_failures",
    "dram_dropped",
    "dram_dropped_urgent",
    "burst_dropped",
    "burst_dropped_bytes",
    "puts_backpressured",
    "ssd_evictions",
    "ssd_evicted_bytes",
    "tier_tasks_pending",
    "tier_tasks_expired",
    "ssd_read_granted_bytes",
    "ssd_write_bps",
    "ssd_read_bps",
)
"""The SSD tier's figures in ``StatsResponse.extra`` (master/tier_service.py), shown by ``stats``."""


def _tier_doc(s: pb.StatsResponse) -> dict[str, int]:
    """The SSD tier's figures (DRAM and SSD are shown apart: ``capacity``/``used`` are DRAM only)."""
    return {name: int(s.extra.get(name, 0)) for name in TIER_STATS}


def _tier_lines(d: dict[str, Any]) -> str:
    if not d["ssd_capacity_bytes"]:
        return ""
    return (
        f"\nSSD       {format_size(d['ssd_capacity_bytes'])}, used {format_size(d['ssd_used_bytes'])} "
        f"({d['ssd_used_bytes'] / d['ssd_capacity_bytes']:.1%})\n"
        f"tiering   {d['demotions']} demoted, {d['promotions']} promoted, {d['dram_dropped']} dropped "
        f"({d['burst_dropped']} in bursts), "
        f"backlog {format_size(d['demote_pending_bytes'])}\n"
        f"SSD I/O   write {d['ssd_write_bps'] / 1e9:.3f} GB/s, read {d['ssd_read_bps'] / 1e9:.3f} GB/s"
    )


def cmd_status(args: argparse.Namespace) -> int:
    s = _stats(args)
    lookups = s.hits + s.misses
    doc = {
        "leader": s.leader,
        "role": s.role,
        "stores": len({seg.store_id for seg in s.segments}),
        "segments": len(s.segments),
        "capacity": s.capacity,
        "used": s.used,
        "objects": s.objects,
        "hit_rate": s.hits / lookups if lookups else 0.0,
        "evictions": s.evictions,
        **_tier_doc(s),
    }
    _emit(
        args,
        doc,
        lambda d: (
            f"leader    {d['leader']} ({d['role']})\nstores    {d['stores']} ({d['segments']} segments)\n"
            f"capacity  {format_size(d['capacity'])}, used {format_size(d['used'])} "
            f"({d['used'] / d['capacity'] if d['capacity'] else 0:.1%})\nobjects   {d['objects']}\n"
            f"hit rate  {d['hit_rate']:.1%}\nevicted   {d['evictions']} objects" + _tier_lines(d)
        ),
    )
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    doc = nodes_doc(_stats(args))

    def table(d: dict[str, Any]) -> str:
        lines = [
            f"{'NODE':<24} {'SEGS':>4} {'STATUS':<9} {'CAPACITY':>11} {'USED':>11} "
            f"{'SSD':>11} {'SSD USED':>11} {'OBJECTS':>9}"
        ]
        for n in d["nodes"]:
            lines.append(
                f"{n['node']:<24} {n['segments']:>4} {n['status']:<9} {format_size(n['capacity']):>11} "
                f"{format_size(n['used']):>11} {format_size(n['ssd_capacity']):>11} "
                f"{format_size(n['ssd_used']):>11} {n['objects']:>9}"
            )
        return "\n".join(lines)

    _emit(args, doc, table)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    s = _stats(args)
    doc = {
        name: getattr(s, name)
        for name in (
            "objects",
            "capacity",
            "used",
            "hits",
            "misses",
            "evictions",
            "evicted_bytes",
            "puts",
            "reclaimed_puts",
        )
    }
    doc.update(_tier_doc(s))
    _emit(args, doc, lambda d: "\n".join(f"{k:<16} {v}" for k, v in d.items()))
    return 0


def cmd_leader(args: argparse.Namespace) -> int:
    master = args.master or envs.KVPOOL_MASTER.get()
    if master.startswith("etcd://"):
        # Straight from etcd: works while no master serves (during a failover), unlike the stats RPC.
        from kvpool.master.ha import leader_summary

        doc = leader_summary(master.removeprefix("etcd://"), args.cluster)
    else:
        s = _stats(args)
        doc = {
            "leader": s.leader,
            "view": s.status.view,
            "followers": list(s.followers),
            "masters": [{"grpc": m.grpc, "state": m.state} for m in s.masters],
        }
    _emit(args, doc, _leader_text)
    return 0


def _leader_text(doc: dict[str, Any]) -> str:
    """The leader, then every live master with its state (leader, warming_up, standby) on a line each;
    with shard groups, that for each group."""
    if "groups" in doc:
        return "\n".join(f"group {g['group']}: " + _leader_text(g) for g in doc["groups"])
    lines = [f"leader {doc['leader']} (view {doc['view']})", f"followers {', '.join(doc['followers']) or '-'}"]
    if doc.get("masters"):
        lines.append("masters")
        lines.extend(f"  {m['grpc']:<24} {m['state']}" for m in doc["masters"])
    return "\n".join(lines)


def cmd_evict(args: argparse.Namespace) -> int:
    with contextlib.closing(_client(args)) as master:
        response = master.call(
            frames.Op.REMOVE_ALL,
            pb.RemoveAllRequest(force=args.force, prefix=args.prefix),
            Deadline(args.timeout),
        )
    doc = {"removed": response.removed, "prefix": args.prefix}
    _emit(args, doc, lambda d: f"removed {d['removed']} objects")
    return 0


def _emit(args: argparse.Namespace, doc: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> None:
    print(json.dumps(doc) if args.json else render(doc))


COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "status": (cmd_status, "cluster summary"),
    "nodes": (cmd_nodes, "nodes and their segments"),
    "stats": (cmd_stats, "master counters"),
    "leader": (cmd_leader, "the serving master, its view and every live master's state"),
    "evict": (cmd_evict, "remove objects (all, or those whose key starts with --prefix)"),
}


def _add_common(parser: argparse.ArgumentParser, suppress: bool, call_timeout: bool = True) -> None:
    """Options accepted before and after the command name (``kvpool-admin nodes --json`` both ways).
    ``call_timeout=False``: the command's own ``--timeout`` is how long it waits (drain, scale-in, ...)."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument("--master", default=default(""), help="master address (default: KVPOOL_MASTER)")
    parser.add_argument("--cluster", default=default(envs.KVPOOL_CLUSTER.get()), help="cluster name (etcd key prefix)")
    parser.add_argument("--token-file", default=default(""), help="cluster token file (default: KVPOOL_TOKEN_FILE)")
    if call_timeout:
        parser.add_argument("--timeout", type=positive_float, default=default(10.0), help="seconds per call")
    parser.add_argument("--json", action="store_true", default=default(False), help="print one JSON object")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool-admin", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_common(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (func, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        _add_common(p, suppress=True)
        if name == "evict":
            p.add_argument("--prefix", default="", help="only keys starting with this")
            p.add_argument("--force", action="store_true", help="also remove leased and pinned objects")
        p.set_defaults(func=func)
    for name, (op, help_text) in admin_ops.COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        _add_common(p, suppress=True, call_timeout=name not in admin_ops.WAITING)
        admin_ops.add_arguments(name, p)
        p.set_defaults(func=lambda a, _op=op: _per_group(_op, a))
    return parser


_UNREACHABLE = frozenset(
    {
        ErrorCode.INVALID_ARGUMENT,
        ErrorCode.ETCD_ERROR,
        ErrorCode.SEGMENT_NOT_FOUND,
        ErrorCode.JOB_NOT_FOUND,
        *admin_ops.TRANSIENT,
    }
)
"""Failures that mean "could not talk to the cluster" or "bad arguments" (no such node or job): exit 2.
Every other failure is the operation's (exit 1)."""


def _default_to_local_cluster(args: argparse.Namespace) -> None:
    """No --master and no KVPOOL_MASTER: the running `kvpool local up` cluster, said in one line."""
    if args.master or envs.KVPOOL_MASTER.get():
        return
    from kvpool.common import local_context

    context = local_context.current()
    if context is None:
        return
    args.master = context.master
    if not args.token_file and not envs.KVPOOL_TOKEN_FILE.get():
        args.token_file = context.token_file
    if context.cluster and args.cluster == "kvpool":
        args.cluster = context.cluster
    print(f"kvpool-admin: {context.describe()}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _default_to_local_cluster(args)
    try:
        return int(args.func(args))
    except KvPoolError as exc:
        print(f"kvpool-admin: {exc}", file=sys.stderr)
        return 2 if exc.code in _UNREACHABLE else 1


if __name__ == "__main__":
    raise SystemExit(main())
