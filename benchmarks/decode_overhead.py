"""Why is spmd-cp's one-rank decode step slower than mlx-lm's? Side by side, in one process.

    python benchmarks/decode_overhead.py [--context 1024] [--steps 24] [--threads 2]

After the same prompt is prefilled both ways (mlx-lm's model with its KVCache; spmd-cp's
Engine on one rank), decode steps alternate between (a) mlx-lm's forward of one token
(+ argmax) and (b) Engine.decode_step (+ argmax), feeding each its own greedy token.
Then the attention of one query over the context, 30 times (one per layer), both ways:
mx.fast.scaled_dot_product_attention (what mlx-lm's llama calls) versus
spmd_cp.attention.block_attention (tiles, mask from positions, (out, lse)).
Medians; prints one JSON line and a short table.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()

    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache
    from mpi4py import MPI

    from spmd_cp.attention import block_attention
    from spmd_cp.comm import Comm
    from spmd_cp.engine import Engine
    from spmd_cp.loader import default_model_path, load_model
    from spmd_cp.model import CPModel

    loaded = load_model(default_model_path())
    model = loaded.model
    ids = np.random.RandomState(0).randint(3, 20000, size=args.context)
    comm = Comm(MPI.COMM_WORLD)
    engine = Engine(CPModel(model), comm, algo="pass-kv")
    cache = engine.new_cache()
    logits_cp, _ = engine.prefill(cache, ids)
    mlx_cache = make_prompt_cache(model)
    logits_lm = model(mx.array(ids)[None], cache=mlx_cache)[0, -1]
    tok_cp, tok_lm = int(mx.argmax(logits_cp)), int(mx.argmax(logits_lm))
    t_lm, t_cp = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        tok_lm = int(mx.argmax(model(mx.array([[tok_lm]]), cache=mlx_cache)[0, -1]))
        t_lm.append(time.perf_counter() - start)
        start = time.perf_counter()
        tok_cp = int(mx.argmax(engine.decode_step(cache, tok_cp)))
        t_cp.append(time.perf_counter() - start)

    # Attention alone: 1 query, NH=9 heads, NKV=3, d=64, over the context, x30 layers.
    q = mx.random.normal((9, 1, 64))
    k = mx.random.normal((3, args.context, 64))
    v = mx.random.normal((3, args.context, 64))
    mx.eval(q, k, v)
    q_pos = np.array([args.context], np.int64)
    k_pos = np.arange(args.context, dtype=np.int64)

    def sdpa():
        return mx.fast.scaled_dot_product_attention(q[None], k[None], v[None], scale=0.125)

    def ours():
        return block_attention(q, k, v, q_pos, k_pos, 0.125)[0]

    a_sdpa, a_ours = [], []
    for _ in range(5):
        for fn, times in ((sdpa, a_sdpa), (ours, a_ours)):
            start = time.perf_counter()
            mx.eval([fn() for _ in range(30)])
            times.append(time.perf_counter() - start)
    result = {"context": args.context, "threads": os.environ.get("OPENBLAS_NUM_THREADS"),
              "mlx_lm_step_s": float(np.median(t_lm[3:])),
              "spmd_cp_step_s": float(np.median(t_cp[3:])),
              "sdpa_30_s": float(np.median(a_sdpa)), "block_attention_30_s": float(np.median(a_ours))}
    print(f"context {args.context}: mlx-lm step {1e3 * result['mlx_lm_step_s']:.1f} ms, "
          f"spmd-cp step {1e3 * result['spmd_cp_step_s']:.1f} ms; attention x30: "
          f"mx.fast.sdpa {1e3 * result['sdpa_30_s']:.1f} ms, block_attention "
          f"{1e3 * result['block_attention_30_s']:.1f} ms")
    print(json.dumps(result))
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import benchlib

    benchlib.save(f"decode_overhead_{args.context}", {"machine": benchlib.machine(), **result})


if __name__ == "__main__":
    from spmd_cp.blas import ensure_fast_blas

    ensure_fast_blas()
    main()
