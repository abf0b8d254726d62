"""The GPU path's math, run on the CPU stream: MLX's fused attention kernel as the
attention algorithms use it (attention/fused.py), the float32 log-sum-exp beside it,
half-precision partials on the wire, and the policy that selects the path.

References: a float64 dense softmax in numpy (test_math.dense_reference) and
block_attention, the CPU path's tiled attention.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from spmd_cp.attention.block import block_attention, block_lse, pack_partial, unpack_partial
from spmd_cp.attention.fused import (causal_run_plan, decode_partial, fused_output,
                                     fused_partial, in_position_order)
from spmd_cp.attention.partition import head_tail_positions
from test_math import dense_reference

SCALE = 0.3


def random_qkv(seed: int, tq: int, tk: int, heads=8, kv_heads=2, d=16, spread=2.0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(heads, tq, d)).astype(np.float32) * spread
    k = rng.normal(size=(kv_heads, tk, d)).astype(np.float32) * spread
    v = rng.normal(size=(kv_heads, tk, d)).astype(np.float32)
    return q, k, v


def test_fused_causal_mask_is_lower_right_aligned():
    """The premise of fused.py: mask="causal" lets the last query see every key."""
    q, k, v = random_qkv(0, tq=5, tk=12)
    out = mx.fast.scaled_dot_product_attention(mx.array(q)[None], mx.array(k)[None],
                                               mx.array(v)[None], scale=SCALE, mask="causal")
    ref, _ = dense_reference(q, k, v, np.arange(7, 12), np.arange(12), SCALE)
    np.testing.assert_allclose(np.array(out[0]), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cp_size,rank,cached", [(1, 0, 0), (2, 0, 0), (2, 1, 0), (3, 2, 17),
                                                  (4, 3, 40)])
def test_fused_output_of_head_tail_shards_over_all_keys(cp_size, rank, cached):
    """All-gather prefill: this rank's head-tail queries over every key, in position order."""
    total = cached + 45
    q_pos = head_tail_positions(45, cp_size, cached)[rank]
    q, k, v = random_qkv(1, q_pos.size, total)
    out = fused_output(mx.array(q), mx.array(k), mx.array(v), q_pos, np.arange(total), SCALE)
    ref, _ = dense_reference(q, k, v, q_pos, np.arange(total), SCALE)
    np.testing.assert_allclose(np.array(out), ref, rtol=1e-5, atol=1e-5)


def test_gathered_keys_are_put_in_position_order():
    shards = head_tail_positions(30, 3, 0)
    gathered = np.concatenate(shards)
    q, k, v = random_qkv(2, shards[1].size, 30)
    keys, values, positions = in_position_order(mx.array(k), mx.array(v), gathered)
    np.testing.assert_array_equal(positions, np.arange(30))
    out = fused_output(mx.array(q), keys, values, shards[1], positions, SCALE)
    ref, _ = dense_reference(q, k, v, shards[1], gathered, SCALE)
    np.testing.assert_allclose(np.array(out), ref, rtol=1e-5, atol=1e-5)


def _shard_cases():
    """(q_pos, k_pos) pairs the ring algorithms produce: a rank's queries against its own
    shard, against another rank's shard (cached prefix included), and cases without the
    fused shape (unsorted keys, a diagonal with gaps) that must fall back."""
    shards = head_tail_positions(40, 3, 12, [4, 4, 4])
    prefix = [np.arange(12)[r::3] for r in range(3)]
    cache = [np.concatenate([prefix[r], shards[r]]) for r in range(3)]
    yield shards[0], cache[0]
    yield shards[0], cache[2]
    yield shards[2], cache[1]
    yield np.arange(5, 9), np.array([0, 3, 1, 2])  # unsorted keys
    yield np.arange(5, 9), np.array([0, 5, 7, 8])  # a diagonal with a gap
    yield np.array([3, 4]), np.array([10, 11])  # every key in the future


