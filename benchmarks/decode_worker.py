"""Times decode steps at given context lengths; bench_decode.py drives it.

    mpiexec -n N python benchmarks/decode_worker.py --context 4096 --tp on
    mpiexec -n 2 python benchmarks/decode_worker.py --context 16 2048 4096 8192 \
        --tp off on --merge allgather allreduce --rounds 2

The context is a synthetic cache of the right size (random K/V at head-tail positions):
a decode step's cost depends on the shard sizes, not on what the keys say, and a real
8K-token prefill would cost minutes per configuration on this machine. (Token identity
with one rank is tested on real prompts in tests/test_decode.py.)

Every (context, tp, merge) combination is one configuration; they alternate inside the
process for ``--rounds`` rounds (``--tokens`` steps each, the first ``--skip`` of every
block discarded), and the cache is cut back to the context after every block, so each
configuration always decodes at the same context length. ``--lm-head`` also times the
LM head alone (final norm + vocabulary projection of one row, replicated).

Rank 0 prints one JSON line: per configuration the median step time (the slowest
rank's median), tokens/s, and every rank's median communication wait per step
(``Comm.wait_seconds`` inside the step, i.e. time blocked in collectives, which includes
waiting for a slower peer).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--context", type=int, nargs="+", required=True)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps of each block")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tp", choices=["on", "off"], nargs="+", default=["off"])
    parser.add_argument("--merge", choices=["allgather", "allreduce"], nargs="+",
                        default=["allgather"])
    parser.add_argument("--lm-head", action="store_true")
    args = parser.parse_args()

    import mlx.core as mx
    import numpy as np
    from mpi4py import MPI

    from spmd_cp.runtime.comm import Comm
    from spmd_cp.engine.engine import Engine
    from spmd_cp.models.loader import default_model_path, load_model
    from spmd_cp.engine.model import CPModel
    from spmd_cp.attention.partition import head_tail_positions

    comm = Comm(MPI.COMM_WORLD)
    model = CPModel(load_model(args.model or default_model_path()).model)
    tps = args.tp if comm.size > 1 else ["off"]
    merges = args.merge if comm.size > 1 else ["allgather"]
    engines = {(tp, merge): Engine(model, comm, decode_merge=merge, decode_tp=tp)
               for tp, merge in itertools.product(tps, merges)}

    attn = model.layers[0].self_attn
    head_dim = attn.o_proj.weight.shape[1] // attn.n_heads
    caches = {}
    for context in args.context:
        cache = next(iter(engines.values())).new_cache()
        rank_positions = head_tail_positions(context, comm.size)
        cache.add_positions(rank_positions, np.zeros(context, np.int64))
        local = rank_positions[comm.rank].size
        for layer in cache.layers:
            shape = (attn.n_kv_heads, local, head_dim)
            layer.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
        mx.eval([layer.keys for layer in cache.layers] + [layer.values for layer in cache.layers])
        caches[context] = cache

    steps = {key: ([], []) for key in itertools.product(args.context, tps, merges)}
    for _ in range(args.rounds):
        for context, (tp, merge) in itertools.product(args.context, engines):
            engine, cache = engines[(tp, merge)], caches[context]
            token = 1
            for step in range(args.tokens):
                comm.barrier()
                wait_before = comm.wait_seconds
                start = time.perf_counter()
                logits = engine.decode_step(cache, token)
                wait = comm.wait_seconds - wait_before
                token = int(mx.argmax(logits)) if comm.rank == 0 else 0
                token = comm.bcast_object(token)
                if step >= args.skip:
                    steps[(context, tp, merge)][0].append(time.perf_counter() - start)
                    steps[(context, tp, merge)][1].append(wait)
            cache.truncate(context)

    lm_head_s = None
    if args.lm_head:
        hidden = mx.random.normal((1, model.norm.weight.shape[0]))
        mx.eval(model.logits(hidden))
        times = []
        for _ in range(30):
            start = time.perf_counter()
            mx.eval(model.logits(hidden))
            times.append(time.perf_counter() - start)
        lm_head_s = float(np.median(times))

    mine = {f"{c}|{t}|{m}": (float(np.median(s)), float(np.median(w)))
            for (c, t, m), (s, w) in steps.items()}
    gathered = comm.gather_object(mine)
    heads = comm.gather_object(lm_head_s)
    if comm.rank == 0:
        configs = []
        for key in mine:
            context, tp, merge = key.split("|")
            step_s = max(g[key][0] for g in gathered)
            configs.append({"context": int(context), "tp": tp, "merge": merge, "step_s": step_s,
                            "tok_s": 1.0 / step_s, "wait_s": [g[key][1] for g in gathered],
                            "step_s_per_rank": [g[key][0] for g in gathered]})
        print(json.dumps({"ranks": comm.size, "tokens": args.tokens, "skip": args.skip,
                          "rounds": args.rounds, "configs": configs, "lm_head_s": heads}))


if __name__ == "__main__":
    from spmd_cp.blas import ensure_fast_blas

    ensure_fast_blas()
    main()
