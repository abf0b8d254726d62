"""Decode steps outside MLX's graph (engine/decode/native_decode.py, kernels/decode_step.c).

The C calls against float64 numpy on one random layer; whole steps on real ranks against
mlx-lm's unmodified forward pass over the whole sequence; and MLX's own step, which the
GPU path, layer-sharded weights and ``--decode-step graph`` keep, against the same
reference."""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TESTS, needs_c_helpers, run_cli, run_ranks
from test_blas import needs_openblas, run_result_script

DRIVER = [sys.executable, str(TESTS / "native_decode_driver.py")]
# float32 steps against a float32 forward over the whole sequence: the sums run in
# other orders (RMSNorm, softmax, the merge, sgemv against MLX's sgemm), no more
TOLERANCE = 1e-4
# against mlx-lm with the same half-precision cache: a key both sides compute to float32
# rounding may still round to neighbouring halves (one half ulp: 1e-3 or 8e-3 relative)
HALF_TOLERANCE = 1e-3


KERNELS = Path(__file__).resolve().parent.parent / "spmd_cp" / "kernels"
COMPILERS = ["gcc", "clang"]  # Debian's two; the kernels must build with each


def compiler_or_skip(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed here")
    return path


@pytest.mark.parametrize("cc", COMPILERS)
def test_kernels_compile_cleanly_with_each_compiler(cc, tmp_path):
    """Both kernels, with their vector code and as plain C alone (what an ARM or a macOS
    clang compiles), without a warning under -Wall -Wextra."""
    path = compiler_or_skip(cc)
    for source in sorted(KERNELS.glob("*.c")):
        for portable in ([], ["-DSPMD_CP_PORTABLE"]):
            command = [path, *portable, "-O2", "-shared", "-fPIC", "-Wall", "-Wextra",
                       "-Werror", "-I", str(KERNELS), "-o", str(tmp_path / "k.so"),
                       str(source), "-ldl"]
            built = subprocess.run(command, capture_output=True, text=True, timeout=120)
            assert built.returncode == 0, (command, built.stderr)


@needs_c_helpers
def test_ctypes_structs_are_checked_against_the_c_layout(tmp_path):
    """decode_step.py's structs match the sizes and offsets the library reports; a
    struct that differs (a field missing) is named and keeps the library unused."""
    from spmd_cp.kernels import decode_step
    from spmd_cp.runtime import native

    loaded = ctypes.CDLL(str(native.build(decode_step.SOURCE, tmp_path / "step.so")))
    assert decode_step.layout_mismatch(loaded) == ""

    class Shorter(ctypes.Structure):
        _fields_ = [f for f in decode_step.Matrix._fields_ if f[0] != "bias"]

    decode_step.STRUCTS["matrix"] = Shorter
    try:
        assert decode_step.layout_mismatch(loaded) == (
            "decode_step.c and decode_step.py disagree: sizeof(matrix) is "
            f"{ctypes.sizeof(decode_step.Matrix)} in C, {ctypes.sizeof(Shorter)} in ctypes")
    finally:
        decode_step.STRUCTS["matrix"] = decode_step.Matrix


@needs_openblas
@needs_c_helpers
@pytest.mark.parametrize("cc", COMPILERS)
def test_decode_step_calls_equal_numpy(cc, tmp_path):
    """Each call of decode_step.c on a layer with two q/k/v pieces and biases, q/k norms,
    12 query heads on one KV head: within float32 rounding of numpy in float64; the new
    token's key and value land in the cache row given; an empty shard's partial weighs
    nothing in the merge; SwiGLU's exponential holds where |gate| reaches 100; over a
    float16 and a bfloat16 cache, the stored bits are numpy's rounding and attention is
    float64's over the widened cache to float32 rounding, also over 301 keys (the vector
    kernels' tiles and blocks with their remainders). A batched step's calls
    (batch_step.h) on three rows at their own positions: their q/k/v, the new keys
    stored in their tails, attention over the shared cache (split over three threads)
    and each row's tail, with and without a window, the MLP and the head. Built by
    each compiler present (the forward and the step: the probe's cache is its own)."""
    errors = run_result_script(TESTS / "native_kernels_probe.py", tmp_path,
                               CC=compiler_or_skip(cc))
    assert errors.pop("empty_partial_max") == float("-inf")
    assert errors.pop("stored_value") == 0.0  # copied, not computed
    # a half-precision cache stores the bits numpy rounds to, and reads them exactly
    assert errors.pop("float16_stored_bits") == errors.pop("bfloat16_stored_bits") == 0
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
    and the split step over blocking collectives (as on an MPI without persistent ones).
    Llama also over a float16 and a bfloat16 cache, against mlx-lm's forward with its
    own cache in the same dtype."""
    models = [tiny_models["llama"], tiny_models["qwen3"], tiny_variant_models["qwen2"]]
    results = driver_results(n, models, tmp_path)
    modes = 2 if n > 1 else 1
    # at N = 2 also the split step over blocking collectives (an MPI without persistent
    # ones); for the first model each mode over a float16 and a bfloat16 cache
    assert len(results) == len(models) * modes + (n > 1) + 2 * modes
    assert [r["persistent"] for r in results].count(False) == (n > 1)
    assert sorted(r["kv_dtype"] for r in results if r["kv_dtype"] != "float32") == \
        ["bfloat16"] * modes + ["float16"] * modes
    for result in results:
        assert result["decode_step"] == "native", result
        assert result["requests"] == ("none" if n == 1 else
                                      "persistent" if result["persistent"] else "blocking")
        tolerance = TOLERANCE if result["kv_dtype"] == "float32" else HALF_TOLERANCE
        assert result["error"] < tolerance and result["argmax_equal"], result


def test_mlx_step_kept_on_request_equals_mlx_lm_forward(tiny_models, tmp_path):
    """--decode-step graph: MLX's step (split and replicated), to the same reference."""
    results = driver_results(2, [tiny_models["qwen3"]], tmp_path, graph=True)
    for result in results:
        assert result["decode_step"] == "mlx", result
        assert result["error"] < TOLERANCE and result["argmax_equal"], result


LENGTHS = [16, 6, 10, 16]  # the jobs' max_tokens
BATCH_DOCUMENT = " ".join(f"Item {i} is kept in box {i * 7 % 13}." for i in range(20))


@needs_c_helpers
@pytest.mark.parametrize("n, decode_tp", [(1, "auto"), (3, "off"), (3, "on")])
def test_batched_native_steps_equal_one_sequence_at_a_time(n, decode_tp, tiny_variant_models,
                                                           tmp_path):
    """``batch --max-batch 3`` through the native step's batched form
    (engine/decode/native_batched.py) on Qwen2 (q/k/v biases, an untied head): four jobs after
    one document, the second shorter so that the fourth joins as it leaves, the batch
    then shrinking to two and one; each job's greedy
    tokens equal those of one job after another (``--max-batch 1``, one sequence's
    native step) on the same ranks, over a float16 cache. One rank: the document's keys
    split over the pool's two threads; three ranks in the replicated layout
    (``--decode-tp off``): rows dealt unevenly, and a rank without rows in a step of two;
    in the split layout (``on``: every rank all rows through its slices of the weights,
    native_batched_split.py)."""
    (tmp_path / "doc.txt").write_text(BATCH_DOCUMENT)
    jobs = tmp_path / "jobs.jsonl"
    questions = ["Which box holds item 5?", "Where is item 11?", "List the boxes.",
                 "Name an item."]
    jobs.write_text("".join(json.dumps({
        "id": f"q{i}", "prefix_file": "doc.txt", "prompt": question, "ignore_eos": True,
        "max_tokens": LENGTHS[i]}) + "\n" for i, question in enumerate(questions)))
    answers, summaries = {}, {}
    for batch in ("3", "1"):
        out = tmp_path / f"out-{batch}.jsonl"
        summaries[batch] = run_cli(n, [
            "batch", "--model", tiny_variant_models["qwen2"], "--jobs", str(jobs), "--output",
            str(out), "--max-batch", batch, "--no-chat-template", "--kv-dtype", "float16",
            "--decode-tp", decode_tp, "--json"]).last_json()
        answers[batch] = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    assert summaries["3"]["batched_step"] == "native" and summaries["1"]["batched_step"] is None
    # the questions were fed as rows of the batched steps (scheduler.PROMPT_ROWS)
    assert summaries["3"]["prompts_as_rows"] == len(questions)
    if n > 1:
        assert summaries["3"]["decode_plan"]["layout"] == \
            {"off": "replicated", "on": "split"}[decode_tp]
    assert set(summaries["3"]["batch_sizes"]) == {"1", "2", "3"}
    assert answers["3"] == answers["1"]
    assert [len(a) for a in answers["1"]] == LENGTHS


def test_what_keeps_mlx_step_is_named(tiny_models):
    """native_obstacle names what the native step does not cover, checked before any
    rank commits to it: 4-bit layers kept packed (--keep-quantized), bfloat16 weights,
    the GPU path; a plain float32 model has none but, in this process (no BLAS preloaded
    by the re-exec), the missing cblas_sgemm. The settings' part of the same rules,
    checked before any model loads, names the flags and the path the same way."""
    import mlx.core as mx
    import mlx.nn as nn

    from spmd_cp.config import DecodeConfig
    from spmd_cp.engine.model import CPModel
    from spmd_cp.engine.decode.native_eligibility import native_obstacle, upfront_obstacle
    from spmd_cp.models.loader import load_model
    from spmd_cp.runtime.device import Compute

    def obstacle(transform=None, compute=None):
        model = load_model(tiny_models["llama"]).model
        if transform:
            transform(model)
        return native_obstacle(CPModel(model, compute=compute))

    native, gpu = DecodeConfig(decode_step="native"), Compute("gpu", True)
    assert obstacle(compute=gpu) == upfront_obstacle(native, gpu, "float32", False) == \
        "the GPU path"
    assert upfront_obstacle(native, Compute("cpu", False), "float32", True) == \
        "layer-sharded weights"
    assert upfront_obstacle(DecodeConfig(decode_step="native", decode_comm="mlx"), gpu,
                            "float32", False) == "--decode-comm mlx"

    assert obstacle(lambda m: nn.quantize(m.model.layers[1], group_size=32, bits=4)) == \
        "layer 1: q_proj is a QuantizedLinear of uint32"
    assert obstacle(lambda m: m.set_dtype(mx.bfloat16)) == \
        "the embedding is a Embedding of bfloat16"
    plain = obstacle()
    assert plain is None or "cblas_sgemm" in plain or "failed" in plain, plain


def test_half_precision_cache_saves_its_dtype_and_loads_converted():
    """A float16 cache's state keeps float16 (what --save-cache writes); restored into a
    float32 cache it is widened exactly, and into a bfloat16 one rounded as MLX rounds."""
    import mlx.core as mx
    import numpy as np

    from spmd_cp.engine.cache.cache import ShardedKVCache

    rng = np.random.default_rng(3)
    cache = ShardedKVCache(2, 0, 1, mx.float16)
    cache.add_positions([np.arange(5)], np.arange(5))
    for layer in cache.layers:
        layer.update_and_fetch(*(mx.array(rng.standard_normal((2, 5, 8)), mx.float32)
                                 for _ in range(2)))
    arrays, shared = cache.state()
    assert arrays["layer.1.keys"].dtype == mx.float16
    for dtype in (mx.float32, mx.bfloat16):
        restored = ShardedKVCache.from_state(2, 0, [cache.positions], arrays, shared, dtype)
        keys, _ = restored.layers[1].fetch()
        assert keys.dtype == dtype
        wanted = arrays["layer.1.keys"].astype(dtype)
        assert np.array_equal(np.array(keys.astype(mx.float32)),
                              np.array(wanted.astype(mx.float32)))


def test_forecast_counts_the_cache_at_its_element_size():
    """--kv-dtype float16 halves the forecast's KV bytes; activations stay float32's."""
    from spmd_cp.engine.cache.forecast import forecast_rank_bytes
    from spmd_cp.models.shape import ModelShape

    shape = ModelShape(30, 576, 1536, 9, 3, 64, 49152)
    full = forecast_rank_bytes(shape, 0, 8192, 8192, 2)
    half = forecast_rank_bytes(ModelShape(30, 576, 1536, 9, 3, 64, 49152, kv_elem_bytes=2),
                               0, 8192, 8192, 2)
    assert half.kv * 2 == full.kv == (8192 // 2 + 1) * 2 * 30 * 3 * 64 * 4
    assert half.activations == full.activations