@pytest.mark.parametrize("case", list(range(6)))
def test_fused_partial_equals_block_attention_and_dense(case):
    q_pos, k_pos = list(_shard_cases())[case]
    q, k, v = random_qkv(3 + case, q_pos.size, k_pos.size)
    out, lse = fused_partial(mx.array(q), mx.array(k), mx.array(v), q_pos, k_pos, SCALE)
    ref_out, ref_lse = dense_reference(q, k, v, q_pos, k_pos, SCALE)
    np.testing.assert_allclose(np.array(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(lse), ref_lse, rtol=1e-5, atol=1e-5)
    assert not np.isnan(np.array(out)).any()
    block_out, _ = block_attention(mx.array(q), mx.array(k), mx.array(v), q_pos, k_pos, SCALE)
    np.testing.assert_allclose(np.array(out), np.array(block_out), rtol=1e-5, atol=1e-5)


def test_plan_uses_the_fused_kernel_where_positions_allow_it():
    shards = head_tail_positions(40, 2, 0)
    plan = causal_run_plan(shards[0], np.arange(40))
    assert [(mask, stop) for *_, stop, mask in plan] == [("causal", 10), ("causal", 40)]
    # Another rank's shard (positions 10-29): the head run (0-9) sees none of it, the
    # tail run (30-39) all of it, neither needs a mask.
    plan = causal_run_plan(shards[0], shards[1])
    assert [(mask, stop) for *_, stop, mask in plan] == [(None, 0), (None, 20)]
    assert causal_run_plan(np.arange(5, 9), np.array([0, 5, 7, 8])) is None


def test_block_lse_with_many_tiles(monkeypatch):
    import spmd_cp.attention.block as block

    monkeypatch.setattr(block, "PREFILL_TILE", 16)
    rng = np.random.default_rng(4)
    q_pos = np.sort(rng.choice(np.arange(-5, 220), 150, replace=False))  # some see no key
    k_pos = np.arange(200)
    q, k, _ = random_qkv(4, 150, 200, spread=4.0)
    lse = block_lse(mx.array(q), mx.array(k), q_pos, k_pos, SCALE)
    _, ref = dense_reference(q, k, k, q_pos, k_pos, SCALE)
    np.testing.assert_allclose(np.array(lse), ref, rtol=1e-5, atol=1e-5)


def test_decode_partial_over_a_shard_and_an_empty_one():
    q, k, v = random_qkv(5, 1, 70, spread=3.0)
    k_pos = np.concatenate([np.arange(0, 35), np.arange(100, 135)])
    out, lse = decode_partial(mx.array(q), mx.array(k), mx.array(v), np.array([140]), k_pos,
                              SCALE)
    ref_out, ref_lse = dense_reference(q, k, v, np.array([140]), k_pos, SCALE)
    np.testing.assert_allclose(np.array(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(lse), ref_lse, rtol=1e-5, atol=1e-5)
    out, lse = decode_partial(mx.array(q), mx.array(k[:, :0]), mx.array(v[:, :0]),
                              np.array([140]), k_pos[:0], SCALE)
    assert np.isneginf(np.array(lse)).all() and not np.array(out).any()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_packed_partials_keep_the_lse_bit_exact(dtype):
    rng = np.random.default_rng(6)
    out = mx.array(rng.normal(size=(4, 3, 8)).astype(np.float32))
    lse = mx.array(rng.normal(size=(4, 3)).astype(np.float32) * 50)
    lse = mx.where(mx.arange(3)[None] == 1, float("-inf"), lse)  # an empty row
    packed = pack_partial(out, lse, dtype)
    assert packed.dtype == dtype
    got_out, got_lse = unpack_partial(packed, 8)
    np.testing.assert_array_equal(np.array(got_lse), np.array(lse))
    np.testing.assert_array_equal(np.array(got_out), np.array(out.astype(dtype).astype(mx.float32)))


def test_half_precision_partials_are_as_close_as_mlx_lm_attention():
    """bf16 inputs: the lse stays float32-exact; the output is no further from a float64
    reference than MLX's attention over the whole prompt, mlx-lm's call (on a GPU that
    kernel keeps its softmax in float32; on the CPU it computes in bf16)."""
    positions = np.arange(64)
    q_pos = head_tail_positions(64, 2, 0)[0]
    q, k, v = random_qkv(7, 64, 64, spread=3.0)
    q16, k16, v16 = (mx.array(x).astype(mx.bfloat16) for x in (q, k, v))
    rows = mx.array(q_pos.astype(np.int32))
    out, lse = fused_partial(q16[:, rows], k16, v16, q_pos, positions, SCALE)
    exact = [np.array(x.astype(mx.float32)) for x in (q16, k16, v16)]  # the rounded inputs
    ref_out, ref_lse = dense_reference(exact[0][:, q_pos], *exact[1:], q_pos, positions, SCALE)
    np.testing.assert_allclose(np.array(lse), ref_lse, rtol=1e-5, atol=1e-5)
    whole = mx.fast.scaled_dot_product_attention(q16[None], k16[None], v16[None], scale=SCALE,
                                                 mask="causal")[0][:, rows]
    mlx_lm_error = np.abs(np.array(whole.astype(mx.float32)) - ref_out).max()
    assert np.abs(np.array(out) - ref_out).max() <= mlx_lm_error + 2 ** -8


def test_policy_follows_the_backend_unless_overridden():
    from spmd_cp.errors import UserError
    from spmd_cp.runtime.device import BackendInfo, Compute, backend_name

    on_gpu = backend_name() != "cpu"  # (CI has no GPU)
    assert Compute.resolve() == Compute("gpu" if on_gpu else "cpu", on_gpu)
    assert Compute.resolve("gpu") == Compute("gpu", True)
    assert Compute.resolve("gpu", "tiled") == Compute("gpu", False)
    assert Compute.resolve("cpu", "fused") == Compute("cpu", True)
    with pytest.raises(UserError, match="'tpu'"):
        Compute.resolve("tpu")
    info = BackendInfo("cpu", "Device(cpu, 0)", "cpu").as_dict()
    assert info == {"backend": "cpu", "device": "Device(cpu, 0)", "compute_path": "cpu"}


def gathers(array: mx.array, tmp_path) -> int:
    """Gather nodes in the graph that computes ``array`` (MLX's ``x[0]`` is one)."""
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), array)
    return path.read_text().count('label ="Gather"')


