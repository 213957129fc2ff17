"""Failover benchmark: `python benchmarks/failover.py [--runs 3] [--leader-ttl-s 3] [--json]`.

Same as `kvpool bench failover`: kills the leader master of a local HA cluster under load and prints the
time to a new serving leader, the time to the first successful client read, and the fraction of objects
recovered (medians of several runs).
"""

import argparse

from kvpool.tools import bench_failover

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    bench_failover.add_arguments(parser)
    raise SystemExit(bench_failover.run(parser.parse_args()))
