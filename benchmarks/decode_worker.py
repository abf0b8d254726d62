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

Each step is one turn of spmd_cp.engine.generation.decode_tokens (the loop generate
runs: the decode step, rank 0's argmax, the token's broadcast). Rank 0 prints one JSON
line: per configuration the median step time (the slowest rank's median), tokens/s, and
every rank's median communication wait per step (``Comm.wait_seconds`` inside the step
and its broadcast, i.e. time blocked in collectives, which includes waiting for a slower
peer).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import benchlib


def parse_args():
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
    parser.add_argument("--decode-comm", choices=["auto", "mlx", "mpi"], default="auto",
                        help="the decode step's collectives (spmd-cp's --decode-comm)")
    return parser.parse_args()


def synthetic_cache(bench: benchlib.Worker, context: int):
    """A cache of ``context`` tokens at head-tail positions holding random K/V."""
    import mlx.core as mx

    from spmd_cp.attention.partition import head_tail_positions
    from spmd_cp.engine.cache.cache import ShardedKVCache

    comm, model = bench.comm, bench.model
    rank_positions = head_tail_positions(context, comm.size)
    attn = model.layers[0].self_attn
    shape = (model.num_kv_heads, rank_positions[comm.rank].size,
             attn.o_proj.weight.shape[1] // model.num_heads)
    arrays = {f"layer.{index}.{part}": mx.random.normal(shape)
              for index in range(model.num_layers) for part in ("keys", "values")}
    mx.eval(list(arrays.values()))
    shared = {"num_tokens": context, "token_ids": [0] * context, "decode_steps": 0,
              "decode_owner": 0, "shard_sizes": [p.size for p in rank_positions]}
    return ShardedKVCache.from_state(model.num_layers, comm.rank, rank_positions, arrays, shared)


def time_block(engine, cache, tokens: int, skip: int):
    """(seconds, comm wait) of each greedy step after the first ``skip``; the cache is
    rolled back afterwards, so every block decodes at the same context."""
    import mlx.core as mx

    from spmd_cp.engine.generation import decode_tokens

    comm, checkpoint = engine.comm, cache.checkpoint()
    first = mx.array([0.0, 1.0])  # rank 0's "logits": the first token fed is id 1
    steps = decode_tokens(engine, cache, first, mx.argmax, tokens + 1)
    next(steps)  # sampled from ``first``: no step yet
    times, waits = [], []
    for step in range(tokens):
        comm.barrier()
        wait_before, start = comm.wait_seconds, time.perf_counter()
        next(steps)
        if step >= skip:
            times.append(time.perf_counter() - start)
            waits.append(comm.wait_seconds - wait_before)
    cache.rollback(checkpoint)
    return times, waits


def lm_head_seconds(model) -> float:
    """Median time of the LM head alone: final norm + vocabulary projection of one row."""
    import mlx.core as mx
    import numpy as np

    hidden = mx.random.normal((1, model.norm.weight.shape[0]))
    mx.eval(model.logits(hidden))
    times = []
    for _ in range(30):
        start = time.perf_counter()
        mx.eval(model.logits(hidden))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def work(bench: benchlib.Worker, args):
    import numpy as np

    from spmd_cp.config import DecodeConfig
    from spmd_cp.engine.engine import Engine

    comm, model = bench.comm, bench.model
    tps = args.tp if comm.size > 1 else ["off"]
    merges = args.merge if comm.size > 1 else ["allgather"]
    engines = {(tp, merge): Engine(model, comm, decode=DecodeConfig(
                                       decode_merge=merge, decode_tp=tp,
                                       decode_comm=args.decode_comm))
               for tp, merge in itertools.product(tps, merges)}
    caches = {context: synthetic_cache(bench, context) for context in args.context}
    steps = {key: ([], []) for key in itertools.product(args.context, tps, merges)}
    for _ in range(args.rounds):
        for context, (tp, merge) in itertools.product(args.context, engines):
            times, waits = time_block(engines[(tp, merge)], caches[context], args.tokens,
                                      args.skip)
            steps[(context, tp, merge)][0].extend(times)
            steps[(context, tp, merge)][1].extend(waits)
    lm_head_s = lm_head_seconds(model) if args.lm_head else None

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
    arguments = parse_args()
    benchlib.worker_main(lambda bench: work(bench, arguments), arguments.model)
