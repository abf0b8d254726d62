"""Prefill attention's tiles in C (attention/native_prefill.py, kernels/prefill_attention.h)
against float64 numpy and MLX's tiles; the CLI's exactness tests run every CP algorithm
through it wherever the library is built (the spmd-cp entry point re-execs onto a BLAS)."""

from __future__ import annotations

import pytest

from conftest import TESTS, needs_c_helpers
from test_blas import needs_openblas, run_result_script
from test_native_decode import COMPILERS, compiler_or_skip


def plain_c_compiler(tmp_path) -> str:
    """gcc building the plain C alone (-DSPMD_CP_PORTABLE: what an ARM CPU runs), as a
    compiler the library's build calls like any other."""
    wrapper = tmp_path / "cc-portable"
    wrapper.write_text(f'#!/bin/sh\nexec {compiler_or_skip("gcc")} -DSPMD_CP_PORTABLE "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@needs_openblas
@needs_c_helpers
@pytest.mark.parametrize("cc", COMPILERS + ["plain-c"])
def test_prefill_attention_kernel_equals_numpy_and_mlx_tiles(cc, tmp_path):
    """A causal square, a chunk over its prefix, head-tail positions, a sliding window,
    queries that see no key, heads 16 and 24 wide, a group of eight query heads: within
    float32 rounding of numpy's float64 and of MLX's tiles, on one thread and on three;
    a query that sees nothing is exactly 0 with an lse of -inf; --no-fast-exp keeps MLX's
    tiles. The same for the prefill MLP's GELU gate (engine/activation.py). Built by each
    compiler, and as the plain C alone (no vector code)."""
    compiler = plain_c_compiler(tmp_path) if cc == "plain-c" else compiler_or_skip(cc)
    results = run_result_script(TESTS / "prefill_attention_probe.py", tmp_path, CC=compiler)
    assert results.pop("no_fast_exp_uses_c") is False  # MLX's tiles, as asked
    # the prefill MLP's GELU gate: the C kernel's, within float32 rounding of numpy and
    # of mlx-lm's, on one thread and three; a decode step's few rows and --no-fast-exp:
    # mlx-lm's expression itself
    for threads in (1, 3):
        gelu = results.pop(f"gelu/{threads}")
        assert gelu["native"] and max(gelu["numpy"], gelu["mlx"]) < 1e-6, (threads, gelu)
        assert not gelu["equals_mlx"] and gelu["few_rows_equal_mlx"], (threads, gelu)
    plain = results.pop("no_fast_exp_gelu")
    assert not plain["native"] and plain["equals_mlx"], plain
    assert len(results) == 12, sorted(results)
    for name, result in results.items():
        assert result["unseen_exact"], (name, result)
        assert max(result["out"], result["lse"], result["tiles"]) < 1e-5, (name, result)
    assert results["sees_nothing/1"]["unseen_rows"] == 2 * 50
    assert results["causal/3"]["unseen_rows"] == 0
