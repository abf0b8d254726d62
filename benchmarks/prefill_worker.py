"""Times prefill on the ranks it is launched on; bench_prefill.py drives it.

    mpiexec -n N python benchmarks/prefill_worker.py --new 3072 --cached 0 --algo pass-kv
    mpiexec -n 2 python benchmarks/prefill_worker.py --new 128 --cached 2048 \
        --algo pass-kv pass-q allgather-kv --auto-choice --rounds 3

Loads the model once, prefills ``--cached`` tokens untimed (the document of a follow-up
question), then times prefills of ``--new`` tokens after it, rolling the cache back
between them. With several ``--algo`` values they alternate (A B C A B C ...) for
``--rounds`` rounds, so the machine's drift hits all alike. ``--auto-choice`` records what
``--cp-algo auto`` would pick for this call (the engine's own code path and calibration,
without running a forward pass).

``--profile`` adds one extra prefill per algorithm with synchronisation points around
every attention call and reports per rank where the time went: the rest of the layer
(projections, MLP, norms), attention compute, and time blocked in communication
(``Comm.wait_seconds``), plus how many attention scores the tiles computed against the
number the causal mask keeps (work wasted on masked scores). ``--split-runs`` is an
experiment, not the shipped code: it makes block attention tile each contiguous run of
query and key positions separately (see docs/BENCHMARKS.md).

Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict


def split_runs_block_attention(original):
    """block_attention that tiles every (query run, key run) pair separately.

    Head-tail shards are two runs of positions (a head chunk and a tail chunk). A tile
    that mixes both can never be skipped by the causal test, so its masked half is
    computed for nothing. Splitting by runs keeps the skip exact and the result exact
    (the partials merge like any other).
    """
    from spmd_cp.attention.block import merge_partials
    from spmd_cp.engine.model import contiguous_runs

    def attention(q, k, v, q_pos, k_pos, scale):
        q_runs, k_runs = contiguous_runs(q_pos), contiguous_runs(k_pos)
        if q.shape[1] <= 1 or len(q_runs) * len(k_runs) <= 1 or len(q_runs) > 8 or len(k_runs) > 8:
            return original(q, k, v, q_pos, k_pos, scale)
        import mlx.core as mx

        outs, lses = [], []
        for qa, qb, _ in q_runs:
            qp = q_pos[qa:qb]
            out = lse = None
            for ka, kb, _ in k_runs:
                kp = k_pos[ka:kb]
                if kp.min() > qp.max():
                    continue
                o, s = original(q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], qp, kp, scale)
                out, lse = (o, s) if out is None else merge_partials(out, lse, o, s)
            if out is None:
                out, lse = original(q[:, qa:qb], k[:, :0], v[:, :0], qp, k_pos[:0], scale)
            outs.append(out)
            lses.append(lse)
        return mx.concatenate(outs, axis=1), mx.concatenate(lses, axis=1)

    return attention


def install_profiler(comm, prof: dict):
    """Wrap the engine's attention functions and the tile kernel with timers/counters."""
    import mlx.core as mx
    import numpy as np

    import spmd_cp.attention.block as block
    import spmd_cp.engine.engine as engine_module

    original_tile = block._tile_attention
    original_prefill_attention = engine_module.prefill_attention

    def counting_tile(q, k, v, q_pos, k_pos, scale):
        if prof["on"]:
            scores = q.shape[0] * q.shape[1] * k.shape[1]
            prof["scores"] += scores
            if q_pos is None:  # a tile every query sees entirely (no mask computed)
                prof["visible"] += scores
            else:
                qp, kp = np.asarray(q_pos), np.asarray(k_pos)
                prof["visible"] += q.shape[0] * int((kp[None, :] <= qp[:, None]).sum())
        return original_tile(q, k, v, q_pos, k_pos, scale)

    def timed_prefill_attention(*args, **kwargs):
        attend, algo, reason = original_prefill_attention(*args, **kwargs)

        def timed(q, keys, values, q_pos, k_pos, scale):
            if not prof["on"]:
                return attend(q, keys, values, q_pos, k_pos, scale)
            t0 = time.perf_counter()
            mx.eval(q, keys, values)
            t1 = time.perf_counter()
            wait0 = comm.wait_seconds
            out = attend(q, keys, values, q_pos, k_pos, scale)
            mx.eval(out)
            t2 = time.perf_counter()
            prof["rest_s"] += t1 - t0
            prof["attention_s"] += t2 - t1
            prof["wait_s"] += comm.wait_seconds - wait0
            prof["layers"] += 1
            return out

        return timed, algo, reason

    block._tile_attention = counting_tile
    engine_module.prefill_attention = timed_prefill_attention


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--new", type=int, required=True)
    parser.add_argument("--cached", type=int, default=0)
    parser.add_argument("--algo", nargs="+", default=["auto"])
    parser.add_argument("--chunk", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="(old name) rounds, when --rounds is not given")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--warmup", action="store_true",
                        help="one untimed prefill of 64 tokens per algorithm first")
    parser.add_argument("--auto-choice", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--split-runs", action="store_true")
    args = parser.parse_args()
    rounds = args.rounds or args.repeats

    import mlx.core as mx
    import numpy as np
    from mpi4py import MPI

    import spmd_cp.attention.gather as gather
    import spmd_cp.attention.ring as ring
    from spmd_cp.runtime.comm import Comm
    from spmd_cp.engine.engine import Engine
    from spmd_cp.models.loader import default_model_path, load_model
    from spmd_cp.engine.model import CPModel

    if args.split_runs:
        ring.block_attention = split_runs_block_attention(ring.block_attention)
        gather.block_attention = split_runs_block_attention(gather.block_attention)

    comm = Comm(MPI.COMM_WORLD)
    model = CPModel(load_model(args.model or default_model_path()).model)
    ids = np.random.RandomState(0).randint(3, 20000, size=args.cached + args.new)
    engines = {a: Engine(model, comm, algo=a, prefill_chunk=args.chunk) for a in args.algo}
    cache = engines[args.algo[0]].new_cache()
    if args.cached:
        Engine(model, comm, algo="pass-kv").prefill(cache, ids[: args.cached])

    result = {"ranks": comm.size, "new": args.new, "cached": args.cached, "chunk": args.chunk,
              "split_runs": args.split_runs, "results": {}}

    if args.auto_choice:
        from spmd_cp.attention import prefill_attention
        from spmd_cp.attention.partition import head_tail_positions

        auto = Engine(model, comm, algo="auto")
        new = args.new if args.chunk <= 0 else min(args.chunk, args.new)
        rank_positions = head_tail_positions(new, comm.size, cache.num_tokens, cache.shard_sizes)
        cache.add_positions(rank_positions, ids[args.cached:args.cached + new])
        start = time.perf_counter()
        measured = auto._measured()
        calibrate_s = time.perf_counter() - start
        _, algo, reason = prefill_attention("auto", comm, rank_positions, cache, model, measured)
        cache.truncate(args.cached)
        result["auto"] = {"algo": algo, "reason": reason, "calibrate_s": calibrate_s,
                          "measured": measured.__dict__ if measured is not None else None}

    def one_prefill(algo, tokens):
        engine = engines[algo]
        cache.truncate(args.cached)
        engine.algos_used.clear()
        comm.barrier()
        before, wait_before = comm.bytes_sent, comm.wait_seconds
        start = time.perf_counter()
        engine.prefill(cache, tokens)
        end = time.perf_counter()  # this rank's own time (before waiting for the others)
        comm.barrier()
        return {"time": time.perf_counter() - start, "own": end - start,
                "sent": comm.bytes_sent - before, "wait": comm.wait_seconds - wait_before,
                "chosen": sorted(set(engine.algos_used))}

    if args.warmup:
        for algo in args.algo:
            one_prefill(algo, ids[args.cached:args.cached + 64])
    runs = defaultdict(list)
    mx.reset_peak_memory()
    for _ in range(rounds):
        for algo in args.algo:
            runs[algo].append(one_prefill(algo, ids[args.cached:]))
    peaks = comm.gather_object(int(mx.get_peak_memory()))

    profiles = {}
    if args.profile:
        prof = defaultdict(float)
        prof["on"] = False
        install_profiler(comm, prof)
        for algo in args.algo:
            prof.clear()
            prof["on"] = True
            run = one_prefill(algo, ids[args.cached:])
            prof["on"] = False
            mine = {k: v for k, v in prof.items() if k != "on"}
            mine.update(total_s=run["own"], wait_total_s=run["wait"])
            profiles[algo] = comm.gather_object(mine)

    for algo in args.algo:
        per_rank = comm.gather_object([(r["own"], r["wait"], r["sent"]) for r in runs[algo]])
        entry = {"times_s": [r["time"] for r in runs[algo]],
                 "chosen": runs[algo][0]["chosen"],
                 "own_s": [[x[0] for x in rank] for rank in per_rank] if per_rank else None,
                 "wait_s": [[x[1] for x in rank] for rank in per_rank] if per_rank else None,
                 "comm_bytes": [rank[-1][2] for rank in per_rank] if per_rank else None}
        if algo in profiles:
            entry["profile"] = profiles[algo]
        result["results"][algo] = entry
    result["peak_mem_bytes"] = peaks
    if comm.rank == 0:
        # Backward compatible with the one-algorithm format.
        first = result["results"][args.algo[0]]
        result.update(algo=args.algo[0], times_s=first["times_s"], chosen=first["chosen"],
                      comm_bytes=first["comm_bytes"])
        print(json.dumps(result))


if __name__ == "__main__":
    from spmd_cp.blas import ensure_fast_blas

    ensure_fast_blas()
    main()
