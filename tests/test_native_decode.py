"""Decode steps outside MLX's graph (engine/native_decode.py, kernels/decode_step.c).

The C calls against float64 numpy on one random layer; whole steps on real ranks against
mlx-lm's unmodified forward pass over the whole sequence; and MLX's own step, which the
GPU path, layer-sharded weights and ``--decode-step graph`` keep, against the same
reference."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import TESTS, needs_c_helpers, run_ranks
from test_blas import needs_openblas, run_result_script

DRIVER = [sys.executable, str(TESTS / "native_decode_driver.py")]
# float32 steps against a float32 forward over the whole sequence: the sums run in
# other orders (RMSNorm, softmax, the merge, sgemv against MLX's sgemm), no more
TOLERANCE = 1e-4


@needs_openblas
@needs_c_helpers
def test_decode_step_calls_equal_numpy(tmp_path):
    """Each call of decode_step.c on a layer with two q/k/v pieces and biases, q/k norms,
    12 query heads on one KV head: within float32 rounding of numpy in float64; the new
    token's key and value land in the cache row given; an empty shard's partial weighs
    nothing in the merge; SwiGLU's exponential holds where |gate| reaches 100."""
    errors = run_result_script(TESTS / "native_kernels_probe.py", tmp_path)
    assert errors.pop("empty_partial_max") == float("-inf")
    assert errors.pop("stored_value") == 0.0  # copied, not computed
    assert all(error < 2e-6 for error in errors.values()), errors


def driver_results(n: int, models: list[str], tmp_path, graph: bool = False) -> list[dict]:
    out = tmp_path / f"native-{n}.json"
    run_ranks(n, DRIVER + [str(out), *(["--graph"] if graph else []), *models], timeout=300)
    data = json.loads(out.read_text())
    assert data["ranks"] == n
    return data["results"]


@needs_c_helpers
@pytest.mark.parametrize("n", [1, 2])
def test_native_steps_equal_mlx_lm_forward(n, tiny_models, tiny_variant_models, tmp_path):
    """Llama, Qwen3 (q/k norms) and Qwen2 (q/k/v biases, untied head): every decode
    step's logits within 1e-4 (relative to the largest) of mlx-lm's forward over the
    whole sequence, the same argmax; at N = 2 with the split step and the replicated one,
    and the split step over blocking collectives (as on an MPI without persistent ones)."""
    models = [tiny_models["llama"], tiny_models["qwen3"], tiny_variant_models["qwen2"]]
    results = driver_results(n, models, tmp_path)
    # at N = 2 also the split step over blocking collectives (an MPI without persistent ones)
    assert len(results) == len(models) * (2 if n > 1 else 1) + (n > 1)
    assert [r["persistent"] for r in results].count(False) == (n > 1)
    for result in results:
        assert result["decode_step"] == "native", result
        assert result["requests"] == ("none" if n == 1 else
                                      "persistent" if result["persistent"] else "blocking")
        assert result["error"] < TOLERANCE and result["argmax_equal"], result


def test_mlx_step_kept_on_request_equals_mlx_lm_forward(tiny_models, tmp_path):
    """--decode-step graph: MLX's step (split and replicated), to the same reference."""
    results = driver_results(2, [tiny_models["qwen3"]], tmp_path, graph=True)
    for result in results:
        assert result["decode_step"] == "mlx", result
        assert result["error"] < TOLERANCE and result["argmax_equal"], result


def test_what_keeps_mlx_step_is_named(tiny_models):
    """native_obstacle names what the native step does not cover, checked before any
    rank commits to it: 4-bit layers kept packed (--keep-quantized), bfloat16 weights;
    a plain float32 model has none but, in this process (no BLAS preloaded
    by the re-exec), the missing cblas_sgemm."""
    import mlx.core as mx
    import mlx.nn as nn

    from spmd_cp.engine.model import CPModel
    from spmd_cp.engine.native_eligibility import native_obstacle
    from spmd_cp.models.loader import load_model

    def obstacle(transform=None):
        model = load_model(tiny_models["llama"]).model
        if transform:
            transform(model)
        return native_obstacle(CPModel(model))

    assert obstacle(lambda m: nn.quantize(m.model.layers[1], group_size=32, bits=4)) == \
        "layer 1: q_proj is a QuantizedLinear of uint32"
    assert obstacle(lambda m: m.set_dtype(mx.bfloat16)) == \
        "the embedding is a Embedding of bfloat16"
    plain = obstacle()
    assert plain is None or "cblas_sgemm" in plain or "failed" in plain, plain
