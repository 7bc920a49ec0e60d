"""Builds the compiled reference (kestrel_tui/cref) and maps the top-level kernels/ folder into the
package; everything else is in pyproject.toml.

optional=True: without a C compiler the install still succeeds and the numpy reference is used.
The flags are part of the numerics contract (kestrel_tui/cref/cref.h): no float FMA contraction,
no fast-math.
"""
from pathlib import Path

from setuptools import Extension, find_packages, setup

SOURCES = sorted(str(p) for p in Path("kestrel_tui/cref").glob("*.c"))

setup(
    # the CUDA sources live in the top-level kernels/ folder, a data folder with no __init__.py (so that
    # it shadows no `kernels` module); a wheel carries them as kestrel_tui/kernels/, read by path
    packages=find_packages(include=["kestrel_tui*"]) + ["kestrel_tui.kernels"],
    package_dir={"kestrel_tui.kernels": "kernels"},
    package_data={"kestrel_tui": ["app/*.tcss"], "kestrel_tui.kernels": ["*.cu", "*.cuh", "*.h"]},
    ext_modules=[Extension(
        "kestrel_tui.cref._kcref", sources=SOURCES, include_dirs=["kernels"],
        depends=["kestrel_tui/cref/cref.h", "kernels/ucrt_tables.h"],
        extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math", "-pthread", "-Wall"],
        extra_link_args=["-pthread", "-lm"], optional=True)],
)
