"""This machine's ceilings (raw loopback TCP between two Python processes, memcpy):
`python benchmarks/ceiling.py --json`. The implementation is kvpool.tools.ceiling (`kvpool bench transfer`
measures the same ceiling in its own run)."""

from kvpool.tools.ceiling import (
    RawTcpPeer,
    main,
    measure_memcpy,
    measure_tcp,
    measure_tcp_ceiling,
    measure_tcp_spread_ceiling,
)

__all__ = ["RawTcpPeer", "main", "measure_memcpy", "measure_tcp", "measure_tcp_ceiling", "measure_tcp_spread_ceiling"]

if __name__ == "__main__":
    raise SystemExit(main())
