"""Run MLX's CPU matmuls on an optimized BLAS instead of the reference one (Linux).

The `mlx-cpu` wheel links netlib's *reference* BLAS (`mlx_cpu.libs/libblas-*.so`): a float32
2048^3 matmul runs at ~5 GFLOP/s on our 2-core x86 machines, against ~170 (one thread) to
~320 (two threads) with OpenBLAS. The dynamic loader lets a library named in `LD_PRELOAD`
provide `cblas_sgemm` & co. before the one libmlx.so links, but `LD_PRELOAD` is read only when
a program starts. So `ensure_fast_blas()` sets it and re-executes the same command line
(`os.execv`: same pid, same environment, same inherited file descriptors) before anything
heavy has happened. Call it first in the entry point: before `import mlx` (only to save the
work) and before `from mpi4py import MPI` (required: the re-exec must happen before
MPI_Init; under mpiexec the launcher's PMI connection is still untouched at that point).

    python -m spmd_cp.blas            # re-exec if useful, then print the BLAS in use
    SPMD_CP_BLAS=reference ...        # opt out: keep the reference BLAS
    SPMD_CP_BLAS=/path/libfoo.so ...  # use this library (it must export cblas_sgemm)
    SPMD_CP_BLAS=openblas|mkl|blis    # the first library of that family found

This package uses only the standard library: importing it does not load MLX or MPI.
libraries.py finds and classifies libraries, reexec.py switches to one, describe.py says
which one a running process uses.
On macOS it does nothing: MLX uses Accelerate there.
"""

from .describe import describe_blas, mapped_blas_libraries
from .libraries import (ENV_CHOICE, ENV_GUARD, FAST_KINDS, INSTALL_HINT, LOCAL_SIZE_VARS, OPT_OUT,
                        THREAD_VARS, blas_kind, candidate_paths, default_threads, exports_cblas,
                        find_fast_blas, local_ranks, usable_cpus)
from .reexec import ensure_fast_blas

__all__ = ["ENV_CHOICE", "ENV_GUARD", "FAST_KINDS", "INSTALL_HINT", "LOCAL_SIZE_VARS", "OPT_OUT",
           "THREAD_VARS", "blas_kind", "candidate_paths", "default_threads", "describe_blas",
           "ensure_fast_blas", "exports_cblas", "find_fast_blas", "local_ranks",
           "mapped_blas_libraries", "usable_cpus"]
