"""Quantized shadows: decode's matrix-vector products read a quantized model's packed
weights (models/quantized_shadows.py, kernels/gemv_forward.c and gguf_blocks.h), against
numpy, the gguf package's reference dequantizer and the float32 path
(--no-quantized-decode, OpenBLAS's sgemv)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import needs_c_helpers, run_cli
from test_blas import clean_env, needs_openblas, run_result_script

DRIVER = Path(__file__).with_name("shadow_driver.py")
CPU_FLAGS = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
needs_shadow_kernel = pytest.mark.skipif(
    not all(f" {flag}" in CPU_FLAGS for flag in ("avx2", "fma", "f16c")),
    reason="the shadow kernel needs an x86 CPU with AVX2, FMA and F16C (Linux)")
SHADOW_CASES = ["q4g32", "q8g32", "q4g64", "q8g64", "columns bfloat16", "other", "third",
                "rows", "columns 64:352", "columns 32:96", "stacked", "alpha beta"]
# GGUF types held as the file's blocks (Q4_0 / Q4_1 / Q8_0 too, which MLX reads as triples)
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
               "IQ4_NL", "IQ4_XS")
DIFFERS = "its packed form does not reproduce the float32 weights"


def run_driver(tmp_path, **env) -> dict:
    return run_result_script(DRIVER, tmp_path, timeout=180, **env)


@needs_openblas
@needs_c_helpers
@needs_shadow_kernel
def test_shadow_products_equal_numpy_and_refusals_leave_the_blas(tmp_path):
    """4- and 8-bit matrices in groups of 32 and 64, scales and biases kept as float16,
    bfloat16 or float32, register (their packed form gives the float32 values bit for
    bit, as numpy dequantizes it); whole matrices, row views, column copies (one ending in
    half a block) and rows of three matrices copied into one (also GGUF blocks and MLX
    triples together) are each one product the shadows serve, equal to float64 numpy to
    float32 rounding, alpha and beta included; so are 2 to 32 rows at once (a batched
    decode step's: the packed rows read once for all, on the caller's thread and on the
    decode step's pool). 33 rows, a matrix one float32 step off its packed form, a second
    registration of the same memory and 2-bit weights stay with the BLAS. Then GGUF's
    block types (``check_block_cases``). The decode plan's
    timing of packed reads runs its sample's products alone and counts every matrix's bytes.
    Batched products that take the rows two at a time (AVX-512VL) give the one-row
    kernels' bits."""
    on = run_driver(tmp_path)
    assert on["available"] and on["block_vectors"] and all(on["registered"].values()), on
    assert on["pool_threads"] >= 1, on
    for name in SHADOW_CASES + ["rows 2", "rows 9 stacked", "rows 32 columns"]:
        assert on["cases"][name]["served"] == 1, (name, on["cases"][name])
    for name in ("rows 33", "nudged"):
        assert on["cases"][name]["served"] == 0, (name, on["cases"][name])
    assert not any(on["refusals"].values())
    assert on["cases"]["mixed stacked"]["served"] == 1, on["cases"]["mixed stacked"]
    check_released(on)
    # decode_plan's timing: the first matrix alone timed (two rounds), scaled to all
    sample = on["timed sample"]
    assert sample["all bytes"] and sample["seconds"] > 0 and sample["products"] == 2, sample
    assert sample["matrices"] > 1, sample
    # two weight rows at a time (where the CPU has AVX-512VL) or not: the same bits
    assert on["two rows"]["equal"] and all(on["two rows"]["equal"].values()), on["two rows"]
    assert on["refused"] == {DIFFERS: 1 + len(BLOCK_TYPES),
                             "its memory is registered already": 1,
                             "a bit width, group size or row width the kernel does not read": 1}
    check_block_cases(on)
    check_wide_blocks(on["wide blocks"], avx512f_here())


def avx512f_here() -> bool:
    """Whether this CPU reports AVX-512F (/proc/cpuinfo's flags; False where none)."""
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def check_wide_blocks(wide: dict, expected: bool):
    """The 512-bit block kernels run exactly where the CPU has AVX-512F, and with them and
    without each product is served and within float32 rounding of float64 numpy's."""
    assert wide["here"] is expected, wide
    for kind in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"):
        for name in ("wide", "narrow", "wide rows", "narrow rows"):
            case = wide["cases"][f"{kind} {name}"]
            assert case["served"] == 1 and case["error"] < 1e-6, (kind, name, case)


def check_released(result: dict):
    """Released matrices (float32 memory handed back, packed_load.py): MLX's memory limit
    grows by their float32 bytes (its headroom for real buffers unchanged), the memory
    reads as zeros, columns on block boundaries become a name of their own that holds no
    values either (``released_columns``, the split step's down), and products of many
    rows (BLAS tiles), a few rows and one row (the packed kernels), a row view and a row
    times those columns are each within float32 rounding of float64 numpy over the
    float32 matrix; lookups and copies made while ``filled`` are the float32 matrix's
    values bit for bit."""
    assert result["released"] and all(result["released"].values()), result["released"]
    released = {k: v for k, v in result["cases"].items() if " released " in k}
    matrices = sum(name.endswith(" lookup") for name in result["released"])
    assert len(released) == 5 * matrices and len(result["released"]) == 6 * matrices, released
    for name, case in released.items():
        assert case["error"] < 1e-6, (name, case)
        packed = name.endswith((" row", " few rows"))
        assert case["served"] == (1 if packed else 0), (name, case)


def check_block_cases(result: dict):
    """The driver's GGUF block types (random blocks, the float32 matrix made by
    ``gguf.quants.dequantize``): every type registers with its true blocks and is refused
    with one block byte changed; whole matrices, row views, column copies on block
    boundaries and rows of three types copied into one are served, each product within
    float32 rounding of float64 numpy's; a column copy off the block boundaries is left
    to the BLAS."""
    for kind in BLOCK_TYPES:
        assert result["registered"][kind] is True, (kind, result["registered"])
        assert result["refusals"][f"{kind} changed"] is False, kind
        for case in (kind, f"{kind} rows", f"{kind} columns", f"{kind} batch"):
            assert result["cases"][case]["served"] == 1, (case, result["cases"][case])
        assert result["cases"][f"{kind} off"]["served"] == 0, kind
    for case in ("blocks stacked", "blocks alpha beta"):
        assert result["cases"][case]["served"] == 1, (case, result["cases"][case])
    for name, case in result["cases"].items():
        assert case["error"] < 1e-6, (name, case)  # relative to the largest output


@needs_openblas
@needs_c_helpers
def test_a_product_that_would_read_released_memory_stops_the_process(tmp_path):
    """A released matrix used as the BLAS's own operand (its memory reads as zeros, so the
    answer would be wrong): the process stops with a message, not a wrong product."""
    proc = subprocess.run([sys.executable, str(DRIVER)], capture_output=True, text=True,
                          env=clean_env(SPMD_CP_CACHE=str(tmp_path / "cache"),
                                        SHADOW_DRIVER_RELEASE="misuse"), timeout=180)
    assert proc.returncode != 0 and "RESULT" not in proc.stdout, proc.stdout
    assert "float32 memory was released" in proc.stderr, proc.stderr[-2000:]


@needs_openblas
@needs_c_helpers
def test_block_shadows_in_plain_c(tmp_path):
    """The forward built as plain C alone (-DSPMD_CP_PORTABLE: what an ARM CPU or an x86
    without AVX2 runs): GGUF's block types still register, by the reference dequantizer
    alone, and their products equal numpy's to float32 rounding."""
    from test_prefill_attention import plain_c_compiler

    result = run_driver(tmp_path, CC=plain_c_compiler(tmp_path), SHADOW_DRIVER_PART="blocks")
    assert result["available"] and not result["block_vectors"], result
    assert result["refused"] == {DIFFERS: len(BLOCK_TYPES)}, result["refused"]
    check_block_cases(result)
    check_wide_blocks(result["wide blocks"], False)


def packed_and_float32_bytes(model: str) -> tuple[int, int]:
    """Bytes of a GGUF's quantized matrices as shadows hold them (as the file stores them)
    and as float32, from the gguf package's reader."""
    import gguf

    matrices = [t for t in gguf.GGUFReader(model).tensors
                if len(t.shape) == 2 and t.tensor_type.name in BLOCK_TYPES]
    return (sum(int(t.n_bytes) for t in matrices),
            sum(4 * int(t.n_elements) for t in matrices))


@needs_openblas
@needs_c_helpers
@needs_shadow_kernel
@pytest.mark.parametrize("ranks", [1, 2])
def test_generate_reads_packed_weights_and_gives_the_float32_paths_tokens(
        ranks, embedded_model, tmp_path):
    """The embedded Q4_1 model: greedy generate with shadows gives the float32 path's
    tokens, on one rank and on two (the split step's row views and down_proj column
    copies read their shadows too: 211 + 30 registered on rank 0); the matrices are held
    packed only (their float32 memory released), as model_bytes and the memory forecast
    count (byte for byte on one rank; on two the split step's copies are released too),
    and each rank's resident peak falls accordingly; ``score`` holds them packed too
    (its prefill reads them a tile at a time) and scores as the float32 path."""
    args = ["generate", "--model", embedded_model, "--prompt",
            "Explain in two sentences why the sky is blue.", "--max-tokens", "24", "--json",
            "--decode-tp", "on"]
    env = {}  # the shared cache: its float32 copy is the same bits as a fresh one
    on = run_cli(ranks, args, env=env)
    off = run_cli(ranks, args + ["--no-quantized-decode"], env=env)
    got, want = on.last_json(), off.last_json()
    assert got["token_ids"] == want["token_ids"] and len(got["token_ids"]) == 24
    packed, float32 = packed_and_float32_bytes(embedded_model)
    assert "quantized decode: 211 matrices read packed (96 MB)" in on.stderr, on.stderr
    assert "matrices read packed" not in off.stderr
    if ranks == 2:
        assert "quantized decode: 241 matrices read packed" in on.stderr, on.stderr
    # packed only: the packed forms held, the float32 matrices they stand for released
    # (on two ranks the split step's copies of column slices are released too)
    expected = packed - float32
    saved = [a - b for a, b in zip(got["model_bytes"], want["model_bytes"])]
    assert saved == [expected] if ranks == 1 else all(s < expected for s in saved), saved
    forecast = got["memory_forecast"]["weights_bytes"] - want["memory_forecast"]["weights_bytes"]
    assert forecast == expected if ranks == 1 else forecast < expected, (forecast, expected)
    assert max(got["resident_peak_bytes"]) < 0.6 * min(want["resident_peak_bytes"]), \
        (got["resident_peak_bytes"], want["resident_peak_bytes"])
    if ranks == 1:  # score: packed as generate, the float32 path's scores
        text = tmp_path / "doc.txt"
        text.write_text("The sky is blue because air scatters short wavelengths more.")
        scored = {}
        for name, extra in (("packed", []), ("float32", ["--no-quantized-decode"])):
            output = tmp_path / f"{name}.jsonl"
            score = run_cli(1, ["score", "--model", embedded_model, "--text-file", str(text),
                                "--output", str(output), "--json", *extra], env=env)
            assert ("matrices read packed" in score.stderr) == (name == "packed")
            assert score.last_json()["model_bytes"] == (got if name == "packed"
                                                        else want)["model_bytes"]
            scored[name] = [json.loads(line) for line in output.read_text().splitlines()]
        assert [r["argmax"] for r in scored["packed"]] == [r["argmax"] for r in scored["float32"]]
        np.testing.assert_allclose([r["logprob"] for r in scored["packed"]],
                                   [r["logprob"] for r in scored["float32"]], atol=1e-4)


@needs_openblas
@needs_c_helpers
@needs_shadow_kernel
def test_mlx_format_quantized_model_reads_packed_weights(tiny_models, tmp_path):
    """An MLX-format 4-bit model (bfloat16 scales, groups of 32): dequantized in float32
    arithmetic (its scales widened first, as a GGUF's are), its 22
    matrices registered and held packed only, greedy tokens equal to the float32 path's
    on two ranks (the split step: row views and column copies; one rank's replicated
    step is the GGUF test's)."""
    from test_gpu_path import derive_model

    model = derive_model(tiny_models["llama"], tmp_path / "q4", bits=4)
    args = ["generate", "--model", model, "--prompt", "The quick brown fox", "--max-tokens",
            "12", "--json", "--no-chat-template", "--decode-tp", "on"]
    env = {"SPMD_CP_CACHE": str(tmp_path / "cache")}
    on = run_cli(2, args, env=env)
    off = run_cli(2, args + ["--no-quantized-decode"], env=env)
    assert "quantized decode: 22 matrices read packed" in on.stderr, on.stderr
    assert "ready; quantized decode: 25 matrices read packed" in on.stderr, on.stderr
    got, want = on.last_json(), off.last_json()
    assert got["token_ids"] == want["token_ids"]
    # held packed only: a rank's weights are the 4-bit triples, not float32 matrices
    assert max(got["model_bytes"]) < 0.4 * min(want["model_bytes"]), \
        (got["model_bytes"], want["model_bytes"])


@pytest.fixture(scope="module")
def block_types_file(tmp_path_factory) -> str:
    """A random two-layer Qwen2 GGUF whose matrices are of every block type (K-quants, Q5,
    IQ4; also Q8_0, Q4_0, Q4_1 and float ones): tests/test_gguf_types.py's model."""
    from test_gguf_types import TYPES, qwen2_file

    return str(qwen2_file(tmp_path_factory.mktemp("blocks") / "block-types.gguf", TYPES))


@needs_openblas
@needs_c_helpers
@needs_shadow_kernel
def test_generate_reads_gguf_blocks_and_gives_the_float32_paths_tokens(block_types_file,
                                                                       tmp_path):
    """Greedy generate at N = 2 with the split decode step on a random model of every
    block type: its 13 block-quantized matrices read packed (the file's blocks,
    memory-mapped), the split step's down column copies (cut at 256, on block
    boundaries) too, and the same tokens as the float32 path. The matrices are held
    packed only, their float32 copies released, as model_bytes and the memory forecast
    count (the split step's down copies released too)."""
    args = ["generate", "--model", block_types_file, "--prompt", "The quick brown fox",
            "--max-tokens", "12", "--json", "--no-chat-template", "--decode-tp", "on"]
    env = {"SPMD_CP_CACHE": str(tmp_path / "cache")}
    on = run_cli(2, args, env=env)
    off = run_cli(2, args + ["--no-quantized-decode"], env=env)
    assert "quantized decode: 13 matrices read packed" in on.stderr, on.stderr
    assert "ready; quantized decode: 15 matrices read packed" in on.stderr, on.stderr
    assert "matrices read packed" not in off.stderr
    got, want = on.last_json(), off.last_json()
    assert got["token_ids"] == want["token_ids"]
    # the packed forms, less the float32 matrices they stand for, released (the split
    # step's copies too)
    packed, float32 = packed_and_float32_bytes(block_types_file)
    expected = packed - float32
    saved = [a - b for a, b in zip(got["model_bytes"], want["model_bytes"])]
    assert all(s < expected for s in saved), (saved, expected)
    forecast = got["memory_forecast"]["weights_bytes"] - want["memory_forecast"]["weights_bytes"]
    assert forecast < expected, (forecast, expected)  # the down copies are released too
