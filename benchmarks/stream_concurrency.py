"""Whether ranks on one host slow each other's weight reads: decode's matrix-vector form
on every rank at once.

    OPENBLAS_NUM_THREADS=1 mpiexec -n 1 python benchmarks/stream_concurrency.py
    OPENBLAS_NUM_THREADS=1 mpiexec -n 2 python benchmarks/stream_concurrency.py

Every rank multiplies one row by 269 MB of 1536 x 576 float32 matrices (half of
SmolLM2-135M's weights, what one rank of a split decode step reads) in the form decode
uses (engine/weight_slices.times_transposed), all ranks at once after a barrier, and
rank 0 prints each rank's read rate. If the rate per rank holds as N grows, memory
bandwidth is not what limits the split step.
"""

from __future__ import annotations

import statistics
import time

from spmd_cp.blas import ensure_fast_blas

ensure_fast_blas()  # before MLX and MPI load, as the CLI does

import mlx.core as mx  # noqa: E402
from mpi4py import MPI  # noqa: E402

from spmd_cp.engine.weights.weight_slices import times_transposed  # noqa: E402

MATRICES, ROWS, COLS, ROUNDS = 76, 1536, 576, 20


def main():
    comm = MPI.COMM_WORLD
    mx.set_default_device(mx.cpu)
    weights = [mx.random.normal((ROWS, COLS)) for _ in range(MATRICES)]
    x = mx.random.normal((1, COLS))
    mx.eval(weights, x)
    nbytes = sum(w.nbytes for w in weights)

    def step():
        mx.eval([times_transposed(x, w) for w in weights])

    for _ in range(3):
        step()
    times = []
    for _ in range(ROUNDS):
        comm.Barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    rates = comm.gather(nbytes / statistics.median(times) / 1e9, root=0)
    if comm.rank == 0:
        print(f"N = {comm.size}: {nbytes / 1e6:.0f} MB per rank, median of {ROUNDS}; "
              "GB/s per rank: " + " / ".join(f"{r:.1f}" for r in rates), flush=True)


if __name__ == "__main__":
    main()
