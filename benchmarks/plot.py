"""docs/benchmarks.png from benchmarks/results/{vs_mlx_lm,generate}.json (matplotlib).

    python benchmarks/plot.py [--output docs/benchmarks.png]

Left: time to first token (prefill) against prompt length, mlx-lm and spmd-cp N = 1, 2
(bench_vs_mlx_lm.py). Middle: decode tokens/s of the same runs. Right: prefill and decode
tokens/s of `spmd-cp generate --json` at N = 1 and 2, one BLAS thread per rank
(bench_generate.py; only the rows of this code, not a baseline's). The title names the CPU
each file records.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402


def cpu(data: dict) -> str:
    machine = data.get("machine") or {}
    return f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default=str(bl.ROOT / "docs" / "benchmarks.png"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    titles = []
    vs = bl.RESULTS / "vs_mlx_lm.json"
    if vs.exists():
        data = json.loads(vs.read_text())
        series = defaultdict(dict)
        for key, runs in data["runs"].items():
            config = key.split("|")[1]
            tokens = runs[0]["prompt_tokens"]
            series[config][tokens] = (statistics.median(r["ttft_s"] for r in runs),
                                      statistics.median(r["decode_tok_s"] for r in runs))
        for config, points in series.items():
            xs = sorted(points)
            style = "k--o" if config == "mlx-lm" else "-o"
            axes[0].plot(xs, [points[x][0] for x in xs], style, label=config)
            axes[1].plot(xs, [points[x][1] for x in xs], style, label=config)
        titles.append(f"left, middle: vs_mlx_lm.json ({cpu(data)})")
    axes[0].set(title="Prefill: time to first token", xlabel="prompt tokens", ylabel="seconds")
    axes[1].set(title="Decode (BLAS threads = 2 / ranks)", xlabel="prompt tokens",
                ylabel="tokens/s")
    gen = bl.RESULTS / "generate.json"
    if gen.exists():
        data = json.loads(gen.read_text())
        speeds = defaultdict(lambda: defaultdict(list))
        for r in data["runs"]:
            if r.get("_variant", "this") == "this":
                speeds[r["ranks"]]["prefill"].append(r["prefill_tok_s"])
                speeds[r["ranks"]]["decode"].append(r["decode_tok_s"])
        ranks = sorted(speeds)
        width = 0.8 / max(1, len(ranks))
        for i, n in enumerate(ranks):
            prefill = statistics.median(speeds[n]["prefill"])
            decode = statistics.median(speeds[n]["decode"])
            bars = axes[2].bar([j + i * width for j in range(2)], [prefill / 10, decode], width,
                               label=f"N={n}")
            axes[2].bar_label(bars, labels=[f"{prefill:.0f} tok/s", f"{decode:.1f} tok/s"],
                              fontsize=8)
        axes[2].set_xticks([j + width * (len(ranks) - 1) / 2 for j in range(2)],
                           ["prefill (tok/s / 10)", "decode (tok/s)"])
        tokens = data["runs"][0]["prompt_tokens"] if data["runs"] else "?"
        axes[2].set(title=f"spmd-cp generate, {tokens}-token prompt, 1 BLAS thread/rank")
        titles.append(f"right: generate.json ({cpu(data)})")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("spmd-cp, SmolLM2-135M float32; " + "; ".join(titles))
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(args.output)


if __name__ == "__main__":
    main()
