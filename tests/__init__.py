"""The test packages.

Importing this package (the root conftest does it first; ``python -m tests.…`` does it by itself)
pins the numeric paths. The seeded digests (``tests/sim/test_seeded_outcomes.py`` and the others)
compare floats bit for bit, and BLAS kernels and numpy's SIMD loops round differently in the last bit
from one x86-64 CPU to the next: OpenBLAS picks its kernels by CPU, numpy dispatches AVX-512 loops
where the CPU has them. Every test process, and every process it starts, runs the AVX2 paths any
recent x86-64 CPU has, on one BLAS thread, so the digests are the same on every such machine.
"""

from __future__ import annotations

import os
import platform
import sys

PINNED_NUMERICS = {
    "OPENBLAS_CORETYPE": "Haswell",
    "OPENBLAS_NUM_THREADS": "1",
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",
}

if platform.machine().lower() in {"x86_64", "amd64"}:
    if "numpy" in sys.modules and any(os.environ.get(k) != v for k, v in PINNED_NUMERICS.items()):
        raise RuntimeError(
            "numpy was imported before the tests could pin its numeric paths; run them with "
            + " ".join(f"{k}={v!r}" for k, v in PINNED_NUMERICS.items())
        )
    os.environ.update(PINNED_NUMERICS)
