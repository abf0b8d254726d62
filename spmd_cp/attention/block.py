"""Exact attention of a query block against a key block, as mergeable partials.

Pure math, no MPI: MLX ops, and on the CPU path a prefill's tiles in C
(native_prefill.py: the same (out, lse) on every thread of the rank). Every CP
algorithm reduces to: compute ``(out, lse)`` for some (query block, key block) pairs
with the causal mask taken from *global* positions, then merge the partials of each
query row. Shapes, with G = NH // NKV query heads per
KV head (grouped-query attention):

    q    (NH, Tq, d)      k, v (NKV, Tk, d)      q_pos (Tq,)   k_pos (Tk,)
    out  (NH, Tq, d)      lse  (NH, Tq)          float32

A query row that sees no key has ``lse = -inf`` and ``out = 0``: it contributes nothing
to a merge and never produces a NaN.

``window``: a sliding-window layer's (Gemma 3's local layers, mlx-lm's
``create_causal_mask(window_size=W)``): a query at position p sees the keys at p - W + 1
to p only. None: every earlier key.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import native_prefill
from .exp import softmax_exp

NEG_INF = float("-inf")

# Scores materialised at once, in elements (x4 bytes): bounds attention's activation
# memory independently of the prompt length (a 32K x 32K x 9-head score matrix would be
# 37 GB). 8M elements = 32 MB per tile.
SCORE_TILE_ELEMENTS = 8 * 1024 * 1024
# Query/key tile edge in prefill: the diagonal tiles (half wasted by the causal mask)
# cost about PREFILL_TILE / T of the work, and smaller tiles cost more MLX calls.
PREFILL_TILE = 256


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
    out, lse = merge_stacked_columns(outs, lses[..., None])
    return out[0], lse[0, ..., 0]


def merge_stacked_columns(outs: mx.array, lses: mx.array):
    """``merge_stacked`` with each lse as a column beside its output, lses (P, ..., 1),
    as packed partials carry it, and the stacking axis kept: (1, ..., d) and (1, ..., 1).
    No axis squeezed and re-expanded (the decode merge, gather.py, takes it so on the
    CPU path, where graph nodes count)."""
    lse_max = _finite_or_zero(lses.max(axis=0, keepdims=True))
    weights = mx.exp(lses - lse_max)  # (P, ..., 1): 0 for empty partials
    total = weights.sum(axis=0, keepdims=True)
    lse = mx.log(total) + lse_max  # -inf where every partial is empty
    out = (weights * outs).sum(axis=0, keepdims=True) / mx.where(total > 0, total, 1.0)
    return out, lse


def visible_keys(q_pos, k_pos, window: int | None) -> mx.array:
    """(Tq, Tk) bool: which keys each query sees (causal, within ``window`` if given)."""
    q_col, k_row = mx.array(q_pos)[:, None], mx.array(k_pos)[None, :]
    visible = k_row <= q_col
    if window is not None:
        visible = visible & (k_row > q_col - window)
    return visible


def _tile_attention(q, k, v, q_pos, k_pos, scale, window: int | None = None):
    """One tile: dense scores for (Tq, Tk), as (out, lse).

    ``q_pos``/``k_pos`` are None for a tile whose keys every query sees: no mask needed.
    The G query heads that share a KV head are folded into the rows of one matmul
    against that head's keys, (NKV, G*Tq, d) @ (NKV, d, Tk): a plain batched GEMM, where
    broadcasting the keys over a G axis costs a copy and, for a single decode query,
    runs G skinny products (measured: 1.8x faster attention per decode token at 4K).
    """
    num_heads, tq, d = q.shape
    num_kv = k.shape[0]
    groups = num_heads // num_kv
    rows = groups * tq
    if tq == 1 and q_pos is None:
        return _decode_tile(q, k, v, scale)
    scores = (q.reshape(num_kv, rows, d) * scale) @ k.swapaxes(-1, -2)  # (NKV, G*Tq, Tk)
    row_max = scores.max(axis=-1, keepdims=True)
    if q_pos is not None:
        visible = visible_keys(q_pos, k_pos, window)  # (Tq, Tk)
        tk = scores.shape[-1]
        scores = mx.where(visible, scores.reshape(num_kv, groups, tq, tk), NEG_INF)
        scores = scores.reshape(num_kv, rows, tk)
        row_max = _finite_or_zero(scores.max(axis=-1, keepdims=True))
    probs = softmax_exp(scores, row_max)
    row_sum = probs.sum(axis=-1, keepdims=True)  # >= 1 in a row that sees any key
    if q_pos is not None:
        row_sum_safe = mx.where(row_sum > 0, row_sum, 1.0)  # rows that see no key: out 0
    else:
        row_sum_safe = row_sum  # (a decode query sees every key: skip the extra ops)
    out = (probs @ v) / row_sum_safe
    lse = (mx.log(row_sum) + row_max).squeeze(-1)
    return out.reshape(num_heads, tq, d), lse.reshape(num_heads, tq)


def _decode_tile(q, k, v, scale):
    """``_tile_attention`` of one query row that sees every key, as (out, lse)."""
    num_heads, _, d = q.shape
    values, total, row_max = decode_sums(q, k, v, scale)
    out = values / total  # (NKV, G, d); total >= 1
    lse = mx.log(total) + row_max * scale
    return out.reshape(num_heads, 1, d), lse.reshape(num_heads, 1)


def decode_sums(q, k, v, scale):
    """One query row (NH, 1, d) over keys it sees all of (at least one), unnormalized:
    ``(probs @ v (NKV, G, d), sum of probs (NKV, G, 1), max score (NKV, G, 1))`` with
    ``probs = exp((score - max) * scale)`` and the scores not scaled.

    The query group's rows times the keys given as columns, (NKV, G, d) @ (NKV, d, Tk):
    the scores lie along each query's row, so the softmax reduces contiguous rows, and
    the scale rides in the exp's kernel; no transposes. On the CPU path the product is
    kernels/gemv_forward.c's one pass over the keys (the same dot products, bit for bit, as
    the keys times the query's columns); fewer graph nodes count there (one_token.py).
    """
    num_heads, _, d = q.shape
    num_kv = k.shape[0]
    scores = q.reshape(num_kv, num_heads // num_kv, d) @ k.swapaxes(-1, -2)  # (NKV, G, Tk)
    row_max = scores.max(axis=-1, keepdims=True)
    probs = softmax_exp(scores, row_max, scale)
    return probs @ v, probs.sum(axis=-1, keepdims=True), row_max


def decode_partial_packed(q, k, v, scale) -> mx.array:
    """A decode query's float32 partial over this rank's whole shard for the decode
    merge (``merge_packed_sums``), unnormalized: (NKV, G, d + 2) holding ``decode_sums``'
    three parts side by side (d + 1 floats per head on the wire, as ``pack_partial``'s).
    An empty shard is zeros with a max of -inf, which the merge weighs 0."""
    num_heads, _, d = q.shape
    num_kv = k.shape[0]
    if k.shape[1] == 0:
        shape = (num_kv, num_heads // num_kv, 1)
        return mx.concatenate([mx.zeros(shape[:2] + (d + 1,), mx.float32),
                               mx.full(shape, NEG_INF, mx.float32)], axis=-1)
    return mx.concatenate(decode_sums(q, k.astype(mx.float32), v.astype(mx.float32), scale),
                          axis=-1)


def merge_packed_sums(partials: mx.array, head_dim: int, scale: mx.array) -> mx.array:
    """The exact merge of stacked ``decode_partial_packed`` partials (P, NKV, G, d + 2),
    as (1, NKV, G, d) (the stacking axis kept: no node to drop it): each part's sums
    weighted by ``exp((max - top) * scale)``, then the values' sum over the
    probabilities' sum. The top max is finite: the rank that stored the query's own key
    sees at least that one. ``scale``: a float32 scalar array."""
    maxima = partials[..., head_dim + 1:]
    top = maxima.max(axis=0, keepdims=True)
    weights = mx.exp((maxima - top) * scale)  # 0 for an empty shard
    sums = (weights * partials[..., :head_dim + 1]).sum(axis=0, keepdims=True)
    return sums[..., :head_dim] / sums[..., head_dim:]


def tile_ranges(positions: np.ndarray, size: int) -> list[tuple[int, int]]:
    """Index ranges of at most ``size`` entries, also cut where the positions jump by more
    than ``size``: tiles then stay compact in position space, so most (query, key) tile
    pairs are either entirely visible or entirely in the future. (Head-tail shards are two
    far-apart runs; decode tokens spread over ranks leave only small gaps.)"""
    cuts = np.flatnonzero(np.abs(np.diff(positions)) > size) + 1
    ranges = []
    for a, b in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(positions)]])):
        ranges.extend((int(i), int(min(i + size, b))) for i in range(a, b, size))
    return ranges


def _tile_pairs(tq: int, num_heads: int, q_pos: np.ndarray, k_pos: np.ndarray,
                window: int | None = None):
    """Per query tile (q0, q1): the key tiles (k0, k1, masked) it must see.

    Each (query tile, key tile) pair is classified from its position ranges (numpy: no
    device sync): entirely in the future, or with a ``window`` entirely behind it ->
    skipped; entirely visible -> no mask (``masked`` False); otherwise masked. Only tiles
    on the diagonal (and a window's far edge) pay for scores the mask throws away.
    """
    # Prefill: small square tiles, so diagonal tiles waste little. A short query block
    # (decode: one row) gets long key tiles instead.
    q_tile = min(tq, PREFILL_TILE)
    k_tile = PREFILL_TILE if tq > PREFILL_TILE // 4 else SCORE_TILE_ELEMENTS // (num_heads * tq)
    k_ranges = [(a, b, k_pos[a:b].min(), k_pos[a:b].max()) for a, b in tile_ranges(k_pos, k_tile)]
    reach = np.inf if window is None else window  # keys seen: q - reach < k <= q
    for q0, q1 in tile_ranges(q_pos, q_tile):
        q_min, q_max = q_pos[q0:q1].min(), q_pos[q0:q1].max()
        yield q0, q1, [(k0, k1, bool(k_max > q_min or k_min <= q_max - reach))
                       for k0, k1, k_min, k_max in k_ranges
                       if k_min <= q_max and k_max > q_min - reach]


def block_attention(q, k, v, q_pos: np.ndarray, k_pos: np.ndarray, scale: float,
                    window: int | None = None, native: bool = True):
    """Causal attention of queries at ``q_pos`` over keys at ``k_pos``, as (out, lse).

    Tiled (at most ``SCORE_TILE_ELEMENTS`` scores at once), in float32 whatever the
    inputs' dtype; tiles no query sees (in the future, or behind a ``window``) are
    skipped (``_tile_pairs``). ``native``: many queries on the CPU may take the C
    kernel (native_prefill.py), which evaluates the graph up to its inputs; False keeps
    MLX's tiles, inside the caller's graph.
    """
    num_heads, tq, d = q.shape
    q = q.astype(mx.float32)
    k = k.astype(mx.float32)
    v = v.astype(mx.float32)
    out = mx.zeros((num_heads, tq, d), mx.float32)
    lse = mx.full((num_heads, tq), NEG_INF, mx.float32)
    if tq == 0 or k.shape[1] == 0:
        return out, lse
    if (tq == 1 and q_pos[0] >= k_pos.max() and num_heads * k.shape[1] <= SCORE_TILE_ELEMENTS
            and (window is None or q_pos[0] - k_pos.min() < window)):
        return _decode_tile(q, k, v, scale)  # a decode query over a shard it sees whole
    if native and native_prefill.usable(q):  # on the CPU: the rank's threads (native_prefill.py)
        return native_prefill.native_attention(q, k, v, q_pos, k_pos, scale, window)
    q_parts = []
    for q0, q1, key_tiles in _tile_pairs(tq, num_heads, q_pos, k_pos, window):
        qp = q_pos[q0:q1]
        q_out, q_lse = out[:, q0:q1], lse[:, q0:q1]  # empty partial until a tile lands
        merged_any = False
        for k0, k1, masked in key_tiles:
            t_out, t_lse = _tile_attention(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1],
                                           qp if masked else None,
                                           k_pos[k0:k1] if masked else None, scale, window)
            if merged_any:
                q_out, q_lse = merge_partials(q_out, q_lse, t_out, t_lse)
            else:
                q_out, q_lse, merged_any = t_out, t_lse, True
        q_parts.append((q_out, q_lse))
    return _concatenate_rows(q_parts)


def window_start(k_pos: np.ndarray, query_position: int, window: int | None) -> int:
    """The index of the first of the keys ``k_pos`` (increasing, as a rank caches them) a
    query at ``query_position`` sees through ``window``: the keys before it are behind
    the window (0 without one)."""
    if window is None:
        return 0
    return int(np.searchsorted(k_pos, query_position - window + 1, side="left"))


def _concatenate_rows(q_parts):
    """Tiles follow q's index order, so concatenating them restores it."""
    if len(q_parts) == 1:
        return q_parts[0]
    return tuple(mx.concatenate([p[i] for p in q_parts], axis=1) for i in range(2))


def block_lse(q, k, q_pos: np.ndarray, k_pos: np.ndarray, scale: float) -> mx.array:
    """The log-sum-exp alone, (NH, Tq) float32: ``block_attention``'s lse without the
    value products, for a fused kernel's output that comes without one (fused.py).

    Scores are computed in float32 from the inputs (bfloat16 scores would round a score
    of 10 by up to 0.03, an error the merge weights would carry), tile by tile, so the
    float32 copy of the keys never exists whole. Where MLX runs float32 matmuls as TF32
    (MLX_ENABLE_TF32, on by default on GPUs that have it), half-precision inputs still
    give exact products: their mantissas fit TF32's 10 bits, and the sums stay float32.
    """
    num_heads, tq, d = q.shape
    if tq == 0 or k.shape[1] == 0:
        return mx.full((num_heads, tq), NEG_INF, mx.float32)
    num_kv = k.shape[0]
    groups = num_heads // num_kv
    q = q.astype(mx.float32) * scale
    parts = []
    for q0, q1, key_tiles in _tile_pairs(tq, num_heads, q_pos, k_pos):
        rows = groups * (q1 - q0)
        q_tile = q[:, q0:q1].reshape(num_kv, rows, d)
        tile_lses = []
        for k0, k1, masked in key_tiles:
            scores = q_tile @ k[:, k0:k1].astype(mx.float32).swapaxes(-1, -2)  # (NKV, rows, Tk)
            if masked:
                visible = mx.array(k_pos[k0:k1])[None, :] <= mx.array(q_pos[q0:q1])[:, None]
                scores = mx.where(visible, scores.reshape(num_kv, groups, q1 - q0, k1 - k0),
                                  NEG_INF).reshape(num_kv, rows, k1 - k0)
            tile_lses.append(mx.logsumexp(scores, axis=-1))
        if not tile_lses:  # every key is in these queries' future
            lse = mx.full((num_kv, rows), NEG_INF, mx.float32)
        elif len(tile_lses) == 1:
            lse = tile_lses[0]
        else:
            lse = mx.logsumexp(mx.stack(tile_lses), axis=0)
        parts.append(lse.reshape(num_heads, q1 - q0))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)


def lse_width(dtype: mx.Dtype) -> int:
    """Elements of ``dtype`` that carry one float32 lse inside a packed partial."""
    return max(4 // dtype.size, 1)


def partial_dtype(kv_dtype: mx.Dtype, fused: bool) -> mx.Dtype:
    """The dtype a partial output travels in: the precision it was computed to. The
    fused kernel's output is already rounded to the KV dtype (a wider message would
    carry nothing more); the tiled blocks' is float32 and stays so, since rounding it
    to a half-precision KV dtype before the merge would round it twice, where one rank
    rounds once."""
    return kv_dtype if fused else mx.float32


def pack_partial(out: mx.array, lse: mx.array, dtype: mx.Dtype) -> mx.array:
    """(NH, n, d) out and (NH, n) lse as one (NH, n, d + lse_width) message of ``dtype``.

    The output travels in ``dtype`` (``partial_dtype``: half precision for the fused
    kernel's partials on a GPU, else float32); the lse keeps
    all 32 bits, its float32 bit pattern viewed as ``dtype`` elements: a log-sum-exp of 10
    rounded to bfloat16 would be off by 0.03 and scale every weight of the merge by 3%.
    """
    lse = lse.astype(mx.float32)[..., None]
    lse = lse.view(dtype) if dtype.size < 4 else lse.astype(dtype)
    return mx.concatenate([out.astype(dtype), lse], axis=-1)


def unpack_partial(packed: mx.array, head_dim: int):
    """Inverse of ``pack_partial``: float32 (out, lse), ready for a float32 merge."""
    out, lse = packed[..., :head_dim], packed[..., head_dim:]
    if lse.shape[-1] > 1:
        lse = mx.contiguous(lse).view(mx.float32)
    return out.astype(mx.float32), lse[..., 0].astype(mx.float32)
