"""The largest model that fits a per-rank memory budget, replicated vs --shard-weights, per N.

    python benchmarks/largest_model.py                      # 16 and 64 GiB, 32K tokens
    python benchmarks/largest_model.py --budget-gib 24 --context 131072

Computed with the forecast `--memory-limit` checks (spmd_cp.engine.cache.forecast): weights
per rank (replicated, or with layer sharding the busiest rank's layers i mod N, its 1/N
of the vocabulary and a window of PREFETCH_LAYERS + 1 layers: the same
WeightLayout.per_rank the CLI uses, built here from published shapes instead of file
headers), the KV shard, one prefill chunk's activations, and PROCESS_BYTES for what a
rank process holds outside MLX (measured 0.14-0.17 GiB on the test machine, rounded up).
Weights and KV in bfloat16 (the GPU path: Metal on Macs, CUDA); the CPU path computes in
float32 and needs twice the weight and KV bytes. One cell is measured, not computed:
docs/SHARDED_WEIGHTS.md ("The largest model per budget").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spmd_cp.engine.cache.forecast import forecast_rank_bytes  # noqa: E402
from spmd_cp.engine.weights.weights import PREFETCH_LAYERS  # noqa: E402
from spmd_cp.models.partial_load import WeightLayout  # noqa: E402
from spmd_cp.models.shape import ModelShape  # noqa: E402

PROCESS_BYTES = int(0.25 * 2**30)

# name: layers, hidden, intermediate, heads, kv heads, head dim, vocabulary, tied head
MODELS = {
    "Llama-3.2-1B": (16, 2048, 8192, 32, 8, 64, 128256, True),
    "Llama-3.2-3B": (28, 3072, 8192, 24, 8, 128, 128256, True),
    "Llama-3.1-8B": (32, 4096, 14336, 32, 8, 128, 128256, False),
    "Qwen2.5-14B": (48, 5120, 13824, 40, 8, 128, 152064, False),
    "Qwen2.5-32B": (64, 5120, 27648, 40, 8, 128, 152064, False),
    "Llama-3.1-70B": (80, 8192, 28672, 64, 8, 128, 128256, False),
}


def layout_and_shape(spec, elem: int) -> tuple[WeightLayout, ModelShape, int]:
    layers, hidden, inter, heads, kv_heads, head_dim, vocab, tied = spec
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o; k, v
    layer = (attention + 3 * hidden * inter + 2 * hidden) * elem
    vocab_bytes = vocab * hidden * elem * (1 if tied else 2)
    layout = WeightLayout([layer] * layers, [layer] * layers, vocab_bytes, hidden * elem)
    params = layout.replicated // elem
    return layout, ModelShape(layers, hidden, inter, heads, kv_heads, head_dim, vocab, elem), params


def rank_bytes(spec, ranks: int, sharded: bool, context: int, chunk: int, elem: int) -> int:
    layout, shape, _ = layout_and_shape(spec, elem)
    weights = layout.per_rank(ranks, PREFETCH_LAYERS) if sharded else layout.replicated
    return forecast_rank_bytes(shape, weights, context, min(chunk, context), ranks,
                               process_bytes=PROCESS_BYTES).total


def largest(budget: int, ranks: int, sharded: bool, context: int, chunk: int, elem: int):
    fitting = [(layout_and_shape(spec, elem)[2], name) for name, spec in MODELS.items()
               if rank_bytes(spec, ranks, sharded, context, chunk, elem) <= budget]
    return max(fitting, default=None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-gib", type=float, nargs="+", default=[16, 64])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--elem-bytes", type=int, default=2)
    args = parser.parse_args()
    gib = 2**30
    print(f"context {args.context} tokens, prefill chunk {args.chunk}, {args.elem_bytes}-byte "
          f"weights and KV, {PROCESS_BYTES / gib:.2f} GiB per rank outside MLX, "
          f"prefetch window {PREFETCH_LAYERS + 1} layers\n")
    print("| budget per rank | N | replicated: largest (parameters) | sharded: largest (parameters) |")
    print("|---|---|---|---|")
    for budget in args.budget_gib:
        for n in args.ranks:
            cells = []
            for sharded in (False, True):
                found = largest(int(budget * gib), n, sharded, args.context, args.chunk,
                                args.elem_bytes)
                cells.append(f"{found[1]} ({found[0] / 1e9:.1f} B)" if found else "none")
            print(f"| {budget:g} GiB | {n} | {cells[0]} | {cells[1]} |")
    print("\nPer-rank forecast (GiB), replicated / sharded:\n")
    print("| model | parameters | " + " | ".join(f"N = {n}" for n in args.ranks) + " |")
    print("|---|---|" + "---|" * len(args.ranks))
    for name, spec in MODELS.items():
        params = layout_and_shape(spec, args.elem_bytes)[2]
        row = [f"{rank_bytes(spec, n, False, args.context, args.chunk, args.elem_bytes) / gib:.1f}"
               f" / {rank_bytes(spec, n, True, args.context, args.chunk, args.elem_bytes) / gib:.1f}"
               for n in args.ranks]
        print(f"| {name} | {params / 1e9:.1f} B | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
