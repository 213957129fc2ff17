"""The RDMA fallback with Debian's real pyverbs, on a host without an RDMA device.

Debian's ``python3-pyverbs`` imports, but ``get_device_list()`` raises ``PyverbsRDMAError`` here (the kernel
has no RDMA support at all). kvpool must treat that as "no RDMA": ``discover_devices()`` returns [], the
factory returns TCP only, and the "RDMA unavailable ...: using TCP" line is logged exactly once however often
it is asked.

pyverbs is exposed to a *subprocess* only, through a temporary directory holding just a ``pyverbs`` symlink
(not all of Debian's dist-packages, whose other modules would shadow the venv's), so this test process and the
rest of the suite never see it. Skipped when the package is not installed - unless ``CI`` is set, where that
is a failure of the environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

DEBIAN_PYVERBS = Path("/usr/lib/python3/dist-packages/pyverbs")
_INSTALL = "apt-get install -y python3-pyverbs rdma-core"

_CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from kvpool.common.log import setup_logging
    setup_logging("rdma-fallback-test", "INFO")

    import pyverbs, pyverbs.device
    out = {"pyverbs_file": pyverbs.__file__}
    try:
        out["raw_devices"] = [str(d.name) for d in pyverbs.device.get_device_list()]
    except Exception as exc:
        out["raw_error"] = type(exc).__name__
    from kvpool.transfer.verbs import discover_devices
    from kvpool.transfer.factory import make_transports
    out["discover"] = [discover_devices(), discover_devices()]
    names = []
    for _ in range(3):
        transports = make_transports("node-a", prefer_rdma=True)
        names.append([type(t).__name__ for t in transports])
        for t in transports:
            t.close()
    out["transports"] = names
    print(json.dumps(out))
""")


def _ci() -> bool:
    return bool(os.environ.get("CI"))


@pytest.fixture(scope="module")
def pyverbs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not DEBIAN_PYVERBS.is_dir():
        reason = f"Debian's pyverbs is not installed ({DEBIAN_PYVERBS} missing; {_INSTALL})"
        if _ci():
            pytest.fail(f"CI is set: {reason}")
        pytest.skip(reason)
    if sys.version_info[:2] != (3, 11):
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        reason = f"Debian's pyverbs is built for CPython 3.11, this is {version}"
        if _ci():
            pytest.fail(f"CI is set: {reason}")
        pytest.skip(reason)
    directory = tmp_path_factory.mktemp("pyverbs_only")
    (directory / "pyverbs").symlink_to(DEBIAN_PYVERBS)
    return directory


def _run(pyverbs_dir: Path) -> tuple[dict[str, object], str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVPOOL_LOG_JSON")}
    env["KVPOOL_LOG_LEVEL"] = "INFO"
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(pyverbs_dir)], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result, proc.stderr


def test_real_pyverbs_without_device_falls_back_to_tcp_with_one_log_line(pyverbs_dir: Path) -> None:
    out, stderr = _run(pyverbs_dir)
    # the real Debian module, reached through the symlink
    assert str(out["pyverbs_file"]).startswith(str(pyverbs_dir))
    if out.get("raw_devices"):
        pytest.skip(f"this host has RDMA devices {out['raw_devices']}; see test_rdma_real.py")
    assert out.get("raw_error") == "PyverbsRDMAError" or out.get("raw_devices") == []
    assert out["discover"] == [[], []]
    assert out["transports"] == [["TcpTransport"]] * 3
    lines = [line for line in stderr.splitlines() if "RDMA unavailable" in line]
    assert len(lines) == 1, stderr
    assert "using TCP" in lines[0]
    assert "PyverbsRDMAError" in lines[0] or "no RDMA device" in lines[0]


def test_this_process_never_imports_pyverbs(pyverbs_dir: Path) -> None:
    assert "pyverbs" not in sys.modules
    assert str(DEBIAN_PYVERBS.parent) not in sys.path
    assert str(pyverbs_dir) not in sys.path


