"""The dma-buf registration call against Debian's real pyverbs, on a host without a device (decision 0023).

``_PvContext.reg_dmabuf_mr`` is reached only on a GPU node with a NIC. Its call into ``pyverbs.mr.DmaBufMR`` is
checked here anyway: with no protection domain the real class refuses the ``pd`` argument, which Cython checks
only after it accepted every keyword, so a keyword pyverbs does not have would fail differently. Runs in a
subprocess that alone sees pyverbs (the fixture of test_rdma_fallback.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvpool
from tests.integration.test_rdma_fallback import pyverbs_dir

__all__ = ["pyverbs_dir"]  # the fixture, shared with test_rdma_fallback.py

pytestmark = pytest.mark.integration

_CHILD = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    from kvpool.transfer.verbs import Access, VerbsError, _PvContext

    ctx = _PvContext.__new__(_PvContext)  # no device here: a context without a protection domain
    ctx._pd = None
    out = {}
    for iova in (4096, 8192):
        try:
            ctx.reg_dmabuf_mr(-1, 4096, 65536, iova, Access.LOCAL_WRITE)
        except VerbsError as exc:
            out[str(iova)] = [str(exc), exc.errno]
    print(json.dumps(out))
""")


def test_the_dmabuf_registration_call_matches_the_real_pyverbs(pyverbs_dir: Path) -> None:
    source = str(Path(kvpool.__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(pyverbs_dir), source], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    message, _ = out["4096"]
    assert "Argument 'pd' has incorrect type" in message  # every keyword was accepted: only the PD is wrong
    assert "unexpected keyword" not in message
    # pyverbs registers at IOVA == offset: another IOVA is refused before pyverbs is called.
    assert out["8192"][1] == 22  # EINVAL
