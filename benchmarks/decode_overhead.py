"""One-rank decode, spmd-cp against mlx-lm, side by side in one process.

    python benchmarks/decode_overhead.py [--context 4096] [--tokens 16] [--rounds 5]

The same prompt is prefilled both ways (mlx-lm's model with its own KV cache; spmd-cp's
Engine on one rank), then blocks of greedy tokens alternate between:

  mlx-lm     its own ``generate_step`` (step n+1 queued with ``mx.async_eval`` before
             token n reaches the host), fed the prompt's last token;
  overlapped ``generation._decode_overlapped``: spmd-cp's one-rank loop on a GPU
             (queued the same way);
  lock-step  ``Engine.decode_step`` evaluated to a token each step: the loop several
             ranks need (the token is broadcast before the next step), and spmd-cp's
             one-rank loop on the CPU, where it measured faster than overlapping.

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
import sys
import time
from pathlib import Path


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per block")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
    from mpi4py import MPI

    from spmd_cp.attention import block_attention, decode_attention
    from spmd_cp.runtime.comm import Comm
    from spmd_cp.engine.engine import Engine
    from spmd_cp.engine.generation import _decode_overlapped
    from spmd_cp.models.loader import default_model_path, load_model
    from spmd_cp.engine.model import CPModel

    model = load_model(default_model_path()).model
    ids = np.random.RandomState(0).randint(3, 20000, size=args.context)
    comm = Comm(MPI.COMM_WORLD)
    engine = Engine(CPModel(model), comm, algo="pass-kv")
    cache = engine.new_cache()
    prefill_logits, _ = engine.prefill(cache, ids)
    decode_state = (cache.decode_steps, cache.decode_owner)
    lm_cache = make_prompt_cache(model)
    model(mx.array(ids[:-1])[None], cache=lm_cache)  # generate_step feeds the last id
    mx.eval([c.state for c in lm_cache])
    k = args.tokens

    def reset_spmd_cp():
        cache.truncate(args.context)
        cache.decode_steps, cache.decode_owner = decode_state

    def run_mlx_lm():
        before = lm_cache[0].offset
        tokens = [t for t, _ in generate_step(mx.array(ids[-1:]), model, max_tokens=k,
                                               sampler=lambda x: mx.argmax(x, axis=-1),
                                               prompt_cache=lm_cache)]
        mx.eval([c.state for c in lm_cache])  # it leaves one forward queued: finish it
        forwards = lm_cache[0].offset - before
        trim_prompt_cache(lm_cache, forwards)
        return tokens, forwards

    def run_overlapped():
        tokens = []

        def finished(token):
            tokens.append(token)
            return False

        _decode_overlapped(engine, cache, prefill_logits, lambda x: mx.argmax(x), finished, k)
        reset_spmd_cp()
        return tokens, k - 1

    def run_lockstep():
        tokens, logits = [], prefill_logits
        for step in range(k):
            tokens.append(int(mx.argmax(logits)))
            if step + 1 < k:
                logits = engine.decode_step(cache, tokens[-1])
        reset_spmd_cp()
        return tokens, k - 1

    loops = {"mlx-lm": run_mlx_lm, "overlapped": run_overlapped, "lock-step": run_lockstep}
    per_forward = {name: [] for name in loops}
    tokens = {}
    for fn in loops.values():
        fn()  # warm-up
    for _ in range(args.rounds):
        for name, fn in loops.items():
            start = time.perf_counter()
            tokens[name], forwards = fn()
            per_forward[name].append((time.perf_counter() - start) / forwards)

    # Attention alone: 1 query, NH=9 heads, NKV=3, d=64, over the context, x30 layers.
    q = mx.random.normal((9, 1, 64))
    keys = mx.random.normal((3, args.context, 64))
    values = mx.random.normal((3, args.context, 64))
    mx.eval(q, keys, values)
    q_pos = np.array([args.context], np.int64)
    k_pos = np.arange(args.context, dtype=np.int64)
    one_rank = decode_attention(comm)
    kernels = {
        "fused": lambda: mx.fast.scaled_dot_product_attention(
            q[None], keys[None], values[None], scale=0.125),
        "block_attention": lambda: block_attention(q, keys, values, q_pos, k_pos, 0.125)[0],
        "spmd_cp_decode": lambda: one_rank(q, keys, values, q_pos, k_pos, 0.125),
    }
    attention = {name: [] for name in kernels}
    for _ in range(5):
        for name, fn in kernels.items():
            start = time.perf_counter()
            mx.eval([fn() for _ in range(30)])
            attention[name].append(time.perf_counter() - start)

    ms = {name: 1e3 * float(np.median(t)) for name, t in per_forward.items()}
    result = {
        "context": args.context, "tokens_per_block": k, "rounds": args.rounds,
        "threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "ms_per_forward": ms,
        "overlapped_vs_mlx_lm_tok_s": ms["mlx-lm"] / ms["overlapped"],
        "lockstep_vs_mlx_lm_tok_s": ms["mlx-lm"] / ms["lock-step"],
        "same_tokens": tokens["mlx-lm"] == tokens["overlapped"] == tokens["lock-step"],
        "attention_x30_ms": {n: 1e3 * float(np.median(t)) for n, t in attention.items()},
    }
    print(f"context {args.context}, ms per forward: "
          + ", ".join(f"{n} {v:.1f}" for n, v in ms.items())
          + f"; decode speed vs mlx-lm: overlapped {result['overlapped_vs_mlx_lm_tok_s']:.2f}x, "
          f"lock-step {result['lockstep_vs_mlx_lm_tok_s']:.2f}x; same tokens: "
          f"{result['same_tokens']}; attention x30 ms: "
          + ", ".join(f"{n} {v:.1f}" for n, v in result["attention_x30_ms"].items()))
    print(json.dumps(result))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import benchlib

    benchlib.save(f"decode_overhead_{args.context}", {"machine": benchlib.machine(), **result})


if __name__ == "__main__":
    from spmd_cp.blas import ensure_fast_blas

    ensure_fast_blas()
    main()
