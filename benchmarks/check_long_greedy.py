"""Greedy identity after long prompts, too slow for the test suite (about 20 minutes).

    python benchmarks/check_long_greedy.py --lengths 500 3000 --tokens 128 --ranks 1 2 3 4

For each prompt length (random token ids), runs tests/mpi_exact_driver.py (real prefill
through the engine, then greedy decode steps) on one rank and on every other rank count
with every prefill algorithm, and checks that the greedy continuation equals the
one-rank run; the one-rank run is itself checked against mlx-lm's own generate_step.
Writes benchmarks/results/long_greedy.{md,json}; exits 1 if any continuation differs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib

ROOT = benchlib.ROOT
DRIVER = ROOT / "tests" / "mpi_exact_driver.py"
ALGOS = ("auto", "pass-kv", "pass-q", "allgather-kv")


def run(ranks: int, configs: list[dict], model: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = benchlib.mpi_cmd(ranks, benchlib.PYTHON, DRIVER, model, json.dumps(configs), out)
        subprocess.run(cmd, check=True, env=benchlib.bench_env(1), timeout=7200)
        return json.loads(out.read_text())["results"]


def mlx_lm_greedy(model_path: str, ids: list[int], tokens: int) -> list[int]:
    """The independent reference: mlx-lm's own generate_step on the same weights."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from spmd_cp.models.loader import load_model

    model = load_model(model_path).model
    steps = generate_step(mx.array(ids), model, max_tokens=tokens,
                          sampler=lambda x: mx.argmax(x, axis=-1))
    return [int(t) for t, _ in steps]


def first_difference(a: list[int], b: list[int]):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[500, 3000])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from spmd_cp.blas import ensure_fast_blas
    from spmd_cp.models.loader import default_model_path

    ensure_fast_blas()
    model = args.model or default_model_path()
    command = "python benchmarks/check_long_greedy.py " + " ".join(sys.argv[1:])
    lines = []

    def add(line: str):
        lines.append(line)
        print(line, flush=True)

    add(benchlib.header("Greedy decode after long prompts: every rank count and "
                        "prefill algorithm against one rank", command))
    add(f"| prompt tokens | ranks | algorithm | {args.tokens} greedy tokens identical to 1 rank "
        "| cached tokens per rank after decode |")
    add("|---|---|---|---|---|")
    rows = []
    start = time.perf_counter()
    for length in args.lengths:
        base = {"chunk": 0, "length": length, "decode": args.tokens, "seed": 11,
                "score": False}
        single = run(1, [{**base, "algo": "auto"}], model)[0]
        reference = single["greedy"]
        lm = mlx_lm_greedy(model, single["ids"], args.tokens)
        first = first_difference(lm, reference)
        rows.append({"length": length, "ranks": 1, "algo": "mlx-lm", "same": lm == reference,
                     "first_difference": first})
        add(f"| {length} | 1 | mlx-lm's generate_step (one process) | "
            f"{'yes' if lm == reference else f'no (first difference at token {first})'} | - |")
        for ranks in args.ranks:
            if ranks == 1:
                continue
            for result in run(ranks, [{**base, "algo": a} for a in ALGOS], model):
                same = result["greedy"] == reference
                first = first_difference(result["greedy"], reference)
                algo = result["config"]["algo"]
                if algo == "auto":
                    algo += f" ({', '.join(result['algos'])})"
                rows.append({"length": length, "ranks": ranks, "algo": algo, "same": same,
                             "first_difference": first, "shard_sizes": result["shard_sizes"]})
                add(f"| {length} | {ranks} | {algo} | "
                    f"{'yes' if same else f'no (first difference at token {first})'} | "
                    f"{' / '.join(map(str, result['shard_sizes']))} |")
    add(f"\n{time.perf_counter() - start:.0f} s in all")
    report = "\n".join(lines)
    benchlib.save("long_greedy", {"machine": benchlib.machine(), "tokens": args.tokens,
                                  "rows": rows}, report)
    if not all(row["same"] for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
