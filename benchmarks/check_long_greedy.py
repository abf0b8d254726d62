"""Greedy identity at long context, too slow for the test suite: run by hand, recorded in docs.

    python benchmarks/check_long_greedy.py --length 3000 --tokens 128 --ranks 1 2 3 4

Runs tests/mpi_exact_driver.py (real prompts, real prefill) for every rank count and
prefill algorithm and checks that the greedy continuation equals the one-rank run.
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "mpi_exact_driver.py"
ALGOS = ("auto", "pass-kv", "pass-q", "allgather-kv")


def run(ranks: int, configs: list[dict], model: str) -> list[dict]:
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep
                           + os.environ["PATH"])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
        subprocess.run([mpiexec, "-n", str(ranks), sys.executable, str(DRIVER), model,
                        json.dumps(configs), str(out)], check=True, env=env, timeout=7200)
        return json.loads(out.read_text())["results"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=3000)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from spmd_cp.loader import default_model_path

    model = args.model or default_model_path()
    base = {"chunk": 0, "length": args.length, "decode": args.tokens, "seed": 11,
            "score": False}
    start = time.perf_counter()
    reference = run(1, [{**base, "algo": "auto"}], model)[0]["greedy"]
    print(f"| ranks | algorithm | {args.tokens} greedy tokens identical to 1 rank |")
    print("|---|---|---|")
    for ranks in args.ranks:
        if ranks == 1:
            continue
        for result in run(ranks, [{**base, "algo": a} for a in ALGOS], model):
            same = result["greedy"] == reference
            first = next((i for i, (a, b) in enumerate(zip(result["greedy"], reference))
                          if a != b), None)
            print(f"| {ranks} | {result['config']['algo']} | "
                  f"{'yes' if same else f'no (first difference at token {first})'} |")
    print(f"\n{args.length}-token prompt, {time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
