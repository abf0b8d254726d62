"""Attention's exp and the MLPs' SiLU on the x86 CPU (attention/exp.py) against numpy's
float64, and the tiled attention that uses them against a dense float64 softmax."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from spmd_cp.attention import exp as exp_module
from spmd_cp.attention.block import PREFILL_TILE, block_attention
from spmd_cp.attention.exp import LOWEST, polynomial_exp, softmax_exp

from conftest import run_cli
from test_math import dense_reference

VARIANTS = {  # the compiled kernels, and the same ops one by one
    "compiled": lambda x: polynomial_exp(x),
    "uncompiled": lambda x: polynomial_exp(x, compiled=False),
}


def ulps_from_float64(got: np.ndarray, x: np.ndarray) -> np.ndarray:
    exact = np.exp(x.astype(np.float64))
    return np.abs(got.astype(np.float64) - exact) / np.spacing(exact.astype(np.float32))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_polynomial_exp_is_within_two_ulp_where_the_result_is_normal(variant):
    rng = np.random.default_rng(0)
    x = np.concatenate([
        np.linspace(-87.3, 88.0, 1_000_001, dtype=np.float32),  # the whole normal range
        rng.uniform(-20, 0, 500_000).astype(np.float32),  # softmax's usual arguments
        np.float32([0.0, -0.0, 1e-30, -1e-30, 0.5 * np.log(2), -0.5 * np.log(2)]),
        np.nextafter(np.float32(0.5 * np.log(2)), np.float32(0)) * np.float32([1, -1]),
    ])
    got = np.array(VARIANTS[variant](mx.array(x)))
    assert ulps_from_float64(got, x).max() <= 2.0
    assert got[np.isin(x, [0.0])].tolist() == [1.0, 1.0]  # exp(0) exactly 1


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_polynomial_exp_at_the_ends_of_its_range(variant):
    x = np.float32([-np.inf, -1e30, -100.0, LOWEST, -87.9, -87.5, -87.34, np.nan])
    got = np.array(VARIANTS[variant](mx.array(x)))
    assert got[:4].tolist() == [0.0] * 4  # masked scores (-inf) weigh exactly nothing
    tiny = got[4:7]  # subnormal results: an approximation, absolute error below 2^-126
    assert (tiny >= 0).all()
    assert np.abs(tiny - np.exp(x[4:7].astype(np.float64))).max() < 2.0 ** -126
    assert np.isnan(got[7])


def test_compiled_kernels_compute_the_ops_arithmetic_bit_for_bit():
    # Same ops, same order, no contraction into FMAs, whatever the shape (ranks that cut
    # tiles differently must still agree), also with the maxima subtracted inside.
    rng = np.random.default_rng(1)
    for shape in [(3, 512, 256), (3, 1501, 3), (70, 130)]:
        scores = mx.array(rng.uniform(-90, 5, shape).astype(np.float32))
        reference = np.array(polynomial_exp(scores, compiled=False))
        np.testing.assert_array_equal(np.array(polynomial_exp(scores)), reference)
        maxima = scores.max(axis=-1, keepdims=True)
        np.testing.assert_array_equal(np.array(softmax_exp(scores, maxima)),
                                      np.array(polynomial_exp(scores - maxima, compiled=False)))
        scaled = (scores - maxima) * mx.array(0.125 / 3, mx.float32)  # decode: scale inside
        np.testing.assert_array_equal(np.array(softmax_exp(scores, maxima, 0.125 / 3)),
                                      np.array(polynomial_exp(scaled, compiled=False)))


def test_scaled_softmax_exp_of_a_short_row_is_mlx_exp_bit_for_bit():
    # Below SOFTMAX_MIN_ELEMENTS the scaled form is MLX's exp in one compiled node.
    scores = mx.array(np.random.default_rng(2).uniform(-30, 5, (3, 3, 200)).astype(np.float32))
    maxima = scores.max(axis=-1, keepdims=True)
    scale = mx.array(0.088388, mx.float32)
    np.testing.assert_array_equal(np.array(softmax_exp(scores, maxima, 0.088388)),
                                  np.array(mx.exp((scores - maxima) * scale)))


def test_compiled_functions_are_kept_for_the_last_shapes_only():
    # Decode's rows grow by a key every step: a compiled function per shape seen would
    # keep growing.
    doubled = exp_module.PerShape(lambda x: x * 2.0, capacity=4)
    for keys in range(1, 11):
        x = mx.arange(keys, dtype=mx.float32)
        assert np.array(doubled(x)).tolist() == [2.0 * i for i in range(keys)]
    assert [key[0][0] for key in doubled.compiled] == [(7,), (8,), (9,), (10,)]
    doubled(mx.zeros(8))  # used again: now the most recent
    assert [key[0][0] for key in doubled.compiled] == [(7,), (9,), (10,), (8,)]


def test_swiglu_matches_float64_and_keeps_mlx_lm_for_small_inputs():
    rng = np.random.default_rng(4)
    gate = (rng.normal(size=(40, 1536)) * 4).astype(np.float32)
    gate[0, :8] = [-100.0, -88.0, -20.0, -0.0, 0.0, 1e-30, 20.0, 100.0]
    up = rng.normal(size=(40, 1536)).astype(np.float32)
    got = np.array(exp_module.swiglu(mx.array(gate), mx.array(up)))
    g, u = gate.astype(np.float64), up.astype(np.float64)
    exact = g / (1 + np.exp(-g)) * u
    # Within 4 ulp of float64's value, or below 1e-30. (mlx-lm's sigmoid, kept where
    # MLX cannot compile: up to 14 ulp here.)
    ulps = 4 if exp_module.polynomial_exp_enabled() else 16
    assert (np.abs(got - exact) <= ulps * np.spacing(np.abs(exact).astype(np.float32))
            + 1e-30).all()
    small_gate, small_up = mx.array(gate[:1, :64]), mx.array(up[:1, :64])
    np.testing.assert_array_equal(np.array(exp_module.swiglu(small_gate, small_up)),
                                  np.array(exp_module.mlx_lm_swiglu(small_gate, small_up)))


def test_tiled_prefill_with_full_edge_and_masked_tiles_matches_a_dense_softmax():
    # 600 queries over 700 keys: full 256 x 256 tiles (compiled per shape), edge tiles
    # (any shape), causal diagonals with -inf scores, and rows that see no key.
    rng = np.random.default_rng(2)
    q = rng.normal(size=(9, 600, 64)).astype(np.float32) * 2
    k = rng.normal(size=(3, 700, 64)).astype(np.float32) * 2
    v = rng.normal(size=(3, 700, 64)).astype(np.float32)
    q_pos = np.arange(600) + 95  # queries 95..694; keys 0..699: some keys in the future
    q_pos[:3] = [-3, -2, -1]  # these see nothing
    k_pos = np.arange(700)
    assert 600 > 2 * PREFILL_TILE
    out, lse = block_attention(mx.array(q), mx.array(k), mx.array(v), q_pos, k_pos, 0.125)
    ref_out, ref_lse = dense_reference(q, k, v, q_pos, k_pos, 0.125)
    np.testing.assert_allclose(np.array(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(lse), ref_lse, rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.array(lse)[:, :3]).all() and (np.array(out)[:, :3] == 0).all()


def test_decode_row_over_many_keys_matches_a_dense_softmax():
    rng = np.random.default_rng(3)
    keys = 3 * exp_module.MIN_ELEMENTS // 9 + 17  # scores above the polynomial's threshold
    q = rng.normal(size=(9, 1, 64)).astype(np.float32) * 3
    k = rng.normal(size=(3, keys, 64)).astype(np.float32) * 3
    v = rng.normal(size=(3, keys, 64)).astype(np.float32)
    k_pos = np.arange(keys)
    out, lse = block_attention(mx.array(q), mx.array(k), mx.array(v), np.array([keys]), k_pos,
                               0.125)
    ref_out, ref_lse = dense_reference(q, k, v, np.array([keys]), k_pos, 0.125)
    np.testing.assert_allclose(np.array(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(lse), ref_lse, rtol=1e-5, atol=1e-5)


def _enabled_in_child(env_changes: dict, wanted: bool = True) -> str:
    """``polynomial_exp_enabled()`` in a fresh process with the environment changed, after
    ``use_polynomial_exp(wanted)`` (what ``--fast-exp`` / ``--no-fast-exp`` call)."""
    env = {**os.environ, **env_changes}
    code = ("from spmd_cp.attention.exp import polynomial_exp_enabled as e, "
            f"use_polynomial_exp as u; u({wanted}); print(e())")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("g++") is None or os.uname().machine != "x86_64",
                    reason="the polynomial is for x86 CPUs where MLX's compiler (g++) exists")
def test_polynomial_is_used_here_unless_opted_out_or_mlx_cannot_compile(tmp_path):
    assert _enabled_in_child({}) == "True"
    assert _enabled_in_child({}, wanted=False) == "False"  # --no-fast-exp
    # Without g++ MLX runs compiled functions op by op: MLX's exp is kept.
    python_dir = tmp_path / "bin"
    python_dir.mkdir()
    assert _enabled_in_child({"PATH": str(python_dir)}) == "False"


def test_generate_where_mlx_cannot_write_its_kernels_gives_the_same_tokens(embedded_model,
                                                                            tmp_path):
    # MLX writes the kernels it compiles under $TMPDIR/mlx and raises where it cannot;
    # compilation is then turned off, and every compiled form (this exp and SiLU, the
    # RMSNorm, the decode merge at N = 2, mlx-lm's sampler) runs its ops one by one. A
    # prompt long enough for the polynomial's sizes; greedy, and sampled at a temperature.
    prompt = ["generate", "--prompt", "Tell me a long story about a dragon who guards a "
              "castle on a hill, with many characters, places and a surprising ending.",
              "--max-tokens", "6", "--json"]
    env = {}  # the shared cache (its float32 weights and C helpers; MLX's kernels: TMPDIR)
    normal = run_cli(2, prompt, env=env).last_json()["token_ids"]
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    unwritable = run_cli(2, prompt, env={**env, "TMPDIR": str(not_a_directory)})
    assert unwritable.last_json()["token_ids"] == normal
    sampled = run_cli(2, prompt + ["--temp", "0.8", "--seed", "3"],
                      env={**env, "TMPDIR": str(not_a_directory)}).last_json()
    assert len(sampled["token_ids"]) == 6
