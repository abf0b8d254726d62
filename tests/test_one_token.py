"""One-token forms of the CPU path (engine/decode/one_token.py, the compiled decode merge): the
same bits as the modules and functions they stand in for, which are mlx-lm's and MLX's
own (and a numpy merge for the merge)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import initialize_rope

from spmd_cp.attention.block import (block_attention, decode_partial_packed, merge_stacked,
                                     pack_partial)
from spmd_cp.attention.gather import _merge_float32, _merge_sums
from spmd_cp.engine.model import _one_token_heads, heads_to_rows
from spmd_cp.engine.decode.one_token import EXACT_AS_MATRIX, RopeMatrices, rms_norm, rotation_matrix
from spmd_cp.engine.weights.weight_slices import WeightMatrix, times_transposed

ROPES = {
    "plain": dict(dims=64, base=100000.0, traditional=False, scaling_config=None),
    "traditional": dict(dims=64, base=10000.0, traditional=True, scaling_config=None),
    "partial": dict(dims=32, base=10000.0, traditional=False, scaling_config=None),
    "linear": dict(dims=64, base=10000.0, traditional=False,
                   scaling_config={"type": "linear", "factor": 2.0}),
    "llama3": dict(dims=64, base=500000.0, traditional=False,
                   scaling_config={"rope_type": "llama3", "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}),
    "yarn": dict(dims=64, base=10000.0, traditional=False,
                 scaling_config={"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 4096}),
}


def make_rope(name: str) -> nn.Module:
    return initialize_rope(**ROPES[name], max_position_embeddings=131072)


@pytest.mark.parametrize("name", [n for n in ROPES if n != "yarn"])
def test_rope_matrix_rotates_one_token_as_the_module_bit_for_bit(name):
    rope = make_rope(name)
    assert isinstance(rope, EXACT_AS_MATRIX)
    heads = mx.random.normal((1, 9, 1, 64), key=mx.random.key(3)) * 4
    for position in (0, 1, 4095, 100_000):
        expected = np.array(rope(heads, offset=position))
        got = np.array(heads @ rotation_matrix(rope, 64, position))
        np.testing.assert_array_equal(got, expected, err_msg=f"{name} at {position}")


def test_rope_matrices_are_shared_by_alike_layers_and_left_to_the_rest():
    """Layers built alike share one matrix per step; another base gets its own; YaRN
    (it scales x before rotating: a matrix is 1 ulp off) keeps its module (None)."""
    ropes = [make_rope("plain"), make_rope("plain"), make_rope("traditional"),
             make_rope("yarn"), make_rope("plain")]
    matrix = RopeMatrices().at(ropes, 3000)
    built = [matrix(i, 64) for i in range(len(ropes))]
    assert built[0] is built[1] is built[4]
    assert built[2] is not built[0] and built[3] is None
    heads = mx.random.normal((1, 9, 1, 64), key=mx.random.key(4))
    for rope, rotation in zip(ropes[:3], built[:3]):
        np.testing.assert_array_equal(np.array(heads @ rotation),
                                      np.array(rope(heads, offset=3000)))


def test_rope_matrix_blocks_equal_one_position_at_a_time_bit_for_bit():
    """RopeMatrices.block (the native decode step's: 64 positions in one module call)
    gives each position the matrix rotation_matrix builds alone, for every RoPE with a
    matrix form; layers that rotate alike share one block, YaRN gets None."""
    names = [n for n in ROPES if n != "yarn"]
    ropes = [make_rope(n) for n in names] + [make_rope("plain"), make_rope("yarn")]
    blocks = RopeMatrices().block(ropes, 64, 4090, 8)
    assert blocks[len(names)] is blocks[0] and blocks[-1] is None
    for name, rope, block in zip(names, ropes, blocks):
        assert block.shape == (8, 64, 64)
        for i in (0, 5, 7):
            np.testing.assert_array_equal(np.array(block[i]),
                                          np.array(rotation_matrix(rope, 64, 4090 + i)),
                                          err_msg=f"{name} at {4090 + i}")


def test_compiled_rms_norm_is_the_module_bit_for_bit():
    norm = nn.RMSNorm(576, eps=1e-5)
    norm.weight = mx.random.normal((576,), key=mx.random.key(5))
    for scale in (1e-3, 1.0, 1e3):
        x = mx.random.normal((1, 1, 576), key=mx.random.key(int(scale * 1000))) * scale
        np.testing.assert_array_equal(np.array(rms_norm(norm, x)), np.array(norm(x)))


def numpy_merge(outs: np.ndarray, lses: np.ndarray) -> np.ndarray:
    """Softmax-weighted merge of partials in float64, empty partials (lse -inf) ignored."""
    lses = lses.astype(np.float64)
    top = np.max(np.where(np.isfinite(lses), lses, -np.inf), axis=0)
    weights = np.where(np.isfinite(lses), np.exp(lses - top), 0.0)
    return (weights[..., None] * outs).sum(axis=0) / weights.sum(axis=0)[..., None]


def test_compiled_decode_merge_equals_the_uncompiled_one_and_numpy():
    """Three ranks' partials (one rank's shard empty: lse -inf, output 0)."""
    key = mx.random.key(6)
    outs = mx.random.normal((3, 9, 1, 64), key=key)
    lses = mx.random.normal((3, 9, 1), key=mx.random.key(7)) * 8
    outs = mx.concatenate([outs[:2], mx.zeros((1, 9, 1, 64))])
    lses = mx.concatenate([lses[:2], mx.full((1, 9, 1), -mx.inf)])
    packed = mx.stack([pack_partial(outs[r], lses[r], mx.float32) for r in range(3)])
    got = _merge_float32(packed, 64)  # the stacking axis kept: (1, NH, 1, d)
    assert got.shape == (1, 9, 1, 64)
    got = got[0]
    np.testing.assert_array_equal(np.array(got), np.array(merge_stacked(outs, lses)[0]))
    np.testing.assert_allclose(np.array(got), numpy_merge(np.array(outs), np.array(lses)),
                               rtol=2e-6, atol=1e-6)


def numpy_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float):
    """One query row (NH, 1, d) over grouped keys and values (NKV, T, d), float64."""
    num_heads, _, d = q.shape
    grouped = q.astype(np.float64).reshape(keys.shape[0], -1, d)
    scores = np.einsum("hgd,htd->hgt", grouped, keys.astype(np.float64)) * scale
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    out = weights @ values.astype(np.float64) / weights.sum(axis=-1, keepdims=True)
    return out.reshape(num_heads, 1, d)


def test_unnormalized_decode_partials_merge_to_numpy_attention():
    """The CPU path's decode partials (sums not yet divided, the max score beside them)
    of three shards, one empty, merged: numpy's attention over all the keys; and one
    shard alone through block_attention's decode tile, the same rows."""
    rng = np.random.default_rng(8)
    q = rng.standard_normal((9, 1, 64)).astype(np.float32)
    shards = [rng.standard_normal((2, 3, length, 64)).astype(np.float32) * 2
              for length in (700, 0, 1300)]
    scale = 64 ** -0.5
    packed = [decode_partial_packed(mx.array(q), mx.array(k), mx.array(v), scale)
              for k, v in shards]
    assert packed[1].shape == (3, 3, 66)
    merged = _merge_sums(mx.stack(packed), 64, mx.array(scale, mx.float32))
    keys = np.concatenate([k for k, _ in shards], axis=1)
    values = np.concatenate([v for _, v in shards], axis=1)
    want = numpy_attention(q, keys, values, scale)
    np.testing.assert_allclose(np.array(merged).reshape(9, 1, 64), want, rtol=2e-5, atol=2e-6)
    out, lse = block_attention(mx.array(q), mx.array(keys), mx.array(values), np.array([2000]),
                               np.arange(2000), scale)
    np.testing.assert_allclose(np.array(out), want, rtol=2e-5, atol=2e-6)
    scores = np.einsum("hgd,htd->hgt", q.astype(np.float64).reshape(3, 3, 64), keys) * scale
    top = scores.max(axis=-1)
    want_lse = (np.log(np.exp(scores - top[..., None]).sum(axis=-1)) + top).reshape(9, 1)
    np.testing.assert_allclose(np.array(lse), want_lse, rtol=1e-6, atol=1e-5)


