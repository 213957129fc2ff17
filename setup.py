"""Build script for kvpool's compiled modules; everything else is in pyproject.toml.

Both are optional: without a C compiler and Python's headers the build skips them and kvpool runs the
Python code they replace.

* ``kvpool.transfer._lanes``: a TCP lane's loop of large READs and WRITEs (docs/decisions/0016-native-lane-loop.md)
  and the shared-memory transport's copy; the transport says once in its log when it runs without it.
* ``kvpool.master._index``: the master's batched key lookup (exists, prefix length). It also needs
  xxHash's header (Debian ``libxxhash-dev``).
* ``kvpool.transfer._verbs``: the RDMA data path's verbs objects and posting loop, and the FAKE provider
  tests post through (docs/decisions/0027-native-verbs-data-path.md). It also needs libibverbs' headers
  (Debian ``libibverbs-dev``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvpool.transfer._lanes",
            ["src/kvpool/transfer/_lanes.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
            optional=True,
        ),
        Extension(
            "kvpool.master._index",
            ["src/kvpool/master/_index.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
            optional=True,
        ),
        Extension(
            "kvpool.transfer._verbs",
            ["src/kvpool/transfer/_verbs.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
            libraries=["ibverbs"],
            optional=True,
        ),
    ]
)
