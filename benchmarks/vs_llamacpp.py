"""spmd-cp beside llama.cpp on the same GGUF, the same prompt, the same cores.

    python benchmarks/vs_llamacpp.py                        # 3K and 6.5K tokens, 2 rounds
    python benchmarks/vs_llamacpp.py --contexts 3000 --rounds 3 --tokens 64

llama.cpp runs through llama-cpp-python (``import llama_cpp``; it builds llama.cpp from
source, about half an hour on 2 cores, so it is no dependency of spmd-cp and this
benchmark is no test) on the embedded SmolLM2-135M-Instruct Q4_1 GGUF (or ``--model``'s),
in a child process of its own: the prompt evaluated in batches of 512 tokens (``n_batch``), then
greedy tokens one at a time, its threads (``n_threads``, ``n_threads_batch``) set to
match. spmd-cp runs the command users run on the same file:

    OPENBLAS_NUM_THREADS=T mpiexec -n N spmd-cp generate --model FILE --prompt-file PROMPT \\
        --no-chat-template --max-tokens 64 --ignore-eos --json

Both read the same text without a chat template (the two tokenizers of the one GGUF
agree on its token count, recorded). Variants per context, for a machine of C cores
(--cores, 2 by default): llama.cpp on 1 and on C threads, spmd-cp at N = 1 with 1 and C
threads, N = C/2 ranks of 2 threads (C >= 4) and N = C ranks of 1 thread; they alternate
within every round (A B C D E A B C ...) so drift hits all alike. Reported: medians of
prefill and decode tok/s, and the ratios to llama.cpp at equal cores (N ranks of T
threads against llama.cpp on N x T threads). Results: benchmarks/results/vs_llamacpp.json
and .md. On 16 cores, llama.cpp's 16 threads beside one rank of 16 and eight ranks of 2:

    python benchmarks/vs_llamacpp.py --cores 16 --contexts 8000 --variants 1 3 4
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

SOURCE_TEXT = bl.RESULTS / "prompts" / "prompt_8160.txt"
N_BATCH = 512  # llama.cpp's prompt batch (llama-cpp-python's default)


def variants_for(cores: int) -> list[tuple[str, str, int, int]]:
    """(name, system, ranks, threads per rank) of every variant on ``cores`` cores."""
    variants = [("llama.cpp 1 thread", "llama.cpp", 1, 1),
                (f"llama.cpp {cores} threads", "llama.cpp", 1, cores),
                ("spmd-cp N=1, 1 thread", "spmd-cp", 1, 1),
                (f"spmd-cp N=1, {cores} threads", "spmd-cp", 1, cores)]
    if cores >= 4:
        variants.append((f"spmd-cp N={cores // 2}, 2 threads each", "spmd-cp", cores // 2, 2))
    return variants + [(f"spmd-cp N={cores}, 1 thread each", "spmd-cp", cores, 1)]


def baseline_for(variants: list[tuple], cores: int) -> str | None:
    """The llama.cpp variant on ``cores`` threads, if there is one."""
    return next((name for name, system, _, threads in variants
                 if system == "llama.cpp" and threads == cores), None)


MODEL = []  # --model's file, where one is given (else the embedded model)


def gguf_path() -> str:
    from spmd_cp.models.gguf import default_model_path

    return MODEL[0] if MODEL else default_model_path()


def make_prompt(tokens: int, directory: Path) -> tuple[Path, int]:
    """A prompt file of the source text's first whole words, at most ``tokens`` tokens
    by spmd-cp's tokenizer of the GGUF (the longest such prefix, by bisection); (its
    path, its token count)."""
    from spmd_cp.models.loader import load_model

    tokenizer = load_model(gguf_path()).tokenizer
    source = SOURCE_TEXT.read_text()
    ends = [m.start() for m in re.finditer(r"\s+", source)] + [len(source)]
    low, high = 0, len(ends)  # ends[:low] fit; ends[high:] do not
    while high - low > 1:
        middle = (low + high) // 2
        if len(tokenizer.encode(source[:ends[middle]])) <= tokens:
            low = middle
        else:
            high = middle
    text = source[:ends[low]]
    path = directory / f"prompt_{tokens}.txt"
    path.write_text(text)
    return path, len(tokenizer.encode(text))


def run_variant(variant: tuple, prompt: Path, tokens: int, kv_dtype: str | None) -> dict:
    name, system, ranks, threads = variant
    if system == "llama.cpp":
        cmd = [sys.executable, __file__, "--llama-worker", str(prompt), "--threads",
               str(threads), "--tokens", str(tokens), "--model", gguf_path()]
        result = bl.run_json(cmd, env=bl.bench_env(threads))
    else:
        cmd = bl.mpi_cmd(ranks, bl.SPMD_CP, "generate", "--model", gguf_path(),
                         "--prompt-file", prompt, "--no-chat-template", "--max-tokens", tokens,
                         "--ignore-eos", "--json")
        if kv_dtype:
            cmd += ["--kv-dtype", kv_dtype]
        result = bl.run_json(cmd, env=bl.bench_env(threads), cwd=prompt.parent)
    result["_variant"] = name
    bl.log(f"{name}: {result['prompt_tokens']} tokens, prefill {result['prefill_tok_s']:.1f} "
           f"tok/s, decode {result['decode_tok_s']:.2f} tok/s, others "
           f"{result['_others']:.2f} cores")
    return result


def summary(runs: list[dict], variants: list[tuple]) -> list[list]:
    medians = {}
    for name, *_ in variants:
        mine = [r for r in runs if r["_variant"] == name]
        medians[name] = {k: bl.median([r[k] for r in mine])
                         for k in ("prompt_tokens", "prefill_tok_s", "decode_tok_s")}
        medians[name]["runs"] = len(mine)
    rows = []
    for name, system, ranks, threads in variants:
        m, baseline = medians[name], baseline_for(variants, ranks * threads)
        base = medians[baseline] if baseline else {"runs": 0}
        if not m["runs"]:
            continue
        ratios = ["-", "-"] if system == "llama.cpp" or not base["runs"] else [
            f"{m[k] / base[k]:.2f}x" for k in ("prefill_tok_s", "decode_tok_s")]
        rows.append([name, ranks * threads, m["runs"], int(m["prompt_tokens"]),
                     bl.fmt(m["prefill_tok_s"], 1), bl.fmt(m["decode_tok_s"], 2), *ratios])
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[3000, 6500])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", default="vs_llamacpp", help="results file name")
    parser.add_argument("--tokens", type=int, default=64,
                        help="greedy tokens, decoded by both past any end token")
    parser.add_argument("--model", help="a GGUF file (default: the embedded SmolLM2 Q4_1)")
    parser.add_argument("--kv-dtype", default=None, help="spmd-cp's --kv-dtype (default: its own)")
    parser.add_argument("--cores", type=int, default=2,
                        help="the machine's cores the variants are made for (at least 2)")
    parser.add_argument("--variants", type=int, nargs="+",
                        help="which of the variants to run, by their 0-based place in the "
                             "table (e.g. 0 2 4 with 2 cores: the one-thread ones; default all)")
    parser.add_argument("--llama-worker", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    MODEL[:] = [str(Path(args.model).resolve())] if args.model else []
    if args.llama_worker:
        print(json.dumps(bl.llama_cpp_greedy(gguf_path(), args.llama_worker, args.threads,
                                             args.tokens, N_BATCH)))
        return
    if args.cores < 2:
        parser.error("--cores: at least 2")
    variants = variants_for(args.cores)
    chosen = args.variants if args.variants is not None else list(range(len(variants)))
    if not all(0 <= i < len(variants) for i in chosen):
        parser.error(f"--variants: 0 to {len(variants) - 1} with {args.cores} cores")
    command = "python benchmarks/vs_llamacpp.py " + " ".join(sys.argv[1:])
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    tables = []  # one per finished context

    def report(*more) -> str:  # the header's time and load: when it is written
        return "\n\n".join([bl.header("spmd-cp beside llama.cpp (same GGUF, prompt and "
                                       "cores)", command), f"started {started}",
                             *tables, *more])

    payload = {"machine": bl.machine(), "command": command, "started": started,
               "contexts": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for context in args.contexts:
            prompt, count = make_prompt(context, Path(scratch))
            runs = []
            for _ in range(args.rounds):
                for i in chosen:
                    runs.append(run_variant(variants[i], prompt, args.tokens, args.kv_dtype))
                    rows = summary(runs, variants)
                    payload["contexts"][str(context)] = {"prompt_tokens": count, "runs": runs,
                                                         "summary": rows}
                    table = f"### {count}-token prompt, {args.tokens} greedy tokens\n\n" + \
                        bl.table(["system", "cores", "runs", "prompt tokens", "prefill tok/s",
                                  "decode tok/s", "prefill vs llama.cpp",
                                  "decode vs llama.cpp"], rows)
                    bl.save(args.name, payload, report(table))  # after each run
            tables.append(table)
    print(report())


if __name__ == "__main__":
    main()
