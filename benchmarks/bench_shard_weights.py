#!/usr/bin/env python3
"""Prefill time with and without --shard-weights, interleaved launches at one N.

    python benchmarks/bench_shard_weights.py --ranks 2 --tokens 2048 --rounds 3
    python benchmarks/bench_shard_weights.py --ranks 2 --tokens 6100 --rate 16gbit 4gbit

The model is the embedded SmolLM2-135M written once as a float32 MLX directory (so
neither run dequantizes: the sharded run would otherwise dequantize every layer per
pass, docs/SHARDED_WEIGHTS.md). Each round launches ``spmd-cp generate --max-tokens 1``
with --shard-weights off, then on, and records ttft_s, model_bytes and /proc/loadavg
(the machine may be shared). Prints one JSON object.

``--rate R ...`` runs the launches on the simulated TCP cluster instead (needs root:
``launch/netns-cluster up N --rate R`` per rate, one rank per simulated host, through
``launch/spmd-cp-run --netns-cluster``; ``down`` at the end), so every layer broadcast
crosses a shaped link.
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

BIN = Path(sys.executable).parent


def float32_model(directory: Path) -> Path:
    """The embedded model as a float32 MLX directory (written once)."""
    if (directory / "model.safetensors").is_file():
        return directory
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from spmd_cp.models.loader import default_model_path, load_model

    loaded = load_model(default_model_path())
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"),
                        dict(tree_flatten(loaded.model.parameters())))
    (directory / "config.json").write_text(json.dumps(loaded.config))
    loaded.tokenizer._tokenizer.save_pretrained(str(directory))
    return directory


ROOT = Path(__file__).resolve().parent.parent


def launch(ranks: int, model: Path, prompt: Path, mode: str, cluster: bool = False) -> dict:
    args = ["generate", "--model", str(model), "--prompt-file", str(prompt),
            "--no-chat-template", "--max-tokens", "1", "--json", "--shard-weights", mode]
    if cluster:
        cmd = [sys.executable, str(ROOT / "launch" / "spmd-cp-run"), "--netns-cluster", "-n",
               str(ranks), "--threads", "1", "--program", str(BIN / "spmd-cp"), "--", *args]
    else:
        cmd = [str(BIN / "mpiexec"), "-n", str(ranks), str(BIN / "spmd-cp"), *args]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    load = Path("/proc/loadavg").read_text().split()[0]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200,
                         check=True).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    return {"ttft_s": summary["ttft_s"], "model_bytes": summary["model_bytes"],
            "prompt_tokens": summary["prompt_tokens"], "loadavg_before": float(load)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="about this many tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-dir", default="/tmp/spmd-cp-bench-f32")
    parser.add_argument("--rate", nargs="+", default=None,
                        help="link rates of the simulated cluster (e.g. 16gbit 4gbit)")
    args = parser.parse_args()
    if args.rate:
        return over_cluster(args)
    model = float32_model(Path(args.model_dir))
    prompt = Path(args.model_dir) / f"prompt-{args.tokens}.txt"
    # ~1 token per word of this text with SmolLM2's tokenizer.
    prompt.write_text(" ".join(f"word{i % 97} and" for i in range(args.tokens // 3)))
    runs = {"off": [], "on": []}
    for _ in range(args.rounds):
        for mode in runs:
            runs[mode].append(launch(args.ranks, model, prompt, mode))
    medians = {m: statistics.median(r["ttft_s"] for r in rs) for m, rs in runs.items()}
    print(json.dumps({"ranks": args.ranks, "runs": runs, "median_ttft_s": medians,
                      "sharded_over_replicated": medians["on"] / medians["off"],
                      "cpu_count": os.cpu_count(), "mpiexec": shutil.which("mpiexec")}))


def over_cluster(args):
    """The same interleaved launches on the simulated cluster, one rate after another."""
    model = float32_model(Path(args.model_dir))
    prompt = Path(args.model_dir) / f"prompt-{args.tokens}.txt"
    prompt.write_text(" ".join(f"word{i % 97} and" for i in range(args.tokens // 3)))
    cluster = str(ROOT / "launch" / "netns-cluster")
    results = {}
    try:
        for rate in args.rate:
            subprocess.run([cluster, "up", str(args.ranks), "--rate", rate], check=True,
                           capture_output=True, text=True)
            runs = {"off": [], "on": []}
            for _ in range(args.rounds):
                for mode in runs:
                    runs[mode].append(launch(args.ranks, model, prompt, mode, cluster=True))
            medians = {m: statistics.median(r["ttft_s"] for r in rs) for m, rs in runs.items()}
            results[rate] = {"runs": runs, "median_ttft_s": medians,
                             "sharded_over_replicated": medians["on"] / medians["off"]}
            subprocess.run([cluster, "down"], capture_output=True)
    finally:
        subprocess.run([cluster, "down"], capture_output=True)
    print(json.dumps({"ranks": args.ranks, "rates": results, "cpu_count": os.cpu_count()}))


if __name__ == "__main__":
    main()
