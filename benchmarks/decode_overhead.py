"""One-rank decode, spmd-cp against mlx-lm, side by side in one process.

    python benchmarks/decode_overhead.py [--context 4096] [--tokens 16] [--rounds 5]

The same prompt is prefilled both ways (mlx-lm's model with its own KV cache; spmd-cp's
Engine on one rank), then blocks of greedy tokens alternate between:

  mlx-lm     its own ``generate_step`` (step n+1 queued with ``mx.async_eval`` before
             token n reaches the host), fed the prompt's last token;
  overlapped ``generation.decode_tokens(..., overlap=True)``: spmd-cp's one-rank loop
             on a GPU (queued the same way);
  lock-step  ``generation.decode_tokens`` evaluating each step to a token: the loop
             several ranks need (the token is broadcast before the next step), and
             spmd-cp's one-rank loop on the CPU, where it measured faster than overlapping.

After each block both caches are cut back to the prompt, so every block decodes at the
same context. Reported: milliseconds per forward pass (each loop's forwards counted),
median over rounds, and whether the greedy tokens agree. Then the attention of one query
over the context, 30 times (one per layer): MLX's fused kernel (what mlx-lm calls),
spmd-cp's block_attention, and the decode attention spmd-cp uses on one rank.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import benchlib


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per block")
    parser.add_argument("--rounds", type=int, default=5)
    return parser.parse_args()


def decode_loops(bench: benchlib.Worker, ids, k: int) -> dict:
    """name -> a function decoding ``k`` greedy tokens after ``ids`` (prefilled once),
    returning (tokens, forward passes run); every call starts from the same cache."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from spmd_cp.engine.engine import Engine
    from spmd_cp.engine.generation import decode_tokens

    model = bench.loaded.model
    engine = Engine(bench.model, bench.comm, algo="pass-kv")
    cache = engine.new_cache()
    prefill_logits, _ = engine.prefill(cache, ids)
    prompt = cache.checkpoint()
    lm_cache = make_prompt_cache(model)
    model(mx.array(ids[:-1])[None], cache=lm_cache)  # generate_step feeds the last id
    mx.eval([c.state for c in lm_cache])

    def run_mlx_lm():
        before = lm_cache[0].offset
        tokens = [t for t, _ in generate_step(mx.array(ids[-1:]), model, max_tokens=k,
                                               sampler=lambda x: mx.argmax(x, axis=-1),
                                               prompt_cache=lm_cache)]
        mx.eval([c.state for c in lm_cache])  # it leaves one forward queued: finish it
        forwards = lm_cache[0].offset - before
        trim_prompt_cache(lm_cache, forwards)
        return tokens, forwards

    def spmd_cp_loop(overlap: bool):
        def run():
            tokens = [t for t, _ in decode_tokens(engine, cache, prefill_logits, mx.argmax, k,
                                                  overlap)]
            cache.rollback(prompt)
            return tokens, k - 1

        return run

    return {"mlx-lm": run_mlx_lm, "overlapped": spmd_cp_loop(True),
            "lock-step": spmd_cp_loop(False)}


def attention_ms(comm, context: int) -> dict:
    """One query's attention over the context, 30 times (one per layer), per kernel."""
    import mlx.core as mx
    import numpy as np

    from spmd_cp.attention import block_attention, decode_attention

    # 1 query, NH=9 heads, NKV=3, d=64: SmolLM2-135M's attention.
    q = mx.random.normal((9, 1, 64))
    keys = mx.random.normal((3, context, 64))
    values = mx.random.normal((3, context, 64))
    mx.eval(q, keys, values)
    q_pos = np.array([context], np.int64)
    k_pos = np.arange(context, dtype=np.int64)
    one_rank = decode_attention(comm)
    kernels = {
        "fused": lambda: mx.fast.scaled_dot_product_attention(
            q[None], keys[None], values[None], scale=0.125),
        "block_attention": lambda: block_attention(q, keys, values, q_pos, k_pos, 0.125)[0],
        "spmd_cp_decode": lambda: one_rank(q, keys, values, q_pos, k_pos, 0.125),
    }
    times = {name: [] for name in kernels}
    for _ in range(5):
        for name, fn in kernels.items():
            start = time.perf_counter()
            mx.eval([fn() for _ in range(30)])
            times[name].append(time.perf_counter() - start)
    return {n: 1e3 * float(np.median(t)) for n, t in times.items()}


def work(bench: benchlib.Worker, args):
    import numpy as np

    loops = decode_loops(bench, bench.random_ids(args.context), args.tokens)
    per_forward = {name: [] for name in loops}
    tokens = {}
    for fn in loops.values():
        fn()  # warm-up
    for _ in range(args.rounds):
        for name, fn in loops.items():
            start = time.perf_counter()
            tokens[name], forwards = fn()
            per_forward[name].append((time.perf_counter() - start) / forwards)

    ms = {name: 1e3 * float(np.median(t)) for name, t in per_forward.items()}
    result = {
        "context": args.context, "tokens_per_block": args.tokens, "rounds": args.rounds,
        "threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "ms_per_forward": ms,
        "overlapped_vs_mlx_lm_tok_s": ms["mlx-lm"] / ms["overlapped"],
        "lockstep_vs_mlx_lm_tok_s": ms["mlx-lm"] / ms["lock-step"],
        "same_tokens": tokens["mlx-lm"] == tokens["overlapped"] == tokens["lock-step"],
        "attention_x30_ms": attention_ms(bench.comm, args.context),
    }
    print(f"context {args.context}, ms per forward: "
          + ", ".join(f"{n} {v:.1f}" for n, v in ms.items())
          + f"; decode speed vs mlx-lm: overlapped {result['overlapped_vs_mlx_lm_tok_s']:.2f}x, "
          f"lock-step {result['lockstep_vs_mlx_lm_tok_s']:.2f}x; same tokens: "
          f"{result['same_tokens']}; attention x30 ms: "
          + ", ".join(f"{n} {v:.1f}" for n, v in result["attention_x30_ms"].items()))
    print(json.dumps(result))
    benchlib.save(f"decode_overhead_{args.context}", {"machine": benchlib.machine(), **result})


if __name__ == "__main__":
    arguments = parse_args()
    benchlib.worker_main(lambda bench: work(bench, arguments))
