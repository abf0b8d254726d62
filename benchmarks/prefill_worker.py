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
every attention call (through the Engine's ``make_prefill_attention`` hook) and reports
per rank where the time went: the rest of the layer (projections, MLP, norms), attention
compute, and time blocked in communication (``Comm.wait_seconds``).

Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import benchlib


def parse_args():
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
    return parser.parse_args()


def timed_prefill_attention(comm, prof: dict):
    """attention.prefill_attention, its attend functions timed while ``prof["on"]``."""
    import mlx.core as mx

    from spmd_cp.attention import prefill_attention

    def make(*args):
        attend, algo, reason = prefill_attention(*args)

        def timed(q, keys, values, q_pos, k_pos, scale, window=None):
            if not prof["on"]:
                return attend(q, keys, values, q_pos, k_pos, scale, window)
            t0 = time.perf_counter()
            mx.eval(q, keys, values)
            t1 = time.perf_counter()
            wait0 = comm.wait_seconds
            out = attend(q, keys, values, q_pos, k_pos, scale, window)
            mx.eval(out)
            t2 = time.perf_counter()
            prof["rest_s"] += t1 - t0
            prof["attention_s"] += t2 - t1
            prof["wait_s"] += comm.wait_seconds - wait0
            prof["layers"] += 1
            return out

        return timed, algo, reason

    return make


def auto_choice(bench: benchlib.Worker, cache, ids, args) -> dict:
    """What --cp-algo auto picks for this call: the engine's calibration and rule, no
    forward pass."""
    from spmd_cp.attention import prefill_attention
    from spmd_cp.attention.partition import head_tail_positions
    from spmd_cp.engine.engine import Engine

    comm = bench.comm
    new = args.new if args.chunk <= 0 else min(args.chunk, args.new)
    rank_positions = head_tail_positions(new, comm.size, cache.num_tokens, cache.shard_sizes)
    cache.add_positions(rank_positions, ids[args.cached:args.cached + new])
    start = time.perf_counter()
    measured = Engine(bench.model, comm, algo="auto").calibration()
    calibrate_s = time.perf_counter() - start
    _, algo, reason = prefill_attention("auto", comm, rank_positions, cache, bench.model,
                                        measured)
    cache.truncate(args.cached)
    return {"algo": algo, "reason": reason, "calibrate_s": calibrate_s,
            "measured": measured.__dict__ if measured is not None else None}


def profiled(comm, prof: dict, prefill) -> list | None:
    """Every rank's time split of one ``prefill()`` (rank 0; None elsewhere)."""
    prof.clear()
    prof["on"] = True
    run = prefill()
    prof["on"] = False
    mine = {k: v for k, v in prof.items() if k != "on"}
    mine.update(total_s=run["own"], wait_total_s=run["wait"])
    return comm.gather_object(mine)


def algo_entry(comm, runs: list[dict], profile) -> dict:
    per_rank = comm.gather_object([(r["own"], r["wait"], r["sent"]) for r in runs])
    entry = {"times_s": [r["time"] for r in runs], "chosen": runs[0]["chosen"],
             "own_s": [[x[0] for x in rank] for rank in per_rank] if per_rank else None,
             "wait_s": [[x[1] for x in rank] for rank in per_rank] if per_rank else None,
             "comm_bytes": [rank[-1][2] for rank in per_rank] if per_rank else None}
    if profile is not None:
        entry["profile"] = profile
    return entry


def work(bench: benchlib.Worker, args):
    import mlx.core as mx

    from spmd_cp.engine.engine import Engine

    comm, model = bench.comm, bench.model
    rounds = args.rounds or args.repeats
    ids = bench.random_ids(args.cached + args.new)
    prof = defaultdict(float)
    prof["on"] = False
    make = timed_prefill_attention(comm, prof)
    engines = {a: Engine(model, comm, algo=a, prefill_chunk=args.chunk,
                         make_prefill_attention=make) for a in args.algo}
    cache = engines[args.algo[0]].new_cache()
    if args.cached:
        Engine(model, comm, algo="pass-kv").prefill(cache, ids[: args.cached])

    result = {"ranks": comm.size, "new": args.new, "cached": args.cached, "chunk": args.chunk,
              "results": {}}
    if args.auto_choice:
        result["auto"] = auto_choice(bench, cache, ids, args)

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
    for algo in args.algo if args.profile else []:
        profiles[algo] = profiled(comm, prof, lambda: one_prefill(algo, ids[args.cached:]))
    for algo in args.algo:
        result["results"][algo] = algo_entry(comm, runs[algo], profiles.get(algo))
    result["peak_mem_bytes"] = peaks
    if comm.rank == 0:
        # Backward compatible with the one-algorithm format.
        first = result["results"][args.algo[0]]
        result.update(algo=args.algo[0], times_s=first["times_s"], chosen=first["chosen"],
                      comm_bytes=first["comm_bytes"])
        print(json.dumps(result))


if __name__ == "__main__":
    arguments = parse_args()
    benchlib.worker_main(lambda bench: work(bench, arguments), arguments.model)
