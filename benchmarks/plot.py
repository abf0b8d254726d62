"""docs/benchmarks.png from benchmarks/results/{vs_mlx_lm,decode}.json (matplotlib).

    python benchmarks/plot.py [--output docs/benchmarks.png]

Left: time to first token (prefill) against prompt length, mlx-lm and spmd-cp N = 1, 2, 4
(real `spmd-cp generate` runs). Middle: decode tokens/s of the same runs. Right: decode
tokens/s against context from bench_decode.py (synthetic cache; --decode-tp off/on).
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default=str(bl.ROOT / "docs" / "benchmarks.png"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    vs = bl.RESULTS / "vs_mlx_lm.json"
    if vs.exists():
        data = json.loads(vs.read_text())["runs"]
        series = defaultdict(dict)
        for key, runs in data.items():
            size, config = key.split("|")
            tokens = runs[0]["prompt_tokens"]
            series[config][tokens] = (statistics.median(r["ttft_s"] for r in runs),
                                      statistics.median(r["decode_tok_s"] for r in runs))
        for config, points in series.items():
            xs = sorted(points)
            style = "k--o" if config == "mlx-lm" else "-o"
            axes[0].plot(xs, [points[x][0] for x in xs], style, label=config)
            axes[1].plot(xs, [points[x][1] for x in xs], style, label=config)
    axes[0].set(title="Prefill: time to first token", xlabel="prompt tokens", ylabel="seconds")
    axes[1].set(title="Decode, real generate (BLAS threads = 2 / ranks)", xlabel="prompt tokens",
                ylabel="tokens/s")
    dec = bl.RESULTS / "decode.json"
    if dec.exists():
        launches = json.loads(dec.read_text())["launches"]
        series = defaultdict(lambda: defaultdict(list))
        for n, runs in launches.items():
            for r in runs:
                for c in r["configs"]:
                    if c["merge"] != "allgather":
                        continue
                    label = f"N={n}" + (f", tp {c['tp']}" if int(n) > 1 else "")
                    series[label][c["context"]].append(c["step_s"])
        for label, points in sorted(series.items()):
            xs = sorted(points)
            axes[2].plot(xs, [1 / statistics.median(points[x]) for x in xs],
                         "--o" if "tp off" in label else "-o", label=label)
    axes[2].set(title="Decode vs context, synthetic cache, 1 BLAS thread/rank", xlabel="context tokens",
                ylabel="tokens/s")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("spmd-cp, SmolLM2-135M float32 on 2 x86 cores (N = 4 oversubscribed)")
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(args.output)


if __name__ == "__main__":
    main()