_ATTRS_CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from kvpool.transfer import verbs as v

    init = v.pv_qp_init_attr(None, 64)
    to_init = v.pv_init_attr(1, v.Access.LOCAL_WRITE | v.Access.REMOTE_READ)
    roce = v.QpInfo(0x1234, 7, "fe80:0000:0000:0000:0202:c9ff:fe00:0001", 99, v.Mtu.MTU_1024)
    rtr = v.pv_rtr_attr(1, 3, 16, roce, v.Mtu.MTU_1024)
    ib = v.pv_rtr_attr(1, 0, 16, v.QpInfo(5, 9, v.ZERO_GID, 1, v.Mtu.MTU_4096), v.Mtu.MTU_4096)
    rts = v.pv_rts_attr(1, 77, 8)
    err, mask = v.pv_error_attr()
    wr = v.pv_send_wr(v.WorkRequest(9, v.Opcode.RDMA_READ, 0x1000, 4096, 11, 0x2000, 22))
    # The reused chain (decision 0021): three requests, then two refill the last two objects of the ring.
    chain = v.PvSendChain()
    three = [v.WorkRequest(20 + n, v.Opcode.RDMA_WRITE, 0x1000 * n, 512, 11, 0x9000, 22) for n in range(3)]
    head3 = chain.build(three)
    head2 = chain.build([v.WorkRequest(40 + n, v.Opcode.RDMA_READ, 0, 64, 11, 0x9000, 22) for n in range(2)])
    print(json.dumps({
        "init": [init.qp_type, init.cap.max_send_wr, init.sq_sig_all],
        "to_init": [to_init.port_num, to_init.qp_access_flags, to_init.pkey_index],
        "rtr": [rtr.path_mtu, rtr.dest_qp_num, rtr.rq_psn, rtr.max_dest_rd_atomic, rtr.ah_attr.is_global,
                rtr.ah_attr.dlid, rtr.ah_attr.sgid_index, rtr.ah_attr.dgid, rtr.ah_attr.port_num],
        "ib": [ib.ah_attr.is_global, ib.ah_attr.dlid],
        "rts": [rts.sq_psn, rts.timeout, rts.retry_cnt, rts.rnr_retry, rts.max_rd_atomic],
        "err": [err.qp_state, mask],
        "wr": [wr.wr_id, wr.opcode, wr.num_sge, wr.send_flags],
        "chain": [chain.capacity, head3.wr_id, head3.opcode, head2.wr_id, head2.opcode, head2.num_sge],
    }))
""")


def test_attribute_builders_are_accepted_by_the_real_pyverbs(pyverbs_dir: Path) -> None:
    """No device is needed to build the structs, so the keyword and attribute names that verbs.py passes to
    pyverbs are checked against the real library on every run, not only on an RDMA cluster."""
    proc = subprocess.run(
        [sys.executable, "-c", _ATTRS_CHILD, str(pyverbs_dir)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["init"] == [2, 64, 1]  # IBV_QPT_RC, SQ depth, every WR signaled
    assert out["to_init"] == [1, 5, 0]  # LOCAL_WRITE | REMOTE_READ
    assert out["rtr"] == [3, 0x1234, 99, 16, 1, 7, 3, "fe80:0000:0000:0000:0202:c9ff:fe00:0001", 1]
    assert out["ib"] == [0, 9]  # no GID: addressed by LID, no GRH
    assert out["rts"] == [77, 14, 7, 7, 8]
    assert out["err"] == [6, 1]  # IBV_QPS_ERR, IBV_QP_STATE
    assert out["wr"] == [9, 4, 1, 2]  # IBV_WR_RDMA_READ, one SGE, IBV_SEND_SIGNALED
    # A list refills the ring's last objects: two requests start at the second object, which now reads.
    assert out["chain"] == [3, 20, 0, 40, 4, 1]  # IBV_WR_RDMA_WRITE = 0, IBV_WR_RDMA_READ = 4