def test_graph_path_heads_and_attention_are_views_not_gathers(tmp_path):
    """The GPU path's per-layer steps drop their axis of one as a view: no Gather (a copy,
    and on a GPU a kernel launch) in the heads after RoPE or in the fused attention's
    output, and the same bits as indexing [0] (mlx-lm's decode step has one Gather: the
    embedding's)."""
    from mlx_lm.models.rope_utils import initialize_rope

    from spmd_cp.attention.gather import single_rank_decode
    from spmd_cp.engine.model import heads_with_rope

    attn = type("Attention", (), {})()
    attn.n_heads, attn.n_kv_heads = 8, 2
    attn.rope = initialize_rope(16, base=10000.0, traditional=False, scaling_config=None,
                                max_position_embeddings=4096)
    rows = [mx.random.normal((1, 5, h * 16), key=mx.random.key(h)) for h in (8, 2, 2)]
    q, k, v = heads_with_rope(attn, *rows, [(0, 5, 40)])
    for got, row, heads in zip((q, k, v), rows, (8, 2, 2)):
        expected = row.reshape(1, 5, heads, 16).transpose(0, 2, 1, 3)
        if got is not v:
            expected = attn.rope(expected, offset=40)
        assert gathers(got, tmp_path) == 0
        np.testing.assert_array_equal(np.array(got), np.array(expected[0]))
    keys, values = (mx.random.normal((2, 30, 16), key=mx.random.key(s)) for s in (7, 8))
    query = mx.random.normal((8, 1, 16), key=mx.random.key(9))
    out = single_rank_decode(query, keys, values, np.array([30]), np.arange(30), SCALE, True)
    assert gathers(out, tmp_path) == 0
    expected = mx.fast.scaled_dot_product_attention(query[None], keys[None], values[None],
                                                     scale=SCALE)[0]
    np.testing.assert_array_equal(np.array(out), np.array(expected))
    prefill = fused_output(*(mx.array(x) for x in random_qkv(3, 12, 12)), np.arange(12),
                           np.arange(12), SCALE)
    assert gathers(prefill, tmp_path) == 0


def test_tiled_partials_of_a_half_precision_cache_cross_ranks_in_float32(tmp_path):
    """Three ranks, bf16 K/V, the tiled float32 blocks: pass-Q's returned partials and the
    decode merge's gathered ones travel in float32 (block.partial_dtype), so every
    output is a float32 computation of the bf16 inputs, within float32 rounding of a
    float64 reference (rounded to bf16 on the wire, they were up to 2^-9 off: a second
    rounding one rank never makes). pass-KV, which merges locally, is the control."""
    import sys
    from pathlib import Path

    from conftest import run_ranks

    tests = Path(__file__).resolve().parent
    out = tmp_path / "partials.npz"
    run_ranks(3, [sys.executable, str(tests / "partials_driver.py"), "bfloat16", str(out)],
              timeout=120)
    got = np.load(out)
    q, k, v = got["q"], got["k"], got["v"]
    tokens = q.shape[1] - 1
    all_pos = np.arange(tokens)
    for rank in range(3):
        rows = got[f"positions_{rank}"]
        ref, _ = dense_reference(q[:, rows], k[:, :tokens], v[:, :tokens], rows, all_pos,
                                 0.25)
        for algo in ("pass-kv", "pass-q"):
            np.testing.assert_allclose(got[f"{algo}_{rank}"], ref, rtol=2e-6, atol=5e-6,
                                       err_msg=f"{algo} rank {rank}")
        ref, _ = dense_reference(q[:, tokens:], k[:, :tokens], v[:, :tokens],
                                 np.array([tokens]), all_pos, 0.25)
        for path in ("cpu", "gpu"):
            np.testing.assert_allclose(got[f"decode-{path}_{rank}"], ref, rtol=2e-6, atol=5e-6,
                                       err_msg=f"decode ({path} path) rank {rank}")
