"""Exact attention of a query block against a key block, as mergeable partials.

Pure MLX, no MPI. Every CP algorithm reduces to: compute ``(out, lse)`` for some
(query block, key block) pairs with the causal mask taken from *global* positions,
then merge the partials of each query row. Shapes, with G = NH // NKV query heads per
KV head (grouped-query attention):

    q    (NH, Tq, d)      k, v (NKV, Tk, d)      q_pos (Tq,)   k_pos (Tk,)
    out  (NH, Tq, d)      lse  (NH, Tq)          float32

A query row that sees no key has ``lse = -inf`` and ``out = 0``: it contributes nothing
to a merge and never produces a NaN.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

NEG_INF = float("-inf")

# Scores materialised at once, in elements (x4 bytes): bounds attention's activation
# memory independently of the prompt length (a 32K x 32K x 9-head score matrix would be
# 37 GB). 8M elements = 32 MB per tile.
SCORE_TILE_ELEMENTS = 8 * 1024 * 1024


def _finite_or_zero(x: mx.array) -> mx.array:
    return mx.where(x == NEG_INF, 0.0, x)


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Merge two partial attentions over disjoint key sets of the same queries.

    ``lse = logaddexp(lse_a, lse_b)``; each ``out`` is weighted by ``exp(lse_x - lse)``.
    The weights are computed against a finite stand-in for ``lse`` so that two empty
    partials (both ``-inf``) give weights 0 instead of NaN.
    """
    lse = mx.logaddexp(lse_a, lse_b)
    lse_safe = _finite_or_zero(lse)
    w_a = mx.exp(lse_a - lse_safe)[..., None]
    w_b = mx.exp(lse_b - lse_safe)[..., None]
    return w_a * out_a + w_b * out_b, lse


def merge_stacked(outs: mx.array, lses: mx.array):
    """Merge partials stacked on a leading axis: outs (P, ..., d), lses (P, ...)."""
    lse_max = _finite_or_zero(lses.max(axis=0))
    weights = mx.exp(lses - lse_max)  # (P, ...): 0 for empty partials
    total = weights.sum(axis=0)
    lse = mx.log(total) + lse_max  # -inf where every partial is empty
    norm = mx.where(total > 0, total, 1.0)
    out = (weights[..., None] * outs).sum(axis=0) / norm[..., None]
    return out, lse


def _tile_attention(q, k, v, q_pos, k_pos, scale):
    """One tile: dense scores for (Tq, Tk) with the causal mask, as (out, lse)."""
    num_heads, tq, d = q.shape
    num_kv = k.shape[0]
    groups = num_heads // num_kv
    qg = q.reshape(num_kv, groups, tq, d)
    scores = (qg * scale) @ k[:, None].swapaxes(-1, -2)  # (NKV, G, Tq, Tk)
    visible = k_pos[None, :] <= q_pos[:, None]  # (Tq, Tk)
    scores = mx.where(visible, scores, NEG_INF)
    row_max = _finite_or_zero(scores.max(axis=-1, keepdims=True))
    probs = mx.exp(scores - row_max)
    row_sum = probs.sum(axis=-1, keepdims=True)
    out = (probs @ v[:, None]) / mx.where(row_sum > 0, row_sum, 1.0)
    lse = (mx.log(row_sum) + row_max).squeeze(-1)
    return out.reshape(num_heads, tq, d), lse.reshape(num_heads, tq)


def block_attention(q, k, v, q_pos: np.ndarray, k_pos: np.ndarray, scale: float):
    """Causal attention of queries at ``q_pos`` over keys at ``k_pos``, as (out, lse).

    The work is tiled so no tile holds more than ``SCORE_TILE_ELEMENTS`` scores, and a
    key tile that lies entirely in every query's future is skipped without computing it
    (positions are numpy arrays so this decision costs no device sync).
    """
    num_heads, tq, d = q.shape
    q = q.astype(mx.float32)
    k = k.astype(mx.float32)
    v = v.astype(mx.float32)
    out = mx.zeros((num_heads, tq, d), mx.float32)
    lse = mx.full((num_heads, tq), NEG_INF, mx.float32)
    if tq == 0 or k.shape[1] == 0:
        return out, lse

    # Square tiles for prefill; a short query block (decode: one row) gets long key tiles.
    q_tile = min(tq, max(64, int(np.sqrt(SCORE_TILE_ELEMENTS / num_heads))))
    k_tile = max(64, SCORE_TILE_ELEMENTS // (num_heads * q_tile))
    q_tiles = []
    for q0 in range(0, tq, q_tile):
        q1 = min(q0 + q_tile, tq)
        qp = q_pos[q0:q1]
        q_out, q_lse = out[:, q0:q1], lse[:, q0:q1]  # empty partial until a tile lands
        merged_any = False
        for k0 in range(0, k.shape[1], k_tile):
            k1 = min(k0 + k_tile, k.shape[1])
            kp = k_pos[k0:k1]
            if kp.min() > qp.max():
                continue  # every key is in every query's future
            t_out, t_lse = _tile_attention(
                q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], mx.array(qp), mx.array(kp), scale
            )
            if merged_any:
                q_out, q_lse = merge_partials(q_out, q_lse, t_out, t_lse)
            else:
                q_out, q_lse, merged_any = t_out, t_lse, True
        q_tiles.append((q_out, q_lse))
    if len(q_tiles) == 1:
        return q_tiles[0]
    return (
        mx.concatenate([t[0] for t in q_tiles], axis=1),
        mx.concatenate([t[1] for t in q_tiles], axis=1),
    )
