"""kernels/prefill_attention.h against float64 numpy and against MLX's tiles; a prefill
MLP's GELU gate in C (engine/activation.py) against float64 numpy and mlx-lm's.

Run as a script (the re-exec puts the BLAS in the global scope the library needs). The
blocks are those the CP algorithms hand block_attention: a causal square, a later chunk
over the whole prefix, head-tail positions (two runs of each), a sliding window, queries
that see no key at all, a head width that is no multiple of the vector blocks, a group
of eight query heads on one KV head; on one thread of the pool and on three. Prints one
line: RESULT {json}: per check, the largest error against numpy (out and lse) and
against MLX's tiles, and whether the rows that see nothing are exactly 0 and -inf; per
thread count the GELU gate's largest error against numpy and mlx-lm (relative to the
largest output), whether the C kernel computed it, and with --no-fast-exp whether
mlx-lm's expression did.
"""

import json

from spmd_cp import blas

blas.ensure_fast_blas()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

from spmd_cp.attention import block, native_prefill  # noqa: E402
from spmd_cp.attention.exp import use_polynomial_exp  # noqa: E402
from spmd_cp.engine import activation  # noqa: E402

rng = np.random.default_rng(3)
CASES = {  # name: (heads, kv heads, d, query positions, key positions, window)
    "causal": (9, 3, 64, np.arange(300), np.arange(300), None),
    "chunk_over_prefix": (8, 2, 16, np.arange(213, 250), np.arange(250), None),
    "head_tail": (4, 4, 24, np.r_[0:50, 400:450], np.r_[0:130, 320:450], None),
    "window": (6, 2, 64, np.arange(100, 300), np.arange(300), 40),
    "sees_nothing": (2, 1, 64, np.arange(50), np.arange(1000, 1060), None),
    "group_of_eight": (8, 1, 32, np.arange(129), np.arange(129), 16),
}


def reference(q, k, v, q_pos, k_pos, scale, window):
    heads, group = q.shape[0], q.shape[0] // k.shape[0]
    out, lse = np.zeros(q.shape), np.full(q.shape[:2], -np.inf)
    visible = k_pos[None, :] <= q_pos[:, None]
    if window:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    seen = visible.any(axis=1)
    for h in range(heads):
        scores = np.where(visible, (q[h] * scale).astype(np.float64) @ k[h // group].T, -np.inf)
        top = np.where(seen, scores.max(axis=1), 0.0)
        weights = np.exp(scores - top[:, None])
        total = weights.sum(axis=1)
        out[h][seen] = (weights @ v[h // group])[seen] / total[seen, None]
        lse[h][seen] = np.log(total[seen]) + top[seen]
    return out, lse


def mlx_tiles(q, k, v, q_pos, k_pos, scale, window):
    usable, native_prefill.usable = native_prefill.usable, lambda q: False
    try:
        return block.block_attention(q, k, v, q_pos, k_pos, scale, window)
    finally:
        native_prefill.usable = usable


library = native_prefill.pooled_library()
assert library is not None, "no library"
results = {}
for threads in (1, 3):
    library.spmd_cp_decode_set_threads(threads)
    for name, (heads, kv_heads, d, q_pos, k_pos, window) in CASES.items():
        q = (2 * rng.standard_normal((heads, len(q_pos), d))).astype(np.float32)
        k, v = (rng.standard_normal((2, kv_heads, len(k_pos), d))).astype(np.float32)
        arrays = [mx.array(x) for x in (q, k, v)]
        scale = d ** -0.5
        assert native_prefill.usable(arrays[0])
        out, lse = (np.array(x) for x in native_prefill.native_attention(
            *arrays, q_pos, k_pos, scale, window))
        ref_out, ref_lse = reference(q, k, v, q_pos, k_pos, scale, window)
        tile_out, tile_lse = (np.array(x) for x in mlx_tiles(*arrays, q_pos, k_pos, scale,
                                                              window))
        seen = np.isfinite(ref_lse)
        results[f"{name}/{threads}"] = {
            "out": float(np.abs(out - ref_out).max()),
            "lse": float(np.abs(lse[seen] - ref_lse[seen]).max()) if seen.any() else 0.0,
            "tiles": float(max(np.abs(out - tile_out).max(),
                               np.abs(lse[seen] - tile_lse[seen]).max() if seen.any() else 0)),
            "unseen_exact": bool(np.all(out[~seen] == 0) and np.all(lse[~seen] == -np.inf)),
            "unseen_rows": int((~seen).sum())}


def gelu_case() -> dict:
    """gelu_approx(gate) * up over a prefill's 66 rows of 1,003 (no multiple of a vector):
    gates of every size (the tanh saturates both ways), zeros; errors relative to the
    largest output. Then a decode step's 8 rows: mlx-lm's expression."""
    gate = np.concatenate([12 * rng.standard_normal((5, 1003)), rng.standard_normal((60, 1003)),
                           np.zeros((1, 1003))]).astype(np.float32)
    up = rng.standard_normal(gate.shape).astype(np.float32)
    g = gate.astype(np.float64)
    want = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * up
    got = np.array(activation.gelu_gate(mx.array(gate), mx.array(up)))
    theirs = np.array(nn.gelu_approx(mx.array(gate)) * mx.array(up))
    top = np.abs(want).max()
    return {"numpy": float(np.abs(got - want).max() / top),
            "mlx": float(np.abs(got - theirs).max() / top),
            "native": activation._native(mx.array(gate)),
            "equals_mlx": bool(np.array_equal(got, theirs)),
            "few_rows_equal_mlx": bool(np.array_equal(
                np.array(activation.gelu_gate(mx.array(gate[:8]), mx.array(up[:8]))),
                theirs[:8]))}


for threads in (1, 3):
    library.spmd_cp_decode_set_threads(threads)
    results[f"gelu/{threads}"] = gelu_case()
use_polynomial_exp(False)  # --no-fast-exp: MLX's ops, its exp and its order of sums
results["no_fast_exp_uses_c"] = native_prefill.usable(mx.zeros((2, 64, 16)))
results["no_fast_exp_gelu"] = gelu_case()
print("RESULT " + json.dumps(results))
