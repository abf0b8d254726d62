"""`python -m spmd_cp.blas [--json] [--matmul N]`: re-exec if useful, then print the BLAS
in use (and a float32 matmul's speed)."""

from __future__ import annotations

import os
import sys

from . import describe_blas, ensure_fast_blas


def self_check(argv: list[str]) -> None:
    """`python -m spmd_cp.blas [--json] [--matmul N]`: the BLAS in use and a matmul's speed."""
    import json
    import time

    ensure_fast_blas()
    import mlx.core as mx

    n = int(argv[argv.index("--matmul") + 1]) if "--matmul" in argv else 0
    info = describe_blas()
    if n:
        a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
        mx.eval(a @ b)
        start, reps = time.perf_counter(), 3
        for _ in range(reps):
            mx.eval(a @ b)
        info["matmul_gflops"] = 2 * n**3 * reps / (time.perf_counter() - start) / 1e9
        info["matmul_n"] = n
    info["pid"] = os.getpid()
    if "--json" in argv:
        print(json.dumps(info), flush=True)
    else:
        speed = f" ({info['matmul_gflops']:.1f} GFLOP/s at {n}^3 float32)" if n else ""
        print(info["line"] + speed, flush=True)


if __name__ == "__main__":
    self_check(sys.argv[1:])
