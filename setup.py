"""Builds the compiled reference (kestrel_tui/cref) with the package; everything else is in pyproject.toml.

optional=True: without a C compiler the install still succeeds and the numpy reference is used.
The flags are part of the numerics contract (kestrel_tui/cref/cref.h): no float FMA contraction,
no fast-math.
"""
from pathlib import Path

from setuptools import Extension, setup

SOURCES = sorted(str(p) for p in Path("kestrel_tui/cref").glob("*.c"))

setup(ext_modules=[Extension(
    "kestrel_tui.cref._kcref", sources=SOURCES,
    depends=["kestrel_tui/cref/cref.h", "kestrel_tui/kernels/ucrt_tables.h"],
    extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-Wall"],
    extra_link_args=["-fopenmp", "-lm"], optional=True)])
