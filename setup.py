"""Build of kvtool's two compiled parts, both for the operator commands at scale and both
optional: where one cannot be built, the install goes on and kvtool does the same work in Python,
with the same results. Everything else is in pyproject.toml.

- `kvtool.store._indexread`: the index read through SQLite's C API (`kvtool.store.rowtable_native`;
  else through ADBC, `kvtool.store.rowtable_arrow`). Needs `sqlite3.h`.
- `kvtool.ops._segcheck`: `validate`'s clean-segment check (`kvtool.ops.clean_native`; else
  `kvtool.ops.clean_segments` in Python). Needs libxxhash (xxHash >= 0.8: Debian's `libxxhash0`,
  Homebrew's `xxhash`); its stable ABI is declared in the source, no header needed.
"""

import sys

from setuptools import Extension, setup

# Debian ships libxxhash.so.0 without the unversioned name unless libxxhash-dev is installed
XXHASH = {"extra_link_args": ["-l:libxxhash.so.0"]} if sys.platform.startswith("linux") else {"libraries": ["xxhash"]}

setup(
    ext_modules=[
        Extension("kvtool.store._indexread", ["kvtool/store/_indexread.c"], libraries=["sqlite3"],
                  extra_compile_args=["-O2"], optional=True),
        Extension("kvtool.ops._segcheck", ["kvtool/ops/_segcheck.c"], extra_compile_args=["-O2"], optional=True, **XXHASH),
    ]
)
