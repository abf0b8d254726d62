"""Soak test: many generations in one job; memory must not grow, no process may be left.

    python benchmarks/soak.py                        # 200 generations + a 20-job batch, N = 2
    python benchmarks/soak.py --generations 50 --jobs 10

Part 1: ``mpiexec -n 2 python benchmarks/soak.py --worker`` loads the model once and runs
--generations short generations through spmd_cp.engine.generation.generate (the engine the CLI
uses: --cp-algo auto, --decode-tp auto, allgather merge), each on a fresh sharded cache,
with prompts of varying length (16-256 tokens) and 8 greedy tokens. After every
generation each rank records its RSS (/proc/self/status), MLX active memory and MLX
buffer-cache memory. The slope (least squares, bytes per generation) is fitted over the
generations after the first --warmup ones.

Part 2: ``mpiexec -n 2 spmd-cp batch`` on --jobs jobs (half of them share a prefix
document, so the prefix-cache path runs too), while this script samples every rank's RSS
from /proc every 0.2 s and counts finished result lines; RSS is regressed on jobs done.

Afterwards: no process of either job may remain (checked by pid and by a unique tag in
the command lines, with pgrep). Results: benchmarks/results/soak.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from it an be this which or are "
         "river city light system model paper signal garden winter morning answer window "
         "bridge ocean planet memory network energy history market school theory island").split()


def slope(xs, ys) -> float:
    """Least-squares slope of ys on xs."""
    n = len(xs)
    if n < 2:
        return float("nan")
    mx_, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx_) ** 2 for x in xs)
    return sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")


def rss_now() -> int:
    return bl.proc_status(os.getpid()).get("VmRSS", 0)


def worker(bench: bl.Worker, args):
    import mlx.core as mx
    import numpy as np

    from spmd_cp.engine.engine import Engine
    from spmd_cp.config import SamplingConfig
    from spmd_cp.engine.generation import generate

    comm, tokenizer = bench.comm, bench.loaded.tokenizer
    engine = Engine(bench.model, comm, algo="auto")  # decode: DecodeConfig()'s auto
    rng = np.random.RandomState(0)
    options = SamplingConfig(max_tokens=args.max_tokens)
    records = []
    start = time.perf_counter()
    for g in range(args.generations):
        ids = None
        if comm.rank == 0:
            words = [WORDS[i] for i in rng.randint(0, len(WORDS), size=rng.randint(12, 200))]
            ids = np.asarray(tokenizer.encode(" ".join(words)), np.int64)[:256]
        ids = comm.bcast_object(ids)
        cache = engine.new_cache()
        result = generate(engine, cache, ids, tokenizer, options)
        del cache
        records.append((g, time.perf_counter() - start, rss_now(), int(mx.get_active_memory()),
                        int(mx.get_cache_memory()), len(result.tokens) if comm.rank == 0 else 0))
    gathered = comm.gather_object(records)
    if comm.rank == 0:
        print(json.dumps({"ranks": comm.size, "generations": args.generations,
                          "records": gathered}))


def fit(records, warmup, column) -> float:
    tail = [r for r in records if r[0] >= warmup]
    return slope([r[0] for r in tail], [r[column] for r in tail])


def leftovers(tag: str, pids) -> list[str]:
    found = subprocess.run(["pgrep", "-af", tag], capture_output=True, text=True).stdout
    mine = [line for line in found.splitlines() if "pgrep" not in line]
    alive = [p for p in pids if os.path.exists(f"/proc/{p}")]
    return mine + [f"pid {p} alive" for p in alive]


def generations(args, tag: str, out: list) -> dict:
    """Part 1: --generations generations in one job; its table appended to ``out``."""
    cmd = bl.mpi_cmd(args.ranks, bl.PYTHON, __file__, "--worker", "--generations",
                     args.generations, "--max-tokens", args.max_tokens, "--tag", tag)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=bl.bench_env(1))
    with bl.TreeSampler(proc.pid, interval=0.5) as sampler1:
        stdout, stderr = proc.communicate(timeout=7200)
    wall1 = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"soak worker failed:\n{stderr[-3000:]}")
    part1 = json.loads(stdout.strip().splitlines()[-1])
    time.sleep(1.0)
    left1 = leftovers(tag, sampler1.seen)
    rows = []
    for rank, records in enumerate(part1["records"]):
        first, last = records[args.warmup], records[-1]
        rows.append([rank, f"{first[2] / 2**20:.0f} -> {last[2] / 2**20:.0f}",
                     f"{fit(records, args.warmup, 2):,.0f}",
                     f"{first[3] / 2**20:.0f} -> {last[3] / 2**20:.0f}",
                     f"{fit(records, args.warmup, 3):,.0f}",
                     f"{first[4] / 2**20:.0f} -> {last[4] / 2**20:.0f}",
                     f"{fit(records, args.warmup, 4):,.0f}"])
    tokens = sum(r[5] for r in part1["records"][0])
    out.append(f"### Part 1: {args.generations} generations (generation.generate, fresh cache "
               f"each, prompts 12-200 words, {args.max_tokens} greedy tokens)\n")
    out.append(f"{wall1:.0f} s wall ({args.generations / wall1:.2f} generations/s), "
               f"{tokens} tokens generated. Values after generation {args.warmup} -> after the "
               f"last; slopes fitted over generations {args.warmup}-{args.generations - 1}.\n")
    out.append(bl.table(["rank", "RSS MiB", "RSS slope B/generation", "MLX active MiB",
                         "active slope B/gen", "MLX cache MiB", "cache slope B/gen"], rows))
    out.append(f"\nleft after the job: {left1 or 'nothing'} (pgrep -af {tag}; the "
               f"{len(sampler1.seen)} sampled pids)")
    return {"part1": part1, "part1_wall_s": wall1, "part1_leftovers": left1}


def write_jobs(args, tag: str) -> tuple[Path, Path]:
    """Part 2's job file (every other job with a shared prefix document) and its output."""
    work = Path(tempfile.mkdtemp(prefix=f"{tag}-"))
    doc = work / "document.txt"
    rng = __import__("random").Random(1)
    doc.write_text(" ".join(rng.choice(WORDS) for _ in range(600)) + "\n")
    with open(work / "jobs.jsonl", "w") as f:
        for j in range(args.jobs):
            job = {"id": f"j{j}", "max_tokens": 8,
                   "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60)))}
            if j % 2:
                job["prefix_file"] = str(doc)
            f.write(json.dumps(job) + "\n")
    return work / "jobs.jsonl", work / "out.jsonl"


def rss_per_job(args, sampler) -> list[list]:
    """Each spmd-cp process's RSS regressed on the jobs finished (one row a process)."""
    per_pid = {}
    for t, rss, finished in sampler.series:
        for pid, value in rss.items():
            # Up to the last job's result: the exit afterwards frees memory (not a trend).
            if "spmd-cp" in sampler.cmds.get(pid, "") and args.warmup_jobs <= finished < args.jobs:
                per_pid.setdefault(pid, []).append((finished, value, t))
    rows = []
    for i, (pid, pts) in enumerate(sorted(per_pid.items())):
        rows.append([i, pid, len(pts), f"{pts[0][1] / 2**20:.0f} -> {pts[-1][1] / 2**20:.0f}",
                     f"{slope([p[0] for p in pts], [p[1] for p in pts]):,.0f}",
                     f"{max(sampler.peak.get(pid, 0), 0) / 2**20:.0f}"])
    return rows


def batch(args, tag: str, out: list) -> dict:
    """Part 2: an spmd-cp batch of --jobs jobs; its table appended to ``out``."""
    jobs, output = write_jobs(args, tag)

    def done():
        try:
            return sum(1 for _ in open(output))
        except OSError:
            return 0

    cmd = bl.mpi_cmd(args.ranks, bl.SPMD_CP, "batch", "--jobs", jobs, "--output",
                     output, "--progress", "off", "--json")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=bl.bench_env(1))
    with bl.TreeSampler(proc.pid, interval=0.2, extra=done) as sampler2:
        stdout, stderr = proc.communicate(timeout=7200)
    wall2 = time.perf_counter() - t0
    results = [json.loads(line) for line in open(output)] if output.exists() else []
    errors = [r for r in results if "error" in r]
    time.sleep(1.0)
    left2 = leftovers(tag, sampler2.seen)
    rows2 = rss_per_job(args, sampler2)
    out.append(f"\n### Part 2: `spmd-cp batch`, {args.jobs} jobs (every other one with a "
               "shared 600-word prefix document), 8 tokens each\n")
    out.append(f"exit {proc.returncode}, {wall2:.0f} s wall, {len(results)} result lines, "
               f"{len(errors)} errors. RSS sampled every 0.2 s and regressed on the number of "
               f"finished result lines, from {args.warmup_jobs} finished jobs (warm-up: the "
               "first plain and the first prefix job) to the last but one (the exit frees "
               "memory); processes in launch order (not necessarily rank order).\n")
    out.append(bl.table(["process", "pid", "samples", "RSS MiB first -> last",
                         "RSS slope B/job", "peak RSS MiB"], rows2))
    out.append(f"\nleft after the job: {left2 or 'nothing'} (pgrep -af {tag}; the "
               f"{len(sampler2.seen)} sampled pids)")
    return {"part2": {"returncode": proc.returncode, "wall_s": wall2, "results": results,
                      "series": sampler2.series, "leftovers": left2,
                      "cmds": {pid: bl.portable_text(cmd, scratch=jobs.parent)
                               for pid, cmd in sampler2.cmds.items()},
                      "stderr": bl.portable_text(stderr[-3000:], scratch=jobs.parent)}}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generations", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--warmup-jobs", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        bl.worker_main(lambda bench: worker(bench, args))
    command = "python benchmarks/soak.py " + shlex.join(sys.argv[1:])
    tag = f"soak-{uuid.uuid4().hex[:10]}"
    out = [bl.header(f"Soak: {args.generations} generations in one job, then a "
                     f"{args.jobs}-job batch, N = {args.ranks}", command)]
    saved = {"args": vars(args), "machine": bl.machine(), **generations(args, tag, out),
             **batch(args, tag, out)}
    text = "\n".join(out)
    bl.save("soak", saved, text)
    print(text)


if __name__ == "__main__":
    main()
