"""Times prefill on the ranks it is launched on; bench_prefill.py drives it.

    mpiexec -n N python benchmarks/prefill_worker.py --new 3072 --cached 0 --algo pass-kv

Loads the model once, prefills ``--cached`` tokens untimed (the document of a follow-up
question), then times ``--repeats`` prefills of ``--new`` tokens after it, rolling the
cache back between repeats. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--new", type=int, required=True)
    parser.add_argument("--cached", type=int, default=0)
    parser.add_argument("--algo", default="auto")
    parser.add_argument("--chunk", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    import mlx.core as mx
    import numpy as np
    from mpi4py import MPI

    from spmd_cp.comm import Comm
    from spmd_cp.engine import Engine
    from spmd_cp.loader import default_model_path, load_model
    from spmd_cp.model import CPModel

    comm = Comm(MPI.COMM_WORLD)
    model = CPModel(load_model(args.model or default_model_path()).model)
    ids = np.random.RandomState(0).randint(3, 20000, size=args.cached + args.new)
    engine = Engine(model, comm, algo=args.algo, prefill_chunk=args.chunk)
    cache = engine.new_cache()
    if args.cached:
        Engine(model, comm, algo="pass-kv").prefill(cache, ids[: args.cached])
    times, bytes_sent = [], []
    mx.reset_peak_memory()
    for _ in range(args.repeats):
        cache.truncate(args.cached)
        engine.algos_used.clear()
        comm.barrier()
        before = comm.bytes_sent
        start = time.perf_counter()
        engine.prefill(cache, ids[args.cached:])
        comm.barrier()
        times.append(time.perf_counter() - start)
        bytes_sent.append(comm.bytes_sent - before)
    peaks = comm.gather_object(int(mx.get_peak_memory()))
    sent = comm.gather_object(bytes_sent[-1])
    if comm.rank == 0:
        print(json.dumps({"ranks": comm.size, "new": args.new, "cached": args.cached,
                          "algo": args.algo, "chosen": sorted(set(engine.algos_used)),
                          "times_s": times, "comm_bytes": sent, "peak_mem_bytes": peaks}))


if __name__ == "__main__":
    from spmd_cp.blas import ensure_fast_blas

    ensure_fast_blas()
    main()
