"""NUMA binding and hugepage checks for stores (kvpool.store.numa), on this machine's real kernel.

Binding changes the CPU affinity and memory policy of the process that binds, so every bind runs in a
child process; this test process keeps its own. Machines here have one node (0), which makes node 1 the
"absent node" case; multi-node placement itself needs a multi-node host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.store import numa

pytestmark = pytest.mark.integration

_CHILD = textwrap.dedent("""
    import json, mmap, os, sys, threading
    from kvpool.common.errors import KvPoolError
    from kvpool.store import numa

    class Mapping:
        def __init__(self, size, fd=-1):
            self.mm = mmap.mmap(fd, size)
            self.view = memoryview(self.mm)
            self.size = size

    def status(field):
        with open("/proc/self/status") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith(field + ":"))

    def error(call):
        try:
            call()
        except KvPoolError as exc:
            return {"code": exc.code.name, "message": exc.message}
        return None

    out = {"pid": os.getpid()}
    # a thread that exists before the bind must be moved too
    started, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (started.set(), stop.wait()))
    worker.start(); started.wait()
    out["cpus"] = numa.bind_current_process(0)
    out["cpus_allowed_list"] = status("Cpus_allowed_list")
    out["mems_allowed_list"] = status("Mems_allowed_list")
    import ctypes, ctypes.util
    libnuma = ctypes.util.find_library("numa")
    if libnuma:  # the calling thread's policy: get_mempolicy(&mode, mask, maxnode, NULL, 0)
        lib = ctypes.CDLL(libnuma, use_errno=True)
        mode, mask = ctypes.c_int(), (ctypes.c_ulong * 1)()
        assert lib.get_mempolicy(ctypes.byref(mode), mask, 65, None, 0) == 0
        out["mempolicy"] = [mode.value, mask[0]]
    out["worker_affinity"] = sorted(os.sched_getaffinity(worker.native_id))
    stop.set(); worker.join()

    anon = Mapping(64 << 20)
    binding = numa.bind_memory(anon, 0)
    for pos in range(0, anon.size, mmap.PAGESIZE):
        anon.view[pos] = 1  # fault every page in: they must come from node 0
    address = binding.address
    out["anon_policy"] = binding.policy
    with open(f"/proc/{os.getpid()}/numa_maps") as f:
        out["anon_numa_maps"] = next(l.strip() for l in f if int(l.split()[0], 16) == address)
    out["anon_page_nodes"] = sorted(set(numa.page_nodes(address, anon.size).values()))

    path = f"/dev/shm/kvpool-numa-test-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 16 << 20)
        shm = Mapping(16 << 20, fd)
        out["shm_policy"] = numa.bind_memory(shm, 0).policy
    finally:
        os.close(fd); os.unlink(path)

    out["bind_process_node1"] = error(lambda: numa.bind_current_process(1))
    out["bind_memory_node1"] = error(lambda: numa.bind_memory(anon, 1))
    out["cpus_after_refusal"] = status("Cpus_allowed_list")
    print(json.dumps(out))
