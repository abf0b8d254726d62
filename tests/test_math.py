"""Pure pieces, tested in one process against numpy: partition, block attention, merge."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from spmd_cp.attention.block import block_attention, merge_partials, merge_stacked
from spmd_cp.attention.choose import LinkAndCompute, choose_prefill_algo
from spmd_cp.engine.model import contiguous_runs
from spmd_cp.attention.partition import head_tail_positions, least_loaded_rank, owner_of


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("length", [0, 1, 2, 3, 7, 8, 9, 31, 100])
def test_head_tail_covers_every_position_once_and_balances(n, length):
    parts = head_tail_positions(length, n, start=10)
    joined = np.sort(np.concatenate(parts))
    assert joined.tolist() == list(range(10, 10 + length))
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= 1
    for p in parts:
        assert np.all(np.diff(p) > 0)
    if length >= 2 * n and n > 1:
        # Rank i holds chunks i and 2N-1-i, so causal work (keys seen, summed over its
        # queries) is even up to the remainder tokens: a spread of O(T), where a plain
        # contiguous split would spread by about T^2 / N.
        work = [int(np.sum(p - 10 + 1)) for p in parts]
        assert max(work) - min(work) <= 2 * length


def test_head_tail_layout_for_eight_tokens_on_two_ranks():
    parts = head_tail_positions(8, 2)
    assert parts[0].tolist() == [0, 1, 6, 7]
    assert parts[1].tolist() == [2, 3, 4, 5]


def test_extra_tokens_go_to_least_loaded_ranks():
    parts = head_tail_positions(1, 3, shard_sizes=[5, 4, 5])
    assert [p.size for p in parts] == [0, 1, 0]
    assert least_loaded_rank([5, 4, 4]) == 1
    assert owner_of(0, parts) == 1


def test_contiguous_runs():
    assert contiguous_runs(np.array([0, 1, 2, 7, 8])) == [(0, 3, 0), (3, 5, 7)]
    assert contiguous_runs(np.array([], np.int64)) == []


def dense_reference(q, k, v, q_pos, k_pos, scale):
    """Softmax attention with numpy in float64: (out, lse)."""
    nh, nkv = q.shape[0], k.shape[0]
    k = np.repeat(k, nh // nkv, axis=0).astype(np.float64)
    v = np.repeat(v, nh // nkv, axis=0).astype(np.float64)
    s = np.einsum("hqd,hkd->hqk", q.astype(np.float64), k) * scale
    s = np.where(k_pos[None, None, :] <= q_pos[None, :, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    denom = p.sum(-1, keepdims=True)
    out = np.einsum("hqk,hkd->hqd", p, v) / np.where(denom > 0, denom, 1)
    with np.errstate(divide="ignore"):
        lse = np.log(denom[..., 0]) + m[..., 0]
    return out, lse


@pytest.mark.parametrize("tile", [None, 16])
def test_block_attention_matches_dense_softmax(tile, monkeypatch):
    import spmd_cp.attention.block as block

    if tile:  # many tiles: skipped, unmasked and masked ones, merged along each row
        monkeypatch.setattr(block, "PREFILL_TILE", tile)
    rng = np.random.default_rng(0)
    q = rng.normal(size=(8, 150, 16)).astype(np.float32)
    k = rng.normal(size=(2, 200, 16)).astype(np.float32)
    v = rng.normal(size=(2, 200, 16)).astype(np.float32)
    q_pos = np.sort(rng.choice(np.arange(-5, 220), 150, replace=False))  # some see no key
    k_pos = rng.permutation(200)
    out, lse = block_attention(mx.array(q), mx.array(k), mx.array(v), q_pos, k_pos, 0.3)
    ref_out, ref_lse = dense_reference(q, k, v, q_pos, k_pos, 0.3)
    np.testing.assert_allclose(np.array(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(lse), ref_lse, rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.array(lse)[:, q_pos < 0]).all()
    assert not np.isnan(np.array(out)).any()


def test_tiles_follow_position_runs():
    from spmd_cp.attention.block import tile_ranges

    positions = np.concatenate([np.arange(0, 10), np.arange(90, 100)])  # head + tail
    assert tile_ranges(positions, 4) == [(0, 4), (4, 8), (8, 10), (10, 14), (14, 18), (18, 20)]
    spread = np.arange(0, 40, 3)  # decode tokens interleaved over ranks: small gaps
    assert tile_ranges(spread, 8) == [(0, 8), (8, 14)]


def test_decode_row_against_head_tail_keys_matches_dense():
    rng = np.random.default_rng(2)
    q = rng.normal(size=(4, 1, 8)).astype(np.float32)
    k = rng.normal(size=(2, 50, 8)).astype(np.float32)
    k_pos = np.concatenate([np.arange(0, 25), np.arange(75, 100)])
    out, lse = block_attention(mx.array(q), mx.array(k), mx.array(k), np.array([100]), k_pos, 0.5)
    ref_out, ref_lse = dense_reference(q, k, k, np.array([100]), k_pos, 0.5)
    np.testing.assert_allclose(np.array(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(lse), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra_keys", [-40, 0, 1, 2000])  # MLX's fused kernel, then the tile
def test_single_rank_decode_attention_matches_dense_on_both_sides_of_the_fused_cutoff(extra_keys):
    from mpi4py import MPI

    from spmd_cp.attention.gather import decode_attention, fused_decode_max_keys
    from spmd_cp.runtime.comm import Comm

    num_keys = fused_decode_max_keys(6) + extra_keys
    rng = np.random.default_rng(3)
    q = rng.normal(size=(6, 1, 16)).astype(np.float32) * 3
    k = rng.normal(size=(2, num_keys, 16)).astype(np.float32) * 3
    v = rng.normal(size=(2, num_keys, 16)).astype(np.float32)
    k_pos = np.arange(num_keys)
    attend = decode_attention(Comm(MPI.COMM_SELF))
    out = attend(mx.array(q), mx.array(k), mx.array(v), np.array([num_keys - 1]), k_pos, 0.25)
    ref_out, _ = dense_reference(q, k, v, np.array([num_keys - 1]), k_pos, 0.25)
    np.testing.assert_allclose(np.array(out), ref_out, rtol=1e-5, atol=1e-5)


def test_merging_partials_over_disjoint_keys_equals_attention_over_all():
    rng = np.random.default_rng(1)
    q = rng.normal(size=(4, 30, 8)).astype(np.float32) * 30  # extreme scores
    k = rng.normal(size=(2, 60, 8)).astype(np.float32) * 30
    v = rng.normal(size=(2, 60, 8)).astype(np.float32)
    q_pos = np.arange(30) * 2
    k_pos = np.arange(60)
    parts = [block_attention(mx.array(q), mx.array(k[:, s]), mx.array(v[:, s]), q_pos,
                             k_pos[s], 1.0) for s in (slice(0, 20), slice(20, 45), slice(45, 60))]
    out, lse = merge_partials(*parts[0], *parts[1])
    out, lse = merge_partials(out, lse, *parts[2])
    stacked_out, stacked_lse = merge_stacked(mx.stack([p[0] for p in parts]),
                                             mx.stack([p[1] for p in parts]))
    ref_out, ref_lse = dense_reference(q, k, v, q_pos, k_pos, 1.0)
    for o, l in ((out, lse), (stacked_out, stacked_lse)):
        np.testing.assert_allclose(np.array(o), ref_out, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.array(l), ref_lse, rtol=1e-5, atol=1e-3)


def test_merge_of_empty_partials_is_empty_not_nan():
    empty_out = mx.zeros((2, 3, 4))
    empty_lse = mx.full((2, 3), float("-inf"))
    out, lse = merge_partials(empty_out, empty_lse, empty_out, empty_lse)
    assert np.isneginf(np.array(lse)).all() and not np.isnan(np.array(out)).any()
    full_out = mx.ones((2, 3, 4))
    out, lse = merge_partials(empty_out, empty_lse, full_out, mx.zeros((2, 3)))
    np.testing.assert_array_equal(np.array(out), 1.0)
    out, lse = merge_stacked(mx.stack([empty_out, empty_out]), mx.stack([empty_lse, empty_lse]))
    assert np.isneginf(np.array(lse)).all() and not np.isnan(np.array(out)).any()


def test_auto_choice_follows_algorithm_1():
    fast_link = LinkAndCompute(attention_flops=1e10, ring_bytes_per_s=1e10)
    # Full prefill: new share 1 >= 2*3/9 -> pass-kv.
    assert choose_prefill_algo(4096, 0, 4, 9, 3, 4, fast_link)[0] == "pass-kv"
    # 256 new on 4K cached: share 0.06 < 0.67; T=256 < N*C*NKV*e/(2*NH*BW)=26.7? no:
    # with this link the threshold is 4*1e10*3*4/(2*9*1e10) = 2.7 tokens -> pass-kv.
    assert choose_prefill_algo(256, 4096, 4, 9, 3, 4, fast_link)[0] == "pass-kv"
    slow_link = LinkAndCompute(attention_flops=1e11, ring_bytes_per_s=1e8)
    algo, reason = choose_prefill_algo(256, 4096, 4, 9, 3, 4, slow_link)
    assert algo == "pass-q" and "T/(T+P)" in reason
    assert choose_prefill_algo(5, 0, 1, 9, 3, 4, None)[0] == "pass-kv"
