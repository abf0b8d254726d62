"""Jobs decoded together (batch --max-batch B) against one after another (B = 1).

    python benchmarks/bench_batched_decode.py [--ranks 2] [--batches 1 2 4 8 16] \\
        [--mlx-batches 8] [--jobs 16] [--tokens 48] [--document-chars 12000]

Every run is

    OPENBLAS_NUM_THREADS=1 mpiexec -n N spmd-cp batch --jobs JOBS --output OUT \\
        --max-batch B --json

on the embedded SmolLM2 (its default flags otherwise: the native step, one sequence's
at B = 1 and its batched form above, over a float16 cache; ``--mlx-batches`` also with
``--decode-step graph``, MLX's batched step, over float32), with ``--jobs``
questions about one document (the start of the GPL-3 text, ``--document-chars``
characters: about 3K tokens), each ``--tokens`` greedy tokens with ``ignore_eos``, so
every run decodes the same number of tokens. Reported per B: the summary's aggregate
decode tok/s (tokens over the decode steps' time), the mean step time, the batch sizes
the steps ran, the ratio to B = 1, and how many jobs' tokens equal B = 1's. Results:
benchmarks/results/batched_decode.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import benchlib as bl  # noqa: E402

GPL = Path("/usr/share/common-licenses/GPL-3")
FALLBACK = bl.RESULTS / "prompts" / "prompt_4096.txt"
QUESTIONS = ["What is this text about?", "Who may copy it?", "What does it say about "
             "warranties?", "What is a covered work?", "What must a distributor give?",
             "What happens on termination?", "What does it say about patents?",
             "Which version applies?"]


def write_jobs(directory: Path, jobs: int, tokens: int, chars: int) -> Path:
    source = GPL if GPL.is_file() else FALLBACK
    (directory / "document.txt").write_text(source.read_text()[:chars])
    path = directory / "jobs.jsonl"
    path.write_text("".join(json.dumps({
        "id": f"q{i}", "prefix_file": "document.txt",
        "prompt": f"{QUESTIONS[i % len(QUESTIONS)]} (question {i + 1})",
        "max_tokens": tokens, "ignore_eos": True}) + "\n" for i in range(jobs)))
    return path


def run(ranks: int, batch: int, jobs: Path, step: str = "auto") -> dict:
    out = jobs.with_name(f"out-{ranks}-{batch}-{step}.jsonl")
    command = bl.mpi_cmd(ranks, sys.executable, "-m", "spmd_cp", "batch", "--jobs", jobs,
                         "--output", out, "--overwrite", "--max-batch", batch, "--json",
                         "--progress", "off", "--decode-step", step)
    summary = bl.run_json(command, env=bl.bench_env(1), cwd=jobs.parent, timeout=1800)
    steps = sum(summary["batch_sizes"].values())
    decode_s = summary["tokens"] / max(summary["decode_tok_s"], 1e-9)  # approximately
    answers = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    return {"ranks": ranks, "max_batch": batch, "decode_tok_s": summary["decode_tok_s"],
            "step_ms": 1000 * decode_s / max(steps, 1), "batch_sizes": summary["batch_sizes"],
            "prompt_tokens": summary["prompt_tokens"], "tokens": summary["tokens"],
            # --kv-dtype auto: float16 where the native step runs (batched or not)
            "kv_dtype": "float16" if summary["decode_step"] == "native" else "float32",
            "batched_step": summary["batched_step"],
            "elapsed_s": summary["elapsed_s"], "load": summary["_load"],
            "peak_mem_bytes": summary["peak_mem_bytes"], "answers": answers}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--document-chars", type=int, default=12000)
    parser.add_argument("--mlx-batches", type=int, nargs="*", default=[8],
                        help="batch sizes also run with --decode-step graph (MLX's "
                             "batched step), against the same B = 1")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        jobs = write_jobs(Path(scratch), args.jobs, args.tokens, args.document_chars)
        for ranks in args.ranks:
            run(ranks, 1, jobs)  # warm-up: kernels built, calibration written
            plan = [(b, "auto") for b in args.batches] + [(b, "graph") for b in args.mlx_batches]
            for batch, step in plan:
                runs.append(run(ranks, batch, jobs, step))
                r = runs[-1]
                print(f"N={ranks} B={batch} {r['batched_step']}: {r['decode_tok_s']:.1f} "
                      f"tok/s, step {r['step_ms']:.1f} ms", flush=True)
    rows = []
    for r in runs:
        base = next(b for b in runs if b["ranks"] == r["ranks"] and b["max_batch"] == 1)
        same = sum(r["answers"][k] == base["answers"][k] for k in base["answers"])
        rows.append([r["ranks"], r["max_batch"], r["batched_step"] or "-",
                     f"{r['decode_tok_s']:.1f}",
                     f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x",
                     f"{r['step_ms']:.1f}", json.dumps(r["batch_sizes"]),
                     f"{same} of {len(base['answers'])}"])
    command = bl.command_line("bench_batched_decode.py", sys.argv[1:])
    text = (bl.header("Batched decode: batch --max-batch B", command)
            + f"\n{args.jobs} jobs after one document of {runs[0]['prompt_tokens'] // args.jobs}"
            f"-odd tokens each ({runs[0]['prompt_tokens']} prompt tokens in all), "
            f"{args.tokens} greedy tokens each (ignore_eos)\n\n"
            + bl.table(["N", "max batch", "batched step", "decode tok/s", "vs B=1", "step ms",
                        "steps at each batch size", "tokens equal to B=1's"], rows))
    print(text)
    for r in runs:
        del r["answers"]
    bl.save("batched_decode", {"command": command, "machine": bl.machine(), "runs": runs},
            text)


if __name__ == "__main__":
    main()
