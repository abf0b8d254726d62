"""The GPU path (fused attention, model-dtype KV cache and messages) run on the CPU with
--device gpu, through real MPI ranks, against mlx-lm's unmodified forward.

On the CPU, MLX's attention "kernel" is a fallback that computes half-precision scores
in half precision (a GPU's fused kernel keeps them in float32), so a half-precision
model's ring partials here carry more rounding than they would on a GPU. The bars:
paths that merge nothing (one rank, all-gather) equal mlx-lm's bf16 forward; the rings
are no further from the float32 evaluation of the same weights than mlx-lm's own bf16
forward is. The bar on a GPU (max |dlogprob| <= 2e-3 on a 1B model) needs one.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import TESTS, run_cli, run_ranks
from test_cp_exact import ALGOS, check_against_reference, configs_for, lengths_for

GPU_PATH = ["--device", "gpu"]
RING_ALGOS = ("pass-kv", "pass-q", "allgather-kv")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_fused_attention_matches_mlx_lm(n, tiny_models, tmp_path):
    """float32 models: every algorithm, chunked prefill, both decode merges."""
    configs = configs_for(n, ALGOS, lengths_for(n), decode=4)
    configs += [{"algo": "pass-kv", "chunk": 0, "length": 29, "decode": 4, "seed": 3,
                 "merge": "allreduce"}]
    for path in tiny_models.values():
        out = tmp_path / "results.json"
        run_ranks(n, [sys.executable, str(TESTS / "mpi_exact_driver.py"), path,
                      json.dumps(configs), str(out), "gpu"], timeout=400)
        check_against_reference(json.loads(out.read_text())["results"], path, n)


def derive_model(src: str, dst: Path, bits: int | None = None) -> str:
    """A bfloat16 copy of a tiny test model (weights at mlx-lm's initial scale, so that
    rounding is not amplified as in the deliberately peaked originals), optionally
    quantized to ``bits``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import load_model, quantize_model

    model, config = load_model(Path(src))
    model.update(tree_unflatten([(k, v / 3 if v.ndim == 2 and "embed" not in k else v)
                                 for k, v in tree_flatten(model.parameters())]))
    model.set_dtype(mx.bfloat16)
    if bits:
        model, config = quantize_model(model, config, group_size=32, bits=bits)
    dst.mkdir(parents=True)
    mx.save_safetensors(str(dst / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (dst / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                 if k != "model_file"}))
    for f in Path(src).iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    return str(dst)


