"""A client partitioned from one store but not from the master: two network namespaces (two "hosts")
joined by a veth pair, iptables DROP inside the client's namespace, real processes everywhere.

Host A (namespace a): the master, store A and the client processes. Host B (namespace b): store B. The
fault drops A's packets to store B's data port only: store B keeps heartbeating to the master (so the
master keeps placing objects on it and handing out its replicas), while the client's connections to it
hang (DROP, not REJECT: the harder case). The client's calls must end by their deadlines, with no wrong
bytes; after the rule is removed everything works again. Namespaces, veth and rules are removed even
when the test fails (the rules live inside the namespaces).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.tools.local_cluster import LocalCluster
from kvpool.tools.workload import WorkloadResult
from tests.support.faults import NetnsPair

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

TIMEOUT_S = 1.0
SLACK_S = 0.5
PHASE_S = 4.0  # normal, partitioned, healed: the workload runs 3 phases


@pytest.fixture
def hosts() -> Iterator[NetnsPair]:
    pair = NetnsPair.create()  # skips with the kernel's reason where namespaces or veth are refused
    try:
        yield pair
    finally:
        pair.close()
        assert not [ns for ns in NetnsPair.leftovers() if ns in (pair.a, pair.b)], "namespaces left behind"


def _workload(pair: NetnsPair, master: str, out: Path, seconds: float, prefix: str) -> subprocess.Popen[bytes]:
    cmd = [
        *pair.exec_prefix(pair.a),
        sys.executable,
        "-m",
        "kvpool.tools.workload",
        "--master",
        master,
        "--prefix",
        prefix,
        "--threads",
        "3",
        "--duration",
        str(seconds),
        "--timeout",
        str(TIMEOUT_S),
        "--slack",
        str(SLACK_S),
        "--out",
        str(out),
    ]
    with open(out.with_suffix(".log"), "wb") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )


def _result(proc: subprocess.Popen[bytes], out: Path, timeout: float) -> WorkloadResult:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the workload did not finish in {timeout} s") from None
    assert proc.returncode == 0, out.with_suffix(".log").read_text()[-2000:]
    return WorkloadResult.from_json(json.loads(out.read_text()))


STATS = textwrap.dedent("""
    import json, sys
    from kvpool.client import ClientConfig, PoolClient
    with PoolClient(config=ClientConfig(master=sys.argv[1], use_shm=False)) as c:
        s = c.stats()
        print(json.dumps({"segments": len(s.segments), "objects": s.objects}))
""")


def _stats(pair: NetnsPair, master: str) -> dict[str, Any]:
    """The master's view, asked from host A (the test process itself is on neither host)."""
    out = subprocess.run(
        [*pair.exec_prefix(pair.a), sys.executable, "-c", STATS, master],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    doc: dict[str, Any] = json.loads(out)
    return doc


def test_client_partitioned_from_one_store_not_from_the_master(hosts: NetnsPair, tmp_path: Path) -> None:
    cluster = LocalCluster(stores=0, base_dir=tmp_path / "cluster", master_args=("--store-ttl-s", "3"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        a, b = hosts.exec_prefix(hosts.a), hosts.exec_prefix(hosts.b)
        cluster.add_master(extra=("--host", hosts.addr_a), prefix=a)
        cluster.add_store(node="host-a", extra=("--host", hosts.addr_a), prefix=a)
        store_b = cluster.add_store(node="host-b", extra=("--host", hosts.addr_b), prefix=b)
        b_port = store_b.address.rsplit(":", 1)[1]
        rule = ("OUTPUT", "-d", hosts.addr_b, "-p", "tcp", "--dport", b_port, "-j", "DROP")

        run = tmp_path / "run.json"
        procs.append(_workload(hosts, cluster.master, run, 3 * PHASE_S, "run"))
        time.sleep(PHASE_S)  # a schedule of the fault, not a wait for a result
        hosts.iptables(hosts.a, "-A", *rule)
        time.sleep(PHASE_S)
        hosts.iptables(hosts.a, "-D", *rule)
        during = _result(procs[-1], run, 3 * PHASE_S + 60)

        after_path = tmp_path / "after.json"
        procs.append(_workload(hosts, cluster.master, after_path, PHASE_S, "after"))
        after = _result(procs[-1], after_path, PHASE_S + 60)
        stats = _stats(hosts, cluster.master)

        print(
            "\nRELIABILITY "
            + json.dumps(
                {
                    "fault": "client partitioned from one store (iptables DROP), not from the master",
                    "ops": during.ops,
                    "errors": during.errors,
                    "wrong_reads": during.wrong_reads,
                    "reads_checked": during.reads_checked,
                    "lost": during.lost,
                    "overruns": during.overruns,
                    "worst_overrun_s": round(during.worst_overrun_s, 3),
                    "after_heal_ops": after.ops,
                    "after_heal_errors": after.errors,
                    "segments_at_master": stats["segments"],
                },
                sort_keys=True,
            )
        )
        assert during.wrong_reads == 0
        assert after.wrong_reads == 0
        assert during.overruns == 0, f"calls past their deadline (worst {during.worst_overrun_s:.3f} s)"
        assert sum(n for code, n in during.errors.items() if code in ("TIMEOUT", "CONNECTION_FAILED")) > 0, (
            "the partition should have been felt"
        )
        assert stats["segments"] == 2, "store B was partitioned from the client only, never from the master"
        assert after.errors == {}, f"after healing: {after.errors}"
        assert after.overruns == 0
        # The master shares host A's side of the partition: its probe of store B's data plane fails, so it
        # suspects B (docs/decisions/0026-dead-store-suspicion.md) and reads of B's objects are clean misses
        # while the partition lasts. Nothing may be lost once it heals.
        assert after.lost == 0, "a partition must not lose objects"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        cluster.stop()
