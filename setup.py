"""Build of kvtool's one compiled part, `kvtool.store._indexread` (the operator commands' index
read through SQLite's C API: `kvtool.store.rowtable_native`). It is optional: where it cannot be
built (no C compiler, no `sqlite3.h`), the install goes on and kvtool reads the index through
ADBC instead (`kvtool.store.rowtable_arrow`), with the same results. Everything else is in
pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvtool.store._indexread", ["kvtool/store/_indexread.c"], libraries=["sqlite3"],
                  extra_compile_args=["-O2"], optional=True),
    ]
)
