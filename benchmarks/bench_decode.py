"""Decode tokens/s versus rank count, context length, --decode-tp and --decode-merge.

    python benchmarks/bench_decode.py                                 # the default sweep
    python benchmarks/bench_decode.py --contexts 16 2048 4096 8192 --ranks 1 2 4 --rounds 3

Drives benchmarks/decode_worker.py (a synthetic KV cache of exactly the context length,
so no prefill is paid; see its docstring). One launch per rank count and round; the rank
counts alternate (1 2 4 1 2 4 ...), and inside every launch all (context, tp, merge)
configurations alternate, so drift hits all alike. Reported: median over rounds of each
configuration's median step (the slowest rank's), tokens/s, the speed-up over N = 1 at
the same context, and each rank's communication wait per token.

Also the breakdown of the N = 1 step: the context-16 step is "everything except
attention" (weights: projections, MLP, LM head); the increase from 16 to C tokens is
attention over C cached tokens; the LM head (final norm + 49152 x 576 projection) is
timed alone.

One BLAS thread per rank (OPENBLAS_NUM_THREADS=1); N = 4 on a 2-core machine is
oversubscribed (two ranks per core). Results: benchmarks/results/decode.json and .md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

WORKER = Path(__file__).with_name("decode_worker.py")


def run(ranks, args) -> dict:
    cmd = bl.mpi_cmd(ranks, bl.PYTHON, WORKER, "--context", *args.contexts, "--tokens",
                     args.tokens, "--skip", args.skip, "--rounds", args.inner_rounds,
                     "--tp", *args.tp, "--merge", *args.merge,
                     *(["--lm-head"] if ranks == 1 else []))
    return bl.run_json(cmd, env=bl.bench_env(1))


class Launches:
    """Every launch's result per rank count, and the medians the tables need."""

    def __init__(self, args):
        self.args = args
        self.by_ranks = {n: [] for n in args.ranks}

    def values(self, n, context, tp, merge, key="step_s") -> list:
        return [c[key] for r in self.by_ranks[n] for c in r["configs"]
                if (c["context"], c["tp"], c["merge"]) == (context, tp, merge)]

    def step(self, n, context, tp="off", merge="allgather") -> float:
        return bl.median(self.values(n, context, tp, merge))

    def configs_of(self, n):
        if n == 1:
            return [("off", "allgather")]
        return [(tp, m) for tp in self.args.tp for m in self.args.merge]


def measure(args) -> Launches:
    launches = Launches(args)
    for rnd in range(args.rounds):
        for n in args.ranks:
            r = run(n, args)
            launches.by_ranks[n].append(r)
            best = max(r["configs"], key=lambda c: c["context"])
            bl.log(f"round {rnd + 1}: N={n}: " + ", ".join(
                f"{c['context']}/{c['tp']}/{c['merge']} {c['tok_s']:.1f}" for c in r["configs"]
                if c["context"] == best["context"]) + f" (others {r['_others']:.2f} cores)")
    return launches


def speed_table(launches: Launches, base: dict) -> str:
    args = launches.args
    rows = []
    for ctx in args.contexts:
        for n in args.ranks:
            for tp, merge in launches.configs_of(n):
                step = launches.step(n, ctx, tp, merge)
                waits = launches.values(n, ctx, tp, merge, "wait_s")
                wait = [bl.median(w[r] for w in waits) for r in range(n)]
                speed = f"{base[ctx] / step:.2f}x" if ctx in base else "-"
                rows.append([ctx, n, tp if n > 1 else "-", merge if n > 1 else "-",
                             f"{1 / step:.1f}", f"{1e3 * step:.1f}", speed,
                             " / ".join(f"{1e3 * w:.1f}" for w in wait)])
    table = bl.table(["context", "ranks", "decode-tp", "merge", "tok/s", "ms/token",
                      "speed-up vs N=1", "wait ms/token per rank"], rows)
    loads = [r["_load"][0] for rs in launches.by_ranks.values() for r in rs]
    others = [r["_others"] for rs in launches.by_ranks.values() for r in rs]
    return (f"{table}\n\nload average during the launches {min(loads):.1f}-{max(loads):.1f}; "
            f"cores used by other processes during a launch: up to {max(others):.2f}")


def merge_summary(launches: Launches) -> str | None:
    """Which merge is faster, per N and tp, at every context."""
    args = launches.args
    summary = []
    for n in args.ranks:
        if n == 1 or len(args.merge) < 2:
            continue
        for tp in args.tp:
            ratios = [launches.step(n, c, tp, "allgather") / launches.step(n, c, tp, "allreduce")
                      for c in args.contexts]
            summary.append(f"N={n} tp {tp}: allgather step / allreduce step = "
                           + ", ".join(f"{c}: {x:.2f}" for c, x in zip(args.contexts, ratios)))
    if not summary:
        return None
    return "\nmerge comparison (> 1: allreduce faster):\n\n" + "\n".join(f"- {s}" for s in summary)


def one_rank_breakdown(launches: Launches, base: dict) -> str:
    contexts = launches.args.contexts
    small = min(contexts)
    t_small = base[small]
    heads = [h for r in launches.by_ranks[1] for h in r.get("lm_head_s") or [] if h]
    head = bl.median(heads) if heads else float("nan")
    lines = [f"\nN = 1 step breakdown: context {small}: {1e3 * t_small:.1f} ms, of which "
             f"LM head {1e3 * head:.1f} ms ({100 * head / t_small:.0f}%) and the 30 "
             f"layers' weights etc. {1e3 * (t_small - head):.1f} ms"]
    for ctx in contexts:
        if ctx == small:
            continue
        attention = base[ctx] - t_small
        lines.append(f"- context {ctx}: {1e3 * base[ctx]:.1f} ms; attention over the cache "
                     f"~{1e3 * attention:.1f} ms ({100 * attention / base[ctx]:.0f}% of the "
                     f"step, {1e9 * attention / ctx / 30:.0f} ns per cached token per layer)")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[16, 2048, 4096, 8192])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tp", nargs="+", default=["off", "on"])
    parser.add_argument("--merge", nargs="+", default=["allgather", "allreduce"])
    parser.add_argument("--rounds", type=int, default=3, help="launches per rank count")
    parser.add_argument("--inner-rounds", type=int, default=1,
                        help="rounds over the configurations inside each launch")
    parser.add_argument("--tokens", type=int, default=16, help="decode steps per block")
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps per block")
    args = parser.parse_args()
    command = "python benchmarks/bench_decode.py " + shlex.join(sys.argv[1:])

    launches = measure(args)
    base = {ctx: launches.step(1, ctx) for ctx in args.contexts} if 1 in args.ranks else {}
    out = [bl.header("Decode speed versus ranks and context", command)]
    out.append(f"Synthetic KV cache of the given context; {args.tokens} steps per "
               f"configuration block ({args.skip} warm-up steps dropped); median over "
               f"{args.rounds} launches per rank count (alternating). 1 BLAS thread per "
               "rank; N = 4 is oversubscribed on 2 cores. Speed-up is over N = 1 at the "
               "same context. wait = per-token time blocked in collectives, per rank "
               "(includes waiting for a slower peer).\n")
    out.append(speed_table(launches, base))
    summary = merge_summary(launches)
    if summary:
        out.append(summary)
    if 1 in args.ranks:
        out.append(one_rank_breakdown(launches, base))
    text = "\n".join(out)
    bl.save("decode", {"args": vars(args), "machine": bl.machine(),
                       "launches": {str(n): v for n, v in launches.by_ranks.items()}}, text)
    print(text)


if __name__ == "__main__":
    main()
