"""Build script for kvpool's one compiled module; everything else is in pyproject.toml.

``kvpool.transfer._lanes`` (a TCP lane's loop of large READs and WRITEs, docs/decisions/0016-native-lane-loop.md)
is optional: without a C compiler and Python's headers the build skips it and the transport runs its
Python loop instead (and says so once in its log).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvpool.transfer._lanes",
            ["src/kvpool/transfer/_lanes.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
            optional=True,
        )
    ]
)