""")


def _run_child() -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(__file__),
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def child() -> dict[str, object]:
    if 1 in numa.available_nodes():
        pytest.skip("this machine has a NUMA node 1; the absent-node checks below assume a one-node host")
    return _run_child()


def _expected_node0_cpus() -> str:
    with open("/sys/devices/system/node/node0/cpulist", encoding="ascii") as f:
        return f.read().strip()


def test_bind_to_node0_pins_every_thread_and_the_memory_policy(child: dict[str, object]) -> None:
    before = os.sched_getaffinity(0)
    assert child["cpus_allowed_list"] == _expected_node0_cpus()
    assert child["cpus"] == numa.node_cpus(0)
    assert child["worker_affinity"] == numa.node_cpus(0)  # a thread started before the bind moved too
    assert child["mems_allowed_list"] == "0"
    if "mempolicy" in child:
        assert child["mempolicy"] == [numa.MPOL_BIND, 1]  # MPOL_BIND to node 0 only
    assert os.sched_getaffinity(0) == before  # this process was not touched


def test_mbind_of_64mib_shows_bind0_in_numa_maps(child: dict[str, object]) -> None:
    assert child["anon_policy"] == "bind:0"
    line = str(child["anon_numa_maps"])
    assert " bind:0 " in f" {line} "
    assert "N0=16384" in line  # all 64 MiB / 4 KiB pages resident on node 0
    assert child["anon_page_nodes"] == [0]
    assert child["shm_policy"] == "bind:0"  # the store's segment is a /dev/shm file mapping


def test_absent_node_fails_clearly(child: dict[str, object]) -> None:
    expected = "NUMA node 1 does not exist (this machine has nodes 0-0)"
    for key in ("bind_process_node1", "bind_memory_node1"):
        err = child[key]
        assert isinstance(err, dict), key
        assert err["code"] == "INVALID_ARGUMENT"
        assert err["message"] == expected
    assert child["cpus_after_refusal"] == _expected_node0_cpus()  # a refused bind changes nothing


def test_node_checks_in_process() -> None:
    nodes = numa.available_nodes()
    assert nodes
    assert 0 in nodes
    with pytest.raises(KvPoolError) as info:
        numa.check_node(max(nodes) + 2)
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    assert f"NUMA node {max(nodes) + 2} does not exist (this machine has nodes " in info.value.message
    assert numa.format_nodes([0]) == "0-0"
    assert numa.format_nodes([0, 1, 2, 4]) == "0-2,4-4"


def _free_1g_pages() -> int:
    ok, _ = numa.hugepages_available("1G", 0)
    if not ok:
        return 0
    with open("/sys/kernel/mm/hugepages/hugepages-1048576kB/free_hugepages", encoding="ascii") as f:
        return int(f.read())


def test_require_1g_hugepages_fails_clearly_here() -> None:
    if _free_1g_pages() >= 1:
        pytest.skip("this machine has a free 1 GiB hugepage reserved")
    ok, reason = numa.hugepages_available("1G", 1 << 30)
    assert not ok
    assert "1G" in reason
    with pytest.raises(KvPoolError) as info:
        numa.require_hugepages("1G", 1 << 30)
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    message = info.value.message
    assert "hugepages 1G were asked for and cannot be provided" in message
    assert "never falls back" in message
    assert "hugepages-1048576kB" in message  # names the pool, and how to fill it


def test_hugepage_size_must_be_known() -> None:
    ok, reason = numa.hugepages_available("4M")
    assert not ok
    assert "2M, 1G" in reason


def test_reserved_2m_hugepages_are_seen_then_restored() -> None:
    """Reserve 4 x 2 MiB pages for the duration of the test (root only), always restoring the old count."""
    path = "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"
    if os.geteuid() != 0 or not os.path.exists(path):
        pytest.skip("needs root and 2 MiB hugepages to reserve pages")
    with open(path, encoding="ascii") as f:
        previous = int(f.read())
    try:
        with open(path, "w", encoding="ascii") as f:
            f.write(str(previous + 4))
        with open(path, encoding="ascii") as f:
            if int(f.read()) < previous + 4:
                pytest.skip("the kernel could not reserve 4 more 2 MiB hugepages (memory fragmented)")
        ok, reason = numa.hugepages_available("2M", 8 << 20)
        assert ok, reason
        numa.require_hugepages("2M", 8 << 20)
        ok, reason = numa.hugepages_available("2M", 8 << 20, node=0)
        assert ok, reason
    finally:
        with open(path, "w", encoding="ascii") as f:
            f.write(str(previous))
    with open(path, encoding="ascii") as f:
        assert int(f.read()) == previous


def test_raw_syscalls_when_libnuma_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without libnuma the same calls go to the raw syscalls (mbind 237, move_pages 279 on x86_64).

    Binding a private mapping of this process only changes that mapping, so this runs in-process.
    """
    import mmap
    import platform

    if platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip(f"no syscall numbers for {platform.machine()}")
    monkeypatch.setattr(numa, "_libnuma", lambda: None)

    class Mapping:
        def __init__(self, size: int) -> None:
            self.mm = mmap.mmap(-1, size)
            self.view = memoryview(self.mm)
            self.size = size

    m = Mapping(8 << 20)
    try:
        binding = numa.bind_memory(m, 0)
        assert binding.policy == "bind:0"
        m.view[0] = 1
        assert set(numa.page_nodes(binding.address, m.size).values()) <= {0, -2}  # on node 0 or not faulted
        with pytest.raises(KvPoolError):
            numa.bind_memory(m, 7)
    finally:
        m.view.release()
        m.mm.close()
