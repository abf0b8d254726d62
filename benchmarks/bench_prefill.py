"""Prefill scaling and algorithm comparison, measured side by side in one run.

    python benchmarks/bench_prefill.py scaling --new 3072 --ranks 1 2 --rounds 3
    python benchmarks/bench_prefill.py scaling --new 3072 --ranks 1 2 --rounds 3 --profile
    python benchmarks/bench_prefill.py algos --ranks 2 --mix 2048:0 --mix 128:2048

``scaling``: prefill time versus N with one BLAS thread per rank (OPENBLAS_NUM_THREADS=1),
and the parallel efficiency T1 / (N * TN). Rounds alternate the rank counts (1 2 1 2 ...);
each launch warms up with a 64-token prefill, then times one prefill of --new tokens.
``--profile`` adds, per launch, one prefill with synchronisation around every attention
call: per-rank time in the rest of the layers, attention compute and communication wait.

``algos``: pass-kv, pass-q and allgather-kv alternate inside one launch per new:cached mix
and round (the cached prefix is prefilled once per launch, untimed); the launch also
records what ``--cp-algo auto`` picks for that call, so one can see whether it picked the
measured fastest.

Every table carries the load average and the cores other processes used during the runs
(the machine is shared). Results go to benchmarks/results/prefill_<what>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

WORKER = Path(__file__).with_name("prefill_worker.py")


def run_worker(ranks: int, new: int, cached: int, algos: list[str], rounds: int = 1,
               extra: tuple = (), threads: int = 1) -> dict:
    cmd = bl.mpi_cmd(ranks, bl.PYTHON, WORKER, "--new", new, "--cached", cached, "--algo",
                     *algos, "--rounds", rounds, *extra)
    return bl.run_json(cmd, env=bl.bench_env(threads))


def best_time(run: dict, algo: str) -> float:
    return min(run["results"][algo]["times_s"])


def scaling(args) -> str:
    configs = [("shipped", ())]
    runs = {(n, c): [] for n in args.ranks for c, _ in configs}
    for rnd in range(args.rounds):
        for n in args.ranks:
            for name, flags in configs:
                if (n, name) not in runs:
                    continue
                profile = args.profile and rnd < args.profile_rounds
                extra = ("--warmup", *flags) + (("--profile",) if profile else ())
                r = run_worker(n, args.new, 0, ["pass-kv"], 1, extra)
                runs[(n, name)].append(r)
                bl.log(f"round {rnd + 1}: N={n} {name}: {best_time(r, 'pass-kv'):.2f} s "
                       f"(others used {r['_others']:.2f} cores)")
    out = [bl.header(f"Prefill scaling, {args.new} tokens, pass-kv, 1 BLAS thread per rank",
                     args.command)]
    out.append(f"Median of {args.rounds} rounds (rank counts alternate; one launch per "
               "configuration per round, a 64-token warm-up prefill first). Efficiency = "
               "T1 / (N * TN); 'paired' = median over rounds of the same ratio within each "
               "round. N > cores is oversubscribed.\n")
    rows = []
    t1_runs = runs[(args.ranks[0], "shipped")]
    t1 = bl.median(best_time(r, "pass-kv") for r in t1_runs) * args.ranks[0]
    for name, _ in configs:
        for n in args.ranks:
            if (n, name) not in runs:
                continue
            times = [best_time(r, "pass-kv") for r in runs[(n, name)]]
            t = bl.median(times)
            paired = bl.median(best_time(b, "pass-kv") * args.ranks[0] / (n * best_time(r, "pass-kv"))
                               for b, r in zip(t1_runs, runs[(n, name)]))
            loads = [r["_load"][0] for r in runs[(n, name)]]
            others = [r["_others"] for r in runs[(n, name)]]
            rows.append([name, n, bl.fmt(t), ", ".join(bl.fmt(x) for x in times),
                         f"{args.new / t:.0f}", bl.fmt(t1 / t), bl.fmt(t1 / (n * t)),
                         bl.fmt(paired), f"{min(loads):.1f}-{max(loads):.1f}",
                         f"{max(others):.2f}"])
    out.append(bl.table(["attention tiles", "ranks", "prefill s", "all rounds s", "tok/s",
                         "speed-up", "efficiency", "paired eff.", "load avg",
                         "others' cores (max)"], rows))
    if args.profile:
        out.append(profile_table(args, configs, runs))
    text = "\n".join(out)
    bl.save("prefill_scaling", {"args": vars(args), "machine": bl.machine(),
                                "runs": {f"{n}:{c}": v for (n, c), v in runs.items()}}, text)
    return text


def profile_table(args, configs, runs) -> str:
    """Per rank: where one profiled prefill's time went."""
    rows = []
    for name, _ in configs:
        for n in args.ranks:
            if (n, name) not in runs:
                continue
            for rank in range(n):
                def med(key):
                    return bl.median(r["results"]["pass-kv"]["profile"][rank][key]
                                     for r in runs[(n, name)]
                                     if "profile" in r["results"]["pass-kv"])
                total, attn, wait = med("total_s"), med("attention_s"), med("wait_s")
                rows.append([name, n, rank, bl.fmt(total), bl.fmt(total - attn),
                             bl.fmt(attn - wait), bl.fmt(wait)])
    return (f"\nWhere the time goes (one extra prefill per launch in the first "
            f"{args.profile_rounds} round(s), with synchronisation around every attention "
            "call, so a little slower; per rank; 'non-attention' = norms, projections, "
            "RoPE, cache append, MLP; medians over the profiled rounds):\n\n"
            + bl.table(["tiles", "ranks", "rank", "total s", "non-attention s",
                        "attention compute s", "comm wait s"], rows))


