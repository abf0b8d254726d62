"""Prefill scaling and algorithm comparison, measured side by side in one run.

    python benchmarks/bench_prefill.py scaling --new 3072 --ranks 1 2
    python benchmarks/bench_prefill.py algos --ranks 2 --mix 4096:0 --mix 256:4096

``scaling``: prefill time versus N with one BLAS thread per rank, and the parallel
efficiency T1 / (N * TN). ``algos``: pass-kv, pass-q and allgather-kv for each
new:cached mix, plus what ``auto`` chose, so one can see whether it chose the fastest.
Configurations are run in alternating rounds so the machine's drift hits all alike;
the median over rounds is reported. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("prefill_worker.py")
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])


def run_worker(ranks: int, new: int, cached: int, algo: str, repeats: int = 1) -> dict:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, str(WORKER), "--new", str(new),
           "--cached", str(cached), "--algo", algo, "--repeats", str(repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_time(results: list[dict]) -> float:
    return statistics.median(min(r["times_s"]) for r in results)


def scaling(args):
    runs = {n: [] for n in args.ranks}
    for _ in range(args.rounds):
        for n in args.ranks:
            runs[n].append(run_worker(n, args.new, 0, "pass-kv", args.repeats))
    base = median_time(runs[args.ranks[0]]) * args.ranks[0]
    print(f"\nPrefill of {args.new} tokens, pass-kv, 1 BLAS thread per rank, "
          f"median of {args.rounds} rounds\n")
    print("| ranks | prefill s | tok/s | speed-up | efficiency T1/(N*TN) |")
    print("|---|---|---|---|---|")
    for n in args.ranks:
        t = median_time(runs[n])
        print(f"| {n} | {t:.2f} | {args.new / t:.0f} | {base / t:.2f} | {base / (n * t):.2f} |")


def algos(args):
    mixes = [tuple(int(x) for x in mix.split(":")) for mix in args.mix]
    names = ["pass-kv", "pass-q", "allgather-kv", "auto"]
    runs = {(m, a): [] for m in mixes for a in names}
    for _ in range(args.rounds):
        for mix in mixes:
            for algo in names:
                runs[(mix, algo)].append(run_worker(args.ranks[0], *mix, algo, args.repeats))
    print(f"\nPrefill algorithms on {args.ranks[0]} ranks, median of {args.rounds} rounds\n")
    print("| new | cached | pass-kv s | pass-q s | allgather-kv s | auto chose | fastest |"
          " comm MB/rank kv / q / ag |")
    print("|---|---|---|---|---|---|---|---|")
    for mix in mixes:
        times = {a: median_time(runs[(mix, a)]) for a in names}
        fastest = min(names[:3], key=times.get)
        chosen = ",".join(runs[(mix, "auto")][0]["chosen"])
        mb = " / ".join(f"{max(runs[(mix, a)][0]['comm_bytes']) / 2**20:.1f}" for a in names[:3])
        print(f"| {mix[0]} | {mix[1]} | {times['pass-kv']:.2f} | {times['pass-q']:.2f} | "
              f"{times['allgather-kv']:.2f} | {chosen} | {fastest} | {mb} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["scaling", "algos"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--new", type=int, default=3072)
    parser.add_argument("--mix", action="append", default=None, help="NEW:CACHED")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    if args.what == "algos" and not args.mix:
        args.mix = ["4096:0", "256:4096"]
    {"scaling": scaling, "algos": algos}[args.what](args)


if __name__ == "__main__":
    main()
