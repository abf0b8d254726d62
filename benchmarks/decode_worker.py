"""Times decode steps at a given context length; bench_decode.py drives it.

    mpiexec -n N python benchmarks/decode_worker.py --context 4096 --tp on

The context is a synthetic cache of the right size (random K/V at head-tail positions):
a decode step's cost depends on the shard sizes, not on what the keys say, and a real
8K-token prefill would cost minutes per configuration on this machine. (Token identity
with one rank is tested on real prompts in tests/test_decode.py.) Rank 0 prints JSON.
"""

from __future__ import annotations

import argparse
import json
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--tp", choices=["on", "off"], default="off")
    parser.add_argument("--merge", choices=["allgather", "allreduce"], default="allgather")
    args = parser.parse_args()

    import mlx.core as mx
    import numpy as np
    from mpi4py import MPI

    from spmd_cp.comm import Comm
    from spmd_cp.engine import Engine
    from spmd_cp.loader import default_model_path, load_model
    from spmd_cp.model import CPModel
    from spmd_cp.partition import head_tail_positions

    comm = Comm(MPI.COMM_WORLD)
    model = CPModel(load_model(args.model or default_model_path()).model)
    engine = Engine(model, comm, decode_merge=args.merge, decode_tp=args.tp)
    cache = engine.new_cache()
    rank_positions = head_tail_positions(args.context, comm.size)
    cache.add_positions(rank_positions, np.zeros(args.context, np.int64))
    attn = model.layers[0].self_attn
    head_dim = attn.o_proj.weight.shape[1] // attn.n_heads
    local = rank_positions[comm.rank].size
    for layer in cache.layers:
        shape = (attn.n_kv_heads, local, head_dim)
        layer.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
    mx.eval([layer.keys for layer in cache.layers] + [layer.values for layer in cache.layers])

    token, times, waits = 1, [], []
    for step in range(args.tokens):
        comm.barrier()
        wait_before = comm.wait_seconds
        start = time.perf_counter()
        logits = engine.decode_step(cache, token)
        token = int(mx.argmax(logits)) if comm.rank == 0 else 0
        token = comm.bcast_object(token)
        times.append(time.perf_counter() - start)
        waits.append(comm.wait_seconds - wait_before)
    warm = slice(3, None)
    step_s = comm.gather_object(float(np.median(times[warm])))
    wait_s = comm.gather_object(float(np.median(waits[warm])))
    if comm.rank == 0:
        print(json.dumps({"ranks": comm.size, "context": args.context, "tp": args.tp,
                          "merge": args.merge, "step_s": max(step_s), "wait_s": wait_s,
                          "tok_s": 1.0 / max(step_s)}))


if __name__ == "__main__":
    from spmd_cp.blas import ensure_fast_blas

    ensure_fast_blas()
    main()