@pytest.fixture(scope="module")
def half_models(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("half_models")
    return {"bf16": derive_model(tiny_models["llama"], root / "bf16"),
            "q4": derive_model(tiny_models["llama"], root / "q4", bits=4)}


@pytest.fixture(scope="module")
def document(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat and then it ran to the door of the house".split()
    path = tmp_path_factory.mktemp("doc") / "doc.txt"
    path.write_text(" ".join(rng.choice(words, 150)))
    return path


def mlx_lm_logprobs(model_path: str, text: str):
    """(token ids, logprobs of mlx-lm's forward in the model's dtype, the same in float32)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from spmd_cp.models.loader import load_model as load_with_tokenizer

    ids = np.asarray(load_with_tokenizer(model_path, keep_quantized=True).tokenizer.encode(text))
    model, _ = load_model(Path(model_path))
    result = []
    for dtype in (None, mx.float32):
        if dtype is not None:
            model.set_dtype(dtype)
        logits = model(mx.array(ids)[None])[0].astype(mx.float32)
        logprobs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        result.append(logprobs[np.arange(len(ids) - 1), ids[1:]])
    return ids, result[0], result[1]


@pytest.fixture(scope="module")
def q4_scores(half_models, document, tmp_path_factory):
    """``scores(n, algo)``: the 4-bit model scored on the GPU path, launched once each
    (the replicated N = 2 pass-kv run serves two tests)."""
    done, folder = {}, tmp_path_factory.mktemp("q4_scores")

    def scores(n: int, algo: str):
        if (n, algo) not in done:
            done[n, algo] = score(n, half_models["q4"], document,
                                  folder / f"{n}-{algo}.jsonl", algo)
        return done[n, algo]
    return scores


def score(n: int, model: str, document: Path, out: Path, algo: str):
    summary = run_cli(n, ["score", "--model", model, "--keep-quantized", "--text-file",
                          str(document), "--output", str(out), "--cp-algo", algo, "--json",
                          *GPU_PATH]).last_json()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return (summary, np.array([r["token"] for r in records]),
            np.array([r["logprob"] for r in records]))


def assert_within_half_precision(logprob, half, full, exact: bool, where: str):
    """``exact``: equal to mlx-lm's half-precision forward; otherwise no further from its
    float32 evaluation than mlx-lm's own half-precision forward (plus 2e-3)."""
    if exact:
        np.testing.assert_allclose(logprob, half, rtol=0, atol=1e-5, err_msg=where)
    else:
        bound = 1.5 * np.abs(half - full).max() + 2e-3
        assert np.abs(logprob - full).max() <= bound, where


@pytest.mark.parametrize("n", [1, 3])
def test_bf16_model_keeps_a_bf16_cache_and_mlx_lm_precision(n, half_models, document, tmp_path):
    ids, half, full = mlx_lm_logprobs(half_models["bf16"], document.read_text())
    per_token = 2 * 3 * 2 * 16 * 2  # K and V, 3 layers, 2 KV heads, head dim 16, 2 bytes
    for algo in RING_ALGOS if n > 1 else ("pass-kv",):
        summary, tokens, logprob = score(n, half_models["bf16"], document,
                                         tmp_path / f"{algo}.jsonl", algo)
        where = f"N={n} {algo}"
        np.testing.assert_array_equal(tokens, ids[1:], err_msg=where)
        assert summary["kv_dtype"] == "bfloat16" and summary["compute_path"] == "gpu"
        # --prefill-chunk auto: mlx-lm's step at one rank, the whole prompt at three
        assert summary["prefill_chunk"] == (2048 if n == 1 else 0), where
        assert summary["backend"] in ("cpu", "metal", "cuda") and summary["warmup_s"] > 0
        assert sum(summary["kv_cache_bytes"]) == per_token * len(ids), where
        assert_within_half_precision(logprob, half, full, n == 1 or algo == "allgather-kv",
                                     where)


def test_one_rank_prefills_a_long_document_in_mlx_lm_steps(half_models, tmp_path):
    """--prefill-chunk auto on the GPU path at one rank: a document over 2,048 tokens is
    prefilled in mlx-lm's 2,048-token steps (the later chunk attends to the cached
    one), and its scores are still mlx-lm's bf16 forward over the whole document."""
    rng = np.random.default_rng(3)
    words = "the cat sat on a mat and then it ran to the door of the house".split()
    document = tmp_path / "long.txt"
    document.write_text(" ".join(rng.choice(words, 2600)))
    ids, half, _ = mlx_lm_logprobs(half_models["bf16"], document.read_text())
    assert len(ids) > 2048
    summary, tokens, logprob = score(1, half_models["bf16"], document,
                                     tmp_path / "long.jsonl", "auto")
    assert summary["prefill_chunk"] == 2048
    np.testing.assert_array_equal(tokens, ids[1:])
    np.testing.assert_allclose(logprob, half, rtol=0, atol=1e-5)


# The CPU path's --keep-quantized runs: tests/test_tensor_parallel.py (N = 1 and 2,
# the split step over packed slices) and tests/test_gguf.py (against the float32 model).
def test_quantized_model_on_two_ranks(half_models, document, q4_scores):
    """--keep-quantized 4-bit weights through every algorithm on the GPU path."""
    path = "gpu"
    ids, half, full = mlx_lm_logprobs(half_models["q4"], document.read_text())
    one, _, single = q4_scores(1, "pass-kv")
    assert one["kv_dtype"] == "bfloat16" and one["warmup_s"] > 0
    assert_within_half_precision(single, half, full, True, f"{path} N=1")
    for algo in RING_ALGOS:
        _, _, logprob = q4_scores(2, algo)
        where = f"{path} N=2 {algo}"
        if algo == "allgather-kv":  # merges nothing: the same sums as one rank
            np.testing.assert_allclose(logprob, single, rtol=0, atol=1e-5, err_msg=where)
        else:
            assert_within_half_precision(logprob, half, full, False, where)


def test_layer_sharded_quantized_weights_on_the_gpu_path(half_models, document, tmp_path,
                                                         q4_scores):
    """--shard-weights on: packed 4-bit layers broadcast, bf16 cache, fused attention;
    the same tokens as the replicated run at the same N and mlx-lm's precision."""
    model = half_models["q4"]
    ids, half, full = mlx_lm_logprobs(model, document.read_text())
    _, tokens, logprob = q4_scores(2, "pass-kv")
    summary, sharded_tokens, sharded = run_sharded_score(model, document, tmp_path)
    assert summary["compute_path"] == "gpu" and summary["kv_dtype"] == "bfloat16"
    assert max(summary["model_bytes"]) < Path(model, "model.safetensors").stat().st_size
    np.testing.assert_array_equal(sharded_tokens, tokens)
    assert_within_half_precision(sharded, half, full, False, "sharded N=2")
    answers = [run_cli(2, ["generate", "--model", model, "--keep-quantized", "--prompt-file",
                           str(document), "--no-chat-template", "--max-tokens", "5", "--json",
                           "--shard-weights", flag, *GPU_PATH]).last_json()["token_ids"]
               for flag in ("off", "on")]
    assert answers[0] == answers[1]


def run_sharded_score(model: str, document: Path, tmp_path: Path):
    out = tmp_path / "sharded.jsonl"
    summary = run_cli(2, ["score", "--model", model, "--keep-quantized", "--text-file",
                          str(document), "--output", str(out), "--cp-algo", "pass-kv",
                          "--json", "--shard-weights", "on", *GPU_PATH]).last_json()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return (summary, np.array([r["token"] for r in records]),
            np.array([r["logprob"] for r in records]))


def test_kv_dtype_and_forecast_follow_the_path(half_models):
    import mlx.core as mx

    from spmd_cp.engine.cache.forecast import forecast_rank_bytes
    from spmd_cp.engine.model import kv_dtype_for, kv_model_shape
    from spmd_cp.models.loader import load_model
    from spmd_cp.runtime.device import Compute

    loaded = load_model(half_models["bf16"], keep_quantized=True)
    forecasts = {}
    for path, dtype in (("cpu", mx.float32), ("gpu", mx.bfloat16)):
        compute = Compute.resolve(path)
        assert kv_dtype_for(loaded.model, compute=compute) == dtype
        forecasts[path] = forecast_rank_bytes(kv_model_shape(loaded, compute=compute), 0,
                                              4096, 4096, 2)
    assert forecasts["gpu"].kv * 2 == forecasts["cpu"].kv
    assert forecasts["gpu"].kv == (4096 // 2 + 1) * 2 * 3 * 2 * 16 * 2
