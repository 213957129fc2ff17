"""Placement and allocator quality: `python benchmarks/placement.py [--json]`.

Same as `kvpool bench placement`: allocator utilisation for uniform and mixed page sizes, and how many
objects a newly mounted store takes to fill up under free-ratio-first vs random placement (in-process, on
the master's pure core; no cluster needed).
"""

import argparse

from kvpool.tools import bench_placement

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    bench_placement.add_arguments(parser)
    raise SystemExit(bench_placement.run(parser.parse_args()))
