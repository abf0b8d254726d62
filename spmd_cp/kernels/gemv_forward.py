"""The matrix-vector forward (gemv_forward.c): built on first use, preloaded ahead of the BLAS.

A decode step multiplies every weight matrix by one token's vector. MLX hands each of
those products to ``cblas_sgemm``, which OpenBLAS before 0.3.27 runs through its GEMM
path (it packs the whole matrix first): 9-11 GB/s on the 2-core test machine, where its
``cblas_sgemv`` streams the same matrices at 21-33 GB/s. The forward is a small C
library exporting ``cblas_sgemm``: matrix-vector shapes go to the BLAS's sgemv, all
others to its sgemm. It is compiled with the system's C compiler into the cache
directory once (runtime/native.py), and blas/reexec.py puts it first in LD_PRELOAD.

``SPMD_CP_GEMV_FORWARD=0`` leaves it out; without a C compiler it is left out too (the
BLAS is used as is). Standard library only: this runs before MLX or MPI is loaded.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from ..runtime.switches import switched_off

ENV_FORWARD = "SPMD_CP_GEMV_FORWARD"  # "0", "off", "no" or "false": do not preload it
# Why the re-exec preloaded the BLAS without the forward it wanted (the re-executed
# process cannot see the build's outcome otherwise): describe.py reports it.
ENV_SKIPPED = "SPMD_CP_GEMV_FORWARD_SKIPPED"
SOURCE = Path(__file__).with_name("gemv_forward.c")
NAME = "spmd-cp-gemv-forward"  # the built file: <cache>/kernels/<NAME>-<source hash>.so


def wanted() -> bool:
    return not switched_off(ENV_FORWARD)


def is_forward_library(path: str | None) -> bool:
    return bool(path) and os.path.basename(path).startswith(NAME + "-")


def forward_library() -> tuple[str | None, str]:
    """(path of the built forward, "") or (None, why not). Built on first use
    (runtime/native.py)."""
    from ..runtime import native  # standard library only as well

    if not wanted():
        return None, f"{ENV_FORWARD}={os.environ[ENV_FORWARD]}"
    if not sys.platform.startswith("linux"):
        return None, "not Linux"  # macOS: MLX calls Accelerate
    try:
        return str(native.build(SOURCE, native.built_path(SOURCE, "kernels", NAME))), ""
    except RuntimeError as error:
        return None, str(error)


@functools.lru_cache(maxsize=1)
def lend_pool(threads: int) -> int:
    """Lend the decode step's pool of threads (kernels/decode_step.c, started with
    ``threads``: the rank's) to the preloaded forward's batched products (a few rows
    times a packed matrix); the threads lent, 0 where the forward or the library is not
    here (the products then run on their caller's thread)."""
    import ctypes

    from . import decode_step

    library, _ = decode_step.library()
    try:
        use_pool = ctypes.CDLL(None).spmd_cp_forward_use_pool
    except (OSError, AttributeError):
        return 0
    if library is None:
        return 0
    threads = library.spmd_cp_decode_set_threads(threads)
    run = ctypes.cast(library.spmd_cp_decode_run_parallel, ctypes.c_void_p).value
    use_pool.argtypes, use_pool.restype = [ctypes.c_void_p, ctypes.c_int], None
    use_pool(run, threads)
    return threads
