"""Batched decode's pure parts against numpy: the attention of B queries over a shared
prefix and each one's own tail (engine/decode/batched_decode.py), and the rows dealt to ranks.
The whole step over real ranks is tested end to end in tests/test_batch.py (answers
equal to one job at a time)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from spmd_cp.attention import merge_partials
from spmd_cp.engine.decode.batched_decode import RowSplit, prefix_attention, tail_attention

NH, NKV, D = 6, 2, 16


def reference(q, keys, values, scale):
    """Softmax attention of one query (NH, d) over keys (NKV, S, d), float64."""
    groups = NH // NKV
    out = np.zeros((NH, D))
    for h in range(NH):
        k, v = keys[h // groups], values[h // groups]
        scores = k @ q[h] * scale
        weights = np.exp(scores - scores.max())
        out[h] = weights @ v / weights.sum()
    return out


@pytest.mark.parametrize("window", [None, 40])
def test_prefix_and_tails_merge_to_each_querys_own_attention(window):
    """B = 3 queries over a 100-key prefix and their own tails (7, 0 and 3 keys, padded
    to 8 rows; the empty one sees the prefix alone), with and without a sliding window,
    equal numpy's attention over the prefix and that query's tail alone."""
    rng = np.random.default_rng(0)
    prefix_pos = np.arange(100)
    tail_lengths = [7, 0, 3]
    q_pos = np.array([100 + n for n in tail_lengths])
    q = rng.standard_normal((NH, 3, D)).astype(np.float32)
    prefix_k, prefix_v = (rng.standard_normal((NKV, 100, D)).astype(np.float32)
                          for _ in range(2))
    tail_k, tail_v = (rng.standard_normal((3, NKV, 8, D)).astype(np.float32) for _ in range(2))
    tail_pos = np.full((3, 8), np.iinfo(np.int64).max)
    for b, n in enumerate(tail_lengths):
        tail_pos[b, :n] = 100 + np.arange(n)
    seen = tail_pos <= q_pos[:, None]
    if window is not None:
        seen &= tail_pos > q_pos[:, None] - window
    mask = mx.array(np.where(seen, 0.0, -np.inf).astype(np.float32))
    scale = D ** -0.5
    out, lse = prefix_attention(mx.array(q), mx.array(prefix_k), mx.array(prefix_v), q_pos,
                                prefix_pos, scale, window)
    tail_out, tail_lse = tail_attention(mx.array(q), mx.array(tail_k), mx.array(tail_v), mask,
                                        scale)
    merged, _ = merge_partials(out, lse, tail_out, tail_lse)
    for b, n in enumerate(tail_lengths):
        keys = np.concatenate([prefix_k, tail_k[b][:, :n]], axis=1).astype(np.float64)
        values = np.concatenate([prefix_v, tail_v[b][:, :n]], axis=1).astype(np.float64)
        positions = np.concatenate([prefix_pos, tail_pos[b, :n]])
        if window is not None:
            inside = positions > q_pos[b] - window
            keys, values = keys[:, inside], values[:, inside]
        wanted = reference(q[:, b].astype(np.float64), keys, values, scale)
        np.testing.assert_allclose(np.array(merged[:, b]), wanted, rtol=2e-5, atol=2e-6)
    assert np.all(np.array(tail_lse[:, 1]) == -np.inf)  # the empty tail adds nothing


def test_rows_are_dealt_in_contiguous_runs_the_first_ranks_one_more():
    split = RowSplit.of(7, 3)
    assert split.counts == [3, 2, 2]
    assert [split.rows(r) for r in range(3)] == [slice(0, 3), slice(3, 5), slice(5, 7)]
    assert RowSplit.of(1, 2).counts == [1, 0]  # rank 0 always has a row
