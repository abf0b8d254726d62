"""Decode reading a GGUF file's packed blocks against reading their float32 copies.

    python benchmarks/bench_packed_decode.py --model FILE.gguf [--ranks 1 2] [--rounds 3]
    python benchmarks/bench_packed_decode.py --model FILE.gguf --baseline-pythonpath DIR

Every run is

    OPENBLAS_NUM_THREADS=1 mpiexec -n N spmd-cp generate --model FILE --prompt-file P \\
        --no-chat-template --max-tokens 64 --json [--no-quantized-decode]

(greedy, default flags otherwise), the prompt the start of the GPL-3 text cut at a
line to about --prompt-tokens tokens. With --baseline-pythonpath, a third mode: the
packed decode of another copy of the spmd_cp package (PYTHONPATH=DIR, e.g. the code
before a change). Rounds interleave the rank counts and the modes (their order
alternating), so drift and other work on the machine hit all alike; the
1-minute load average is read before each run and recorded with it. Reported: per rank
count and mode, the medians of decode and prefill tok/s, each rank's model_bytes and
resident peak, and whether both modes generated the same tokens. Results:
benchmarks/results/packed_decode_<model>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import benchlib as bl  # noqa: E402
RESULTS = REPO / "benchmarks" / "results"
GPL = Path("/usr/share/common-licenses/GPL-3")
FALLBACK = RESULTS / "prompts" / "prompt_4096.txt"
RUN_LIMIT_S = 900  # a run that takes longer is hung


def command_line(argv: list[str]) -> str:
    """The command as a result file records it: paths relative to the repository (the
    embedded model's inside the venv), the baseline's copy of the package as BASE."""
    argv = list(argv)
    for i, arg in enumerate(argv[:-1]):
        if arg == "--baseline-pythonpath":
            argv[i + 1] = "BASE"
    return bl.portable_text(bl.command_line("bench_packed_decode.py", argv))


def make_prompt(model: str, target_tokens: int, directory: Path) -> tuple[Path, int]:
    """A prompt file of whole lines of at most ``target_tokens`` tokens of the model's
    tokenizer (no chat template), and its token count."""
    from spmd_cp.models.gguf import header_config
    from spmd_cp.models.tensor_files import GGUFFile

    tokenizer = header_config(GGUFFile(model))[1]
    source = GPL if GPL.is_file() else FALLBACK
    text, count = "", 0
    for line in source.read_text().split("\n"):
        longer = (text + "\n" + line) if text else line
        tokens = len(tokenizer.encode(longer))
        if tokens > target_tokens:
            break
        text, count = longer, tokens
    path = directory / "prompt.txt"
    path.write_text(text)
    return path, count


MODES = {"packed": [], "float32": ["--no-quantized-decode"], "baseline packed": []}


def run(model: str, ranks: int, prompt: Path, tokens: int, mode: str, cache: str,
        baseline: str | None = None) -> dict:
    command = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "spmd_cp", "generate",
               "--model", model, "--prompt-file", str(prompt), "--no-chat-template",
               "--max-tokens", str(tokens), "--json", *MODES[mode]]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "SPMD_CP_CACHE": cache}
    if mode == "baseline packed":
        env["PYTHONPATH"] = baseline
    load = os.getloadavg()[0]
    done = subprocess.run(command, capture_output=True, text=True, env=env,
                          timeout=RUN_LIMIT_S, cwd=prompt.parent)  # not this checkout
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"ranks": ranks, "mode": mode, "load_1min": load,
            "decode_tok_s": result["decode_tok_s"], "prefill_tok_s": result["prefill_tok_s"],
            "prompt_tokens": result["prompt_tokens"], "model_bytes": result["model_bytes"],
            "resident_peak_bytes": result["resident_peak_bytes"],
            "token_ids": result["token_ids"]}


def summary(runs: list[dict], ranks: list[int], modes: list[str]) -> list[dict]:
    rows = []
    for n in ranks:
        for mode in modes:
            mine = [r for r in runs if r["ranks"] == n and r["mode"] == mode]
            rows.append({
                "ranks": n, "mode": mode,
                "decode_tok_s": statistics.median(r["decode_tok_s"] for r in mine),
                "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in mine),
                "model_bytes": mine[-1]["model_bytes"],
                "resident_peak_bytes": max(r["resident_peak_bytes"] for r in mine),
                "load_1min": [round(r["load_1min"], 2) for r in mine]})
    return rows


def markdown(rows: list[dict], same_tokens: bool, meta: dict) -> str:
    lines = [f"`{meta['command']}`, {meta['cpu']}, {meta['date']}, prompt "
             f"{meta['prompt_tokens']} tokens, {meta['rounds']} interleaved rounds "
             f"(medians); the same greedy tokens in every run: {same_tokens}", "",
             "| N | decode reads | decode tok/s | prefill tok/s | model_bytes per rank | "
             "resident peak per rank | load (1 min) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['ranks']} | {r['mode']} | "
            f"{r['decode_tok_s']:.1f} | {r['prefill_tok_s']:.0f} | "
            f"{', '.join(f'{b / 1e6:,.0f} MB' for b in r['model_bytes'])} | "
            f"{max(r['resident_peak_bytes']) / 1e9:.2f} GB | "
            f"{', '.join(map(str, r['load_1min']))} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--baseline-pythonpath", default=None)
    args = parser.parse_args()
    args.model = str(Path(args.model).resolve())
    modes = ["packed", "float32"] + (["baseline packed"] if args.baseline_pythonpath else [])
    with tempfile.TemporaryDirectory() as scratch:
        prompt, _ = make_prompt(args.model, args.prompt_tokens, Path(scratch))
        cache = os.environ.get("SPMD_CP_CACHE", str(Path(scratch) / "cache"))
        for n in args.ranks:  # warm-up: builds, calibrates and writes the float32 copy
            for mode in modes[::2]:
                run(args.model, n, prompt, 2, mode, cache, args.baseline_pythonpath)
        runs = []
        for round_ in range(args.rounds):
            for n in args.ranks:
                for mode in modes if round_ % 2 == 0 else modes[::-1]:
                    runs.append(run(args.model, n, prompt, args.tokens, mode, cache,
                                    args.baseline_pythonpath))
                    r = runs[-1]
                    print(f"N={n} {mode} decode "
                          f"{r['decode_tok_s']:.1f} tok/s prefill {r['prefill_tok_s']:.0f} "
                          f"tok/s load {r['load_1min']:.2f}", flush=True)
    same = all(r["token_ids"] == runs[0]["token_ids"] for r in runs)
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    meta = {"command": command_line(sys.argv[1:]),
            "cpu": f"{cpu}, {os.cpu_count()} cores",
            "date": subprocess.run(["date", "-u", "+%Y-%m-%d"], capture_output=True,
                                   text=True).stdout.strip(),
            "prompt_tokens": runs[0]["prompt_tokens"], "rounds": args.rounds}
    rows = summary(runs, args.ranks, modes)
    text = markdown(rows, same, meta)
    print(text)
    stem = RESULTS / f"packed_decode_{Path(args.model).stem}"
    for r in runs:
        del r["token_ids"]
    stem.with_suffix(".json").write_text(json.dumps(
        {**meta, "same_tokens": same, "summary": rows, "runs": runs}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