def algos(args) -> str:
    mixes = [tuple(int(x) for x in mix.split(":")) for mix in args.mix]
    names = ["pass-kv", "pass-q", "allgather-kv"]
    n = args.ranks[0]
    runs = {m: [] for m in mixes}
    for rnd in range(args.rounds):
        for mix in mixes:
            r = run_worker(n, mix[0], mix[1], names, 1, ("--warmup", "--auto-choice"))
            runs[mix].append(r)
            bl.log(f"round {rnd + 1}: {mix}: " + ", ".join(
                f"{a} {best_time(r, a):.2f}s" for a in names) + f"; auto -> {r['auto']['algo']}")
    out = [bl.header(f"Prefill algorithms on {n} ranks", args.command)]
    out.append(f"Median of {args.rounds} rounds; inside each launch the three algorithms "
               "alternate after a 64-token warm-up; the cached prefix is prefilled once per "
               "launch (untimed). 'auto chose' is what `--cp-algo auto` picks for the same "
               "call on the same ranks (its calibration: attention FLOP/s C and ring "
               "bandwidth BW, measured on these ranks). 1 BLAS thread per rank.\n")
    rows = []
    for mix in mixes:
        times = {a: bl.median(best_time(r, a) for r in runs[mix]) for a in names}
        fastest = min(names, key=times.get)
        chosen = sorted({r["auto"]["algo"] for r in runs[mix]})
        mb = " / ".join(f"{max(runs[mix][0]['results'][a]['comm_bytes']) / 2**20:.1f}"
                        for a in names)
        waits = " / ".join(bl.fmt(max(bl.median(w) for w in runs[mix][0]["results"][a]["wait_s"]))
                           for a in names)
        ratio = times[chosen[0]] / times[fastest]
        ok = "yes" if chosen == [fastest] else (
            "mixed" if len(chosen) > 1 else f"within 5% ({ratio:.3f}x)" if ratio <= 1.05
            else f"no ({chosen[0]} is {ratio:.3f}x the fastest)")
        loads = [r["_load"][0] for r in runs[mix]]
        rows.append([mix[0], mix[1], bl.fmt(times["pass-kv"]), bl.fmt(times["pass-q"]),
                     bl.fmt(times["allgather-kv"]), fastest, ",".join(chosen), ok, mb, waits,
                     f"{min(loads):.1f}-{max(loads):.1f}",
                     f"{max(r['_others'] for r in runs[mix]):.2f}"])
    out.append(bl.table(["new", "cached", "pass-kv s", "pass-q s", "allgather-kv s",
                         "fastest", "auto chose", "auto = fastest?",
                         "MB sent/rank kv / q / ag", "comm wait s kv / q / ag", "load avg",
                         "others' cores (max)"], rows))
    reasons = {f"{m[0]}:{m[1]}": runs[m][0]["auto"]["reason"] for m in mixes}
    out.append("\nauto's reasons: " + "; ".join(f"{k}: {v}" for k, v in reasons.items()))
    measured = runs[mixes[0]][0]["auto"]["measured"]
    if measured:
        out.append(f"\ncalibration: C = {measured['attention_flops'] / 1e9:.1f} GFLOP/s, "
                   f"BW = {measured['ring_bytes_per_s'] / 1e9:.2f} GB/s, latency "
                   f"{measured['ring_latency_s'] * 1e6:.0f} us")
    text = "\n".join(out)
    bl.save("prefill_algos", {"args": vars(args), "machine": bl.machine(),
                              "runs": {f"{m[0]}:{m[1]}": v for m, v in runs.items()}}, text)
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["scaling", "algos"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--new", type=int, default=3072)
    parser.add_argument("--mix", action="append", default=None, help="NEW:CACHED")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-rounds", type=int, default=1,
                        help="rounds whose launches also run the --profile prefill")
    args = parser.parse_args()
    args.command = "python benchmarks/bench_prefill.py " + shlex.join(sys.argv[1:])
    if args.what == "algos" and not args.mix:
        args.mix = ["4096:0", "256:4096"]
    text = {"scaling": scaling, "algos": algos}[args.what](args)
    print(text)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