def test_row_form_products_equal_the_folded_ones_bit_for_bit_and_numpy():
    """A (1, D) row times a weight's transposed view (one graph node) against the same
    row as (1, 1, D) run as W @ x with reshapes (three), and numpy in float64: plain
    weights as the replicated and the split steps hold them, a row slice (a view) too."""
    weight = mx.random.normal((1536, 576), key=mx.random.key(8))
    row = mx.random.normal((1, 576), key=mx.random.key(9))
    for matrix in (WeightMatrix(weight), WeightMatrix(weight).rows(512, 1024)):
        got = matrix(row)
        folded = times_transposed(row.reshape(1, 1, 576), matrix.weight)
        assert got.shape == (1, matrix.out_width) and folded.shape == (1, 1, matrix.out_width)
        np.testing.assert_array_equal(np.array(got), np.array(folded)[0])
        reference = np.array(row, np.float64) @ np.array(matrix.weight, np.float64).T
        np.testing.assert_allclose(np.array(got), reference, rtol=1e-4, atol=1e-4)


def test_row_form_heads_rotate_as_the_module_bit_for_bit():
    """``_one_token_heads`` on (1, H*d) rows: the rotation multiplies (H, d) heads; the
    result is the module's RoPE of (H, 1, d) heads, and v is only reshaped."""
    rope = make_rope("plain")
    attn = nn.Module()
    attn.n_heads, attn.n_kv_heads, attn.rope = 9, 3, rope
    q, k, v = (mx.random.normal((1, h * 64), key=mx.random.key(10 + h)) for h in (9, 3, 3))
    rotation = rotation_matrix(rope, 64, 777)
    got = _one_token_heads(attn, q, k, v, [(0, 1, 777)], rotation, 64)
    for heads, row, count in zip(got, (q, k), (9, 3)):
        expected = rope(row.reshape(1, count, 1, 64), offset=777)[0]
        assert heads.shape == (count, 1, 64)
        np.testing.assert_array_equal(np.array(heads), np.array(expected))
    np.testing.assert_array_equal(np.array(got[2]), np.array(v).reshape(3, 1, 64))
    assert heads_to_rows(got[0], row_form=True).shape == (1, 9 * 64)
