"""``kvpool-admin`` operations that move data: drain, undrain, scale-in, rebalance, drain-status.

    kvpool-admin drain NODE [--wait] [--timeout S]   mark NODE's segments DRAINING and move its objects away
    kvpool-admin undrain NODE                        cancel a drain (segments back to OK)
    kvpool-admin scale-in NODE [--timeout S]         drain, wait until DRAINED, unmount; the store may stop
    kvpool-admin rebalance [--max-moves N]           move objects from the fullest to the emptiest segments
    kvpool-admin drain-status [NODE]                 the drain jobs and their progress

The master runs the jobs (a drain survives a master failover when the masters run with etcd); these
commands start them and, when asked to wait, poll their progress and draw a progress bar on stderr.
A waiting command rides out a leader failover (it retries until its timeout). Exit codes: 0 done,
1 the operation failed (timeout, no target has room, cancelled), 2 unreachable or bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.units import format_size
from kvpool.proto import master_pb2 as pb
from kvpool.tools.argtypes import fraction, non_negative_float, non_negative_int

__all__ = ["COMMANDS", "TRANSIENT", "WAITING", "add_arguments"]

TRANSIENT = frozenset(
    {
        ErrorCode.UNAVAILABLE,
        ErrorCode.TIMEOUT,
        ErrorCode.NOT_LEADER,
        ErrorCode.LEADER_WARMING_UP,
        ErrorCode.STALE_VIEW,
        ErrorCode.RPC_FAILED,
        ErrorCode.CONNECTION_FAILED,
    }
)
"""Codes a waiting command retries: a failover is in progress or the master is briefly unreachable."""
POLL_S = 0.25
DEFAULT_WAIT_S = 3600.0


class _Master:
    """gRPC calls to the serving master; a fresh client (a new leader lookup) after each failure."""

    def __init__(self, args: argparse.Namespace, make_client: Callable[[argparse.Namespace], Any]) -> None:
        self._args = args
        self._make = make_client
        self._client: Any = None

    def call(self, method: str, request: Any) -> Any:
        if self._client is None:
            self._client = self._make(self._args)
        try:
            return self._client.grpc_call(method, request, timeout=self._args.timeout)
        except KvPoolError:
            self._client.close()
            self._client = None
            raise

    def call_retrying(self, method: str, request: Any, deadline: float) -> Any:
        """``call``, retrying transient failures until ``deadline`` (monotonic)."""
        while True:
            try:
                return self.call(method, request)
            except KvPoolError as exc:
                if exc.code not in TRANSIENT or time.monotonic() >= deadline:
                    raise
            time.sleep(POLL_S)


class _Progress:
    """A progress bar (objects and bytes) on a terminal; one line a second when stderr is not a tty."""

    def __init__(self, stream: TextIO, what: str) -> None:
        self._stream = stream
        self._what = what
        self._tty = stream.isatty()
        self._last = 0.0
        self._drawn = False

    def update(self, job: pb.DrainJobStatus, force: bool = False) -> None:
        now = time.monotonic()
        if not self._tty and not force and now - self._last < 1.0:
            return
        self._last = now
        objects = job.objects_moved + job.objects_remaining
        total_bytes = job.bytes_moved + job.bytes_remaining
        fraction = job.objects_moved / objects if objects else 1.0
        bar = "#" * int(fraction * 30)
        line = (
            f"{self._what} {job.node} [{bar:<30}] {job.objects_moved}/{objects} objects "
            f"{format_size(job.bytes_moved)}/{format_size(total_bytes)} {job.seconds:.1f} s {job.state}"
        )
        if self._tty:
            self._stream.write("\r" + line + "\x1b[K")
            self._drawn = True
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def close(self) -> None:
        if self._drawn:
            self._stream.write("\n")
            self._stream.flush()


def _job_doc(job: pb.DrainJobStatus) -> dict[str, Any]:
    return {
        "node": job.node,
        "status": job.state,
        "objects_moved": job.objects_moved,
        "bytes_moved": job.bytes_moved,
        "objects_remaining": job.objects_remaining,
        "bytes_remaining": job.bytes_remaining,
        "in_flight": job.in_flight,
        "seconds": round(job.seconds, 3),
        "message": job.message,
        "segments": list(job.segment_ids),
        "failures": job.failures,
        "scale_in": job.remove,
    }


def _final_doc(job: pb.DrainJobStatus) -> dict[str, Any]:
    return {
        "node": job.node,
        "status": job.state,
        "objects_moved": job.objects_moved,
        "bytes_moved": job.bytes_moved,
        "seconds": round(job.seconds, 3),
    }


def _render_job(d: dict[str, Any]) -> str:
    lines = [
        f"{d['node']}: {d['status']}  moved {d['objects_moved']} objects "
        f"({format_size(d['bytes_moved'])}) in {d['seconds']:.1f} s"
    ]
    if "objects_remaining" in d:
        lines.append(
            f"  remaining {d['objects_remaining']} ({format_size(d['bytes_remaining'])}), "
            f"{d['in_flight']} moves in flight, {d['failures']} failed"
        )
    if d.get("message"):
        lines.append(f"  {d['message']}")
    return "\n".join(lines)


def _emit(args: argparse.Namespace, doc: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> None:
    print(json.dumps(doc) if args.json else render(doc))


def _fail(message: str) -> int:
    print(f"kvpool-admin: {message}", file=sys.stderr)
    return 1


def _wait(
    args: argparse.Namespace, master: _Master, node: str, done: set[str], what: str
) -> tuple[int, pb.DrainJobStatus | None]:
    """Poll the job until a state in ``done``; (exit code, last status)."""
    deadline = time.monotonic() + args.wait_timeout
    progress = _Progress(sys.stderr, what)
    job: pb.DrainJobStatus | None = None
    try:
        while True:
            try:
                response = master.call_retrying("DrainStatus", pb.DrainStatusRequest(node=node), deadline)
                job = response.jobs[0]
            except KvPoolError as exc:
                if exc.code == ErrorCode.JOB_NOT_FOUND:
                    progress.close()
                    return _fail(
                        f"the {what} of {node} is gone: cancelled (kvpool-admin undrain), or the "
                        "master restarted without etcd (jobs then live in its memory only)"
                    ), job
                if exc.code in TRANSIENT:
                    progress.close()
                    return _fail(
                        f"{what} of {node}: not finished after {args.wait_timeout:g} s "
                        f"(master unreachable: {exc.message}); it goes on in the background"
                    ), job
                raise
            progress.update(job)
            if job.state in done:
                progress.update(job, force=True)
                progress.close()
                return 0, job
            if job.state == "STALLED":
                progress.close()
                return _fail(
                    f"{what} of {node} is stuck: {job.message}. It goes on in the background as "
                    f"room appears; add capacity or run `kvpool-admin undrain {node}`"
                ), job
            if time.monotonic() >= deadline:
                progress.close()
                return _fail(
                    f"{what} of {node}: not finished after {args.wait_timeout:g} s "
                    f"({job.objects_remaining} objects left, state {job.state}); it goes on in the "
                    "background"
                ), job
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        progress.close()
        print(f"kvpool-admin: stopped waiting; the {what} of {node} goes on", file=sys.stderr)
        return 1, job


def cmd_drain(args: argparse.Namespace, make_client: Callable[[argparse.Namespace], Any]) -> int:
    master = _Master(args, make_client)
    response = master.call_retrying(
        "Drain", pb.DrainRequest(node=args.node), time.monotonic() + min(args.wait_timeout, 30.0)
    )
    if not args.wait:
        _emit(args, _job_doc(response.jobs[0]), _render_job)
        return 0
    code, job = _wait(args, master, args.node, {"DRAINED", "REMOVED"}, "drain")
    if code == 0 and job is not None:
        _emit(args, _final_doc(job), _render_job)
    return code


def cmd_scale_in(args: argparse.Namespace, make_client: Callable[[argparse.Namespace], Any]) -> int:
    master = _Master(args, make_client)
    master.call_retrying(
        "Drain", pb.DrainRequest(node=args.node, remove=True), time.monotonic() + min(args.wait_timeout, 30.0)
    )
    code, job = _wait(args, master, args.node, {"REMOVED"}, "scale-in")
    if code == 0 and job is not None:
        doc = {**_final_doc(job), "message": f"{args.node} drained and unmounted: its store may stop now"}
        _emit(args, doc, _render_job)
        if args.json:
            print(doc["message"], file=sys.stderr)
    return code


def cmd_undrain(args: argparse.Namespace, make_client: Callable[[argparse.Namespace], Any]) -> int:
    response = _Master(args, make_client).call("Undrain", pb.DrainRequest(node=args.node))
    _emit(args, _job_doc(response.jobs[0]), _render_job)
    return 0


def cmd_drain_status(args: argparse.Namespace, make_client: Callable[[argparse.Namespace], Any]) -> int:
    response = _Master(args, make_client).call("DrainStatus", pb.DrainStatusRequest(node=args.node))
    doc = {"jobs": [_job_doc(j) for j in response.jobs]}
    _emit(args, doc, lambda d: "\n".join(_render_job(j) for j in d["jobs"]) or "no drain jobs")
    return 0


def _rebalance_doc(r: pb.RebalanceStatusResponse, spread_before: float) -> dict[str, Any]:
    return {
        "status": r.state,
        "objects_moved": r.objects_moved,
        "bytes_moved": r.bytes_moved,
        "spread_before": round(spread_before, 4),
        "spread": round(r.spread, 4),
        "seconds": round(r.seconds, 3),
        "message": r.message,
    }


def cmd_rebalance(args: argparse.Namespace, make_client: Callable[[argparse.Namespace], Any]) -> int:
    master = _Master(args, make_client)
    deadline = time.monotonic() + args.wait_timeout
    started = master.call_retrying(
        "Rebalance", pb.RebalanceRequest(max_moves=args.max_moves, tolerance=args.tolerance), deadline
    )
    spread_before = started.spread
    last = 0.0
    while True:
        r = master.call_retrying("RebalanceStatus", pb.RebalanceStatusRequest(), deadline)
        if r.state != "RUNNING":
            break
        if time.monotonic() >= deadline:
            return _fail(
                f"rebalance not finished after {args.wait_timeout:g} s "
                f"({r.objects_moved} objects moved); it goes on in the background"
            )
        if time.monotonic() - last >= 1.0:
            last = time.monotonic()
            print(
                f"rebalance: {r.objects_moved} objects ({format_size(r.bytes_moved)}) moved, "
                f"spread {r.spread:.3f}, {r.seconds:.1f} s",
                file=sys.stderr,
            )
        time.sleep(POLL_S)
    if r.state == "IDLE":
        return _fail("the rebalance was lost (a master failover); run it again")
    _emit(
        args,
        _rebalance_doc(r, spread_before),
        lambda d: (
            f"rebalance {d['status']}: {d['objects_moved']} objects ({format_size(d['bytes_moved'])}) moved in "
            f"{d['seconds']:.1f} s; used-fraction spread {d['spread_before']:.3f} -> {d['spread']:.3f} "
            f"({d['message']})"
        ),
    )
    return 0


Command = Callable[[argparse.Namespace, Callable[[argparse.Namespace], Any]], int]

COMMANDS: dict[str, tuple[Command, str]] = {
    "drain": (cmd_drain, "drain a node: move its objects to other segments (DRAINING -> DRAINED)"),
    "undrain": (cmd_undrain, "cancel a drain or scale-in: the node's segments take objects again"),
    "scale-in": (cmd_scale_in, "drain a node, wait until DRAINED, then unmount it (the store may stop)"),
    "rebalance": (cmd_rebalance, "move objects from the fullest to the emptiest segments"),
    "drain-status": (cmd_drain_status, "drain jobs and their progress"),
}


WAITING = frozenset({"drain", "scale-in", "rebalance"})
"""Commands whose ``--timeout`` is how long they wait for the end (the per-call timeout goes before the
command name: ``kvpool-admin --timeout 5 drain NODE --wait --timeout 600``)."""


def add_arguments(name: str, p: argparse.ArgumentParser) -> None:
    """The arguments of one of :data:`COMMANDS`."""
    if name in ("drain", "undrain", "scale-in"):
        p.add_argument("node", help="node name (or a store id or segment id)")
    if name == "drain-status":
        p.add_argument("node", nargs="?", default="", help="one job (default: every job)")
    if name == "drain":
        p.add_argument("--wait", action="store_true", help="wait until DRAINED, with a progress bar")
    if name in WAITING:
        p.add_argument(
            "--timeout",
            dest="wait_timeout",
            type=non_negative_float,
            default=DEFAULT_WAIT_S,
            help="seconds to wait for the end (default: 3600)",
        )
    if name == "rebalance":
        p.add_argument("--max-moves", type=non_negative_int, default=0, help="most objects to move (default: no limit)")
        p.add_argument(
            "--tolerance",
            type=fraction,
            default=0.05,
            help="stop when used fractions differ by at most this (default: 0.05)",
        )
