"""The command users run, side by side: `spmd-cp generate --json` at N = 1, 2 (and 4).

    python benchmarks/bench_generate.py                          # N = 1 2, 2 rounds
    python benchmarks/bench_generate.py --ranks 1 2 4 --rounds 2 --tokens 64
    python benchmarks/bench_generate.py --baseline ../spmd-cp-BASE/.venv/bin/spmd-cp  # + N=2
    python benchmarks/bench_generate.py --baseline OTHER --baseline-ranks 1 2
    python benchmarks/bench_generate.py --compare-flags=--no-fast-exp --baseline-ranks 1 2
    python benchmarks/bench_generate.py --compare-env SPMD_CP_HUGE_PAGES=off --baseline-ranks 1 2

Every run is exactly

    OPENBLAS_NUM_THREADS=1 mpiexec -n N spmd-cp generate --prompt-file PROMPT \\
        --max-tokens 64 --json

with default flags (`--cp-algo auto`, `--decode-tp auto`, greedy), one BLAS thread per
rank. The prompt is the start of the GPL-3 text (/usr/share/common-licenses/GPL-3, cut
at a paragraph so that the chat-templated prompt has about --prompt-tokens tokens;
benchmarks/results/prompts/prompt_4096.txt where that file is missing). The rank counts
alternate (1 2 1 2 ...) so that drift hits all alike; the 1-minute load average is read
before each run and recorded with it. Before the measured runs, one short warm-up run per
rank count fills a fresh calibration cache ($SPMD_CP_CACHE in a temporary directory), so
every measured run reads the same calibration, as any run after a user's first does.

Reported per run: prefill tok/s, decode tok/s (the JSON's fields), the decode mode
`--decode-tp auto` chose and its reason; per rank count the medians, decode speed-up
over N = 1 and prefill efficiency (prefill tok/s at N over N x that at 1). With
--baseline, every round also runs another installation's spmd-cp (launched by the
mpiexec next to it; at N = 2, or the --baseline-ranks), e.g. the code before a change;
with --compare-env NAME=VALUE, this code again with that variable set; with
--compare-flags "FLAGS", this code again with those generate flags. Results:
benchmarks/results/generate.json and .md.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

GPL = Path("/usr/share/common-licenses/GPL-3")
FALLBACK = bl.RESULTS / "prompts" / "prompt_4096.txt"
# A warm-up (two tokens after "Hello") converts the weights and calibrates at most: one
# that takes longer than this is hung (a launcher that never started its ranks).
WARM_UP_LIMIT_S = 600


def make_prompt(target_tokens: int, directory: Path) -> tuple[Path, str, int]:
    """A prompt file of whole paragraphs whose chat-templated form has <= target tokens."""
    from spmd_cp.models.loader import default_model_path, load_model

    tokenizer = load_model(default_model_path()).tokenizer
    source = GPL if GPL.is_file() else FALLBACK
    paragraphs = source.read_text().split("\n\n")

    def templated_tokens(text: str) -> int:
        messages = [{"role": "user", "content": text.strip()}]
        return len(tokenizer.encode(tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)))

    text, tokens = "", 0
    for paragraph in paragraphs:
        candidate = text + paragraph + "\n\n"
        count = templated_tokens(candidate)
        if count > target_tokens:
            break
        text, tokens = candidate, count
    path = directory / "prompt.txt"
    path.write_text(text)
    return path, str(source), tokens


def decode_choice(stderr: str) -> str:
    """The layout the run decoded with and why: the decode plan's log line (this code),
    or the older "decode: tensor-parallel|replicated (why)" line (a baseline before it)."""
    found = re.search(r"decode plan: (split|replicated) layout \((.*?)\); \w+ step", stderr or "")
    if found is None:
        found = re.search(r"decode: (tensor-parallel|replicated) \((.*)\)", stderr or "")
    return f"{found.group(1)} ({found.group(2)})" if found else "-"


def launcher(spmd_cp: str, ranks: int) -> list:
    """``mpiexec -n N spmd-cp``, with the mpiexec of that installation."""
    return [str(Path(spmd_cp).with_name("mpiexec")), "-n", str(ranks), spmd_cp]


def generate(ranks: int, prompt: Path, tokens: int, env: dict, spmd_cp: str = bl.SPMD_CP,
             variant: str = "this", flags: tuple = ()) -> dict:
    cmd = launcher(spmd_cp, ranks) + ["generate", "--prompt-file", str(prompt),
                                      "--max-tokens", str(tokens), "--json", *flags]
    load = bl.loadavg()[0]
    # From the prompt's folder, not the repository: a baseline started as `python -m
    # spmd_cp` with PYTHONPATH set would import the repository's package from the
    # working directory, which comes first on sys.path.
    result = bl.run_json(cmd, env=env, keep_stderr=True, cwd=prompt.parent)
    result.update(_load_before=load, _variant=variant)
    result["_decode_choice"] = decode_choice(result.pop("_stderr", ""))
    bl.log(f"{variant} N={ranks}: prefill {result['prefill_tok_s']:.1f} tok/s, decode "
           f"{result['decode_tok_s']:.2f} tok/s, load before {load:.2f}; "
           f"{result['_decode_choice']}")
    return result


def summarize(runs: list[dict], configs: list[tuple]) -> list[list]:
    """Per (code, N): medians, and the ratios to that code's own N = 1 (this code's where
    the baseline did not run at N = 1)."""
    def one_rank(variant: str) -> dict:
        ones = [r for r in runs if r["ranks"] == 1 and r["_variant"] == variant]
        return {key: bl.median([r[key] for r in ones])
                for key in ("prefill_tok_s", "decode_tok_s")} if ones else one_rank("this")

    rows = []
    for variant, n in configs:
        base = one_rank(variant)
        mine = [r for r in runs if r["ranks"] == n and r["_variant"] == variant]
        prefill = bl.median([r["prefill_tok_s"] for r in mine])
        decode = bl.median([r["decode_tok_s"] for r in mine])
        rows.append([variant, n, len(mine), bl.fmt(prefill, 1), bl.fmt(decode, 2),
                     f"{decode / base['decode_tok_s']:.2f}x",
                     bl.fmt(prefill / (n * base["prefill_tok_s"]), 2),
                     " / ".join(f"{r['_load_before']:.2f}" for r in mine)])
    return rows


def command_env(setting: str, path) -> str:
    """--compare-env's NAME=VALUE with each entry of a *PATH variable passed through
    ``path`` (made whole to run, relative to the repository root to record)."""
    name, _, value = setting.partition("=")
    if not name.endswith("PATH") or not value:
        return setting
    return f"{name}=" + os.pathsep.join(path(entry) for entry in value.split(os.pathsep))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="--max-tokens")
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--name", default="generate", help="results file name")
    parser.add_argument("--baseline", help="another installation's spmd-cp, run beside")
    parser.add_argument("--baseline-ranks", type=int, nargs="+", default=[2],
                        help="the rank counts the baseline (or --compare-env) runs at")
    parser.add_argument("--compare-env", metavar="NAME=VALUE",
                        help="also run this code with one environment variable set, e.g. "
                             "SPMD_CP_HUGE_PAGES=off (instead of --baseline)")
    parser.add_argument("--compare-flags", metavar="FLAGS",
                        help="also run this code with these generate flags, e.g. "
                             "--no-fast-exp (instead of --baseline)")
    args = parser.parse_args()
    command = bl.command_line("bench_generate.py", sys.argv[1:])
    recorded = {**vars(args), "baseline": args.baseline and bl.from_root(args.baseline),
                "compare_env": args.compare_env and command_env(args.compare_env, bl.from_root)}
    # The runs start in the prompt's folder: paths given relative to here are made whole.
    if args.baseline:
        args.baseline = os.path.abspath(args.baseline)
    if args.compare_env:
        args.compare_env = command_env(args.compare_env, os.path.abspath)
    if 1 not in args.ranks:
        parser.error("--ranks must include 1 (the reference)")
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
        prompt, source, prompt_tokens = make_prompt(args.prompt_tokens, Path(tmp))
        env = bl.bench_env(1, SPMD_CP_CACHE=os.path.join(tmp, "cache"))
        started = time.strftime("%Y-%m-%d %H:%M")
        other = None
        if args.compare_env:
            name, _, value = args.compare_env.partition("=")
            other = (recorded["compare_env"], bl.SPMD_CP, {**env, name: value}, ())
        elif args.compare_flags:
            other = (args.compare_flags, bl.SPMD_CP, env, tuple(shlex.split(args.compare_flags)))
        elif args.baseline:
            other = ("baseline", args.baseline, env, ())
        configs = []
        for n in args.ranks:
            configs.append(("this", n, bl.SPMD_CP, env, ()))
            if other and n in args.baseline_ranks:
                configs.append((other[0], n, *other[1:]))
        for _, n, spmd_cp, run_env, flags in configs:  # fills the calibration (and weight) cache
            bl.run_json(launcher(spmd_cp, n) + ["generate", "--prompt", "Hello",
                                                "--max-tokens", "2", "--json", *flags],
                        env=run_env, quiet_wait=0, cwd=tmp, timeout=WARM_UP_LIMIT_S)
        runs = [generate(n, prompt, args.tokens, run_env, spmd_cp, variant, flags)
                for _ in range(args.rounds) for variant, n, spmd_cp, run_env, flags in configs]
    run_rows = [[i // len(configs) + 1, r["_variant"], r["ranks"], f"{r['_load_before']:.2f}",
                 bl.fmt(r["ttft_s"], 1), bl.fmt(r["prefill_tok_s"], 1),
                 bl.fmt(r["decode_tok_s"], 2), r["tokens"], r["algo"], r["_decode_choice"],
                 bl.fmt(r["_others"], 2)] for i, r in enumerate(runs)]
    markdown = "\n\n".join([
        bl.header("spmd-cp generate --json, N ranks side by side", command),
        f"started {started}; prompt: {prompt_tokens} tokens (chat template included) "
        f"from {source}; {args.tokens} greedy tokens; OPENBLAS_NUM_THREADS=1; default flags"
        + (f"; baseline: {recorded['baseline']}" if other and other[0] == "baseline"
           else "")
        + (f"; also with {other[0]}" if other and other[0] != "baseline" else ""),
        bl.table(["code", "ranks", "runs", "prefill tok/s", "decode tok/s", "decode vs N=1",
                  "prefill efficiency", "load avg before each run"],
                 summarize(runs, [(v, n) for v, n, *_ in configs])),
        bl.table(["round", "code", "ranks", "load avg before", "TTFT s", "prefill tok/s",
                  "decode tok/s", "tokens", "prefill algo", "--decode-tp auto chose",
                  "others' cores"], run_rows)])
    print(markdown)
    bl.save(args.name, {"args": recorded, "command": command, "machine": bl.machine(),
                        "started": started, "prompt_source": source,
                        "prompt_tokens": prompt_tokens, "runs": runs}, markdown)


if __name__ == "__main__":
    main()
