"""Attention through MLX's fused kernel (``mx.fast.scaled_dot_product_attention``).

On a GPU (Metal or CUDA) the fused kernel never materialises the score matrix and keeps
the softmax in float32 whatever the inputs' dtype; it is what mlx-lm runs. It takes
either no mask, an explicit mask array, or ``"causal"``, which is *lower-right* aligned:
the last query row sees every key. So a contiguous run of query positions [a, b)
against keys at positions [0, b), in position order, needs no mask array: keys below a
are seen by every row, and the last b - a keys form the causal diagonal. Head-tail
shards are two such runs. That covers every prefill where all keys are present in
order: one rank, and the all-gather algorithm once the gathered K/V are put in position
order. No log-sum-exp is needed there.

The kernel returns no log-sum-exp, which the ring algorithms and multi-rank decode need
to merge partials. ``fused_partial`` pairs the fused output with ``block_lse``'s float32
log-sum-exp (the score products again, without the value products or a normaliser).
Where the positions do not have this shape (unsorted keys, a diagonal run with gaps),
every function here falls back to ``block_attention``: same result, tiled. So does a
sliding-window layer (``window``): "causal" has no window, and its mask array would be
as large as the scores the fused kernel avoids.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .block import NEG_INF, block_attention, block_lse


def _query_runs(q_pos: np.ndarray):
    """(row_start, row_stop, first_position, last_position) of each consecutive run."""
    if q_pos.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(q_pos) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [q_pos.size]])
    return [(int(a), int(b), int(q_pos[a]), int(q_pos[b - 1])) for a, b in zip(starts, stops)]


def causal_run_plan(q_pos: np.ndarray, k_pos: np.ndarray):
    """For each query run: (row_start, row_stop, key_stop, mask) with mask None or
    "causal" over keys [0, key_stop); None when the positions do not allow it.

    Needs keys in increasing position order; the keys inside a run's own position range
    must then be exactly that run (the lower-right causal diagonal), or absent.
    """
    if k_pos.size > 1 and not np.all(np.diff(k_pos) > 0):
        return None
    plan = []
    for row_start, row_stop, first, last in _query_runs(q_pos):
        key_stop = int(np.searchsorted(k_pos, last, side="right"))
        diagonal = k_pos[np.searchsorted(k_pos, first, side="left"):key_stop]
        if diagonal.size == 0:
            mask = None  # every visible key precedes the whole run
        elif diagonal.size == row_stop - row_start:  # sorted, unique, within [first, last]
            mask = "causal"
        else:
            return None
        plan.append((row_start, row_stop, key_stop, mask))
    return plan


def _run_attention(q, keys, values, key_stop: int, mask, scale: float):
    """One query run (NH, n, d) over keys [0, key_stop): the fused kernel's output."""
    if key_stop == 0:  # the run sees no key: contributes nothing
        return mx.zeros(q.shape, q.dtype)
    out = mx.fast.scaled_dot_product_attention(
        q[None], keys[None, :, :key_stop], values[None, :, :key_stop], scale=scale, mask=mask)
    return out.squeeze(0)  # a view; out[0] would be a Gather (engine/model.py)


def fused_output(q, keys, values, q_pos: np.ndarray, k_pos: np.ndarray, scale: float,
                 window: int | None = None):
    """Causal attention output (NH, Tq, d) in the inputs' dtype, no log-sum-exp."""
    plan = causal_run_plan(q_pos, k_pos) if window is None else None
    if plan is None:
        return block_attention(q, keys, values, q_pos, k_pos, scale,
                               window)[0].astype(q.dtype)
    return _planned_output(q, keys, values, plan, scale)


def _planned_output(q, keys, values, plan, scale: float):
    if not plan:
        return mx.zeros(q.shape, q.dtype)
    parts = [_run_attention(q[:, a:b], keys, values, stop, mask, scale)
             for a, b, stop, mask in plan]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)


def fused_partial(q, keys, values, q_pos: np.ndarray, k_pos: np.ndarray, scale: float,
                  window: int | None = None):
    """(out, lse) in float32, as ``block_attention`` returns them, for a merge.

    A row that sees no key gets out 0 and lse -inf (the fused kernel would average
    nothing into NaN, so such runs never reach it).
    """
    plan = causal_run_plan(q_pos, k_pos) if window is None else None
    if plan is None:
        return block_attention(q, keys, values, q_pos, k_pos, scale, window)
    out = _planned_output(q, keys, values, plan, scale).astype(mx.float32)
    lse = block_lse(q, keys, q_pos, k_pos, scale)
    return mx.where((lse == NEG_INF)[..., None], 0.0, out), lse


def in_position_order(keys, values, k_pos: np.ndarray):
    """Keys, values and positions sorted by position (a no-op when they already are)."""
    if k_pos.size < 2 or np.all(np.diff(k_pos) > 0):
        return keys, values, k_pos
    order = np.argsort(k_pos, kind="stable")
    index = mx.array(order.astype(np.int32))
    return mx.take(keys, index, axis=1), mx.take(values, index, axis=1), k_pos[order]


def decode_partial(q, keys, values, q_pos: np.ndarray, k_pos: np.ndarray, scale: float):
    """(out, lse) in float32 of decode queries that see every key of this shard (the
    newest position attends to all cached ones): the fused kernel without a mask."""
    if keys.shape[1] == 0:
        return (mx.zeros(q.shape, mx.float32),
                mx.full(q.shape[:2], NEG_INF, mx.float32))
    out = _run_attention(q, keys, values, keys.shape[1], None, scale)
    return out.astype(mx.float32), block_lse(q, keys, q_pos, k_pos, scale)
