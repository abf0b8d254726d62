"""Tensor-parallel decode with quantized weights: the slicing math against MLX's own
unsliced quantized layers (in this process), and greedy decode on two ranks against one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from conftest import run_cli

from spmd_cp.engine.weights.weight_slices import WeightMatrix, apply_all, column_slice, split_ranges


def quantized(out_dims: int, in_dims: int, bits: int, group: int = 32, bias=False, seed=0,
              mode: str = "affine"):
    """An mlx.nn.QuantizedLinear with random weights (and output bias)."""
    mx.random.seed(seed)
    linear = nn.Linear(in_dims, out_dims, bias=bias)
    if bias:
        linear.bias = mx.random.normal((out_dims,))
    return nn.QuantizedLinear.from_linear(linear, group_size=group, bits=bits, mode=mode)


def close(a, b):
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("bits,group,mode", [(4, 32, "affine"), (8, 32, "affine"),
                                             (4, 64, "affine"), (3, 32, "affine"),
                                             (6, 128, "affine"), (4, 32, "mxfp4")])
@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_quantized_slices_add_up_to_the_unsliced_quantized_matmul(bits, group, mode, ranks):
    """Column-parallel: the ranks' output rows concatenated; row-parallel: the ranks'
    partial sums over whole input groups (uneven: 10 groups over 3 or 5... ranks), with
    the output bias added once, both equal to mx.quantized_matmul of the whole layer."""
    layer = quantized(40, 10 * group, bits, group, bias=True, seed=bits, mode=mode)
    x = mx.random.normal((1, 3, 10 * group), key=mx.random.key(ranks))
    expected = layer(x)
    matrix = WeightMatrix.of(layer)
    assert (matrix.in_width, matrix.out_width) == (10 * group, 40)
    outputs = [matrix.rows(a, b)(x) for a, b in split_ranges(matrix.out_width, ranks)]
    close(mx.concatenate(outputs, axis=-1), expected)
    partials = [matrix.columns(a, b, keep_bias=rank == 0).materialized()(x[..., a:b])
                for rank, (a, b) in enumerate(split_ranges(matrix.in_width, ranks, group))]
    close(sum(partials[1:], partials[0]), expected)


def test_stacked_q_k_v_of_mixed_kinds_are_cut_at_any_row():
    """[Wq; Wk; Wv] packed differently (4-bit, 8-bit, plain) with biases (qwen2): every
    rank's slice concatenated is the three layers' outputs; alike neighbours are one matmul."""
    q, k = quantized(48, 64, 4, bias=True, seed=1), quantized(16, 64, 8, bias=True, seed=2)
    v = nn.Linear(64, 16)
    x = mx.random.normal((1, 2, 64), key=mx.random.key(0))
    expected = mx.concatenate([q(x), k(x), v(x)], axis=-1)
    stack = [WeightMatrix.of(m) for m in (q, k, v)]
    for ranks in (1, 2, 3, 4, 7):
        ranges = split_ranges(80, ranks)
        for join in (True, False):  # one matmul per packing, or per matrix (views)
            pieces = [column_slice(stack, a, b, join) for a, b in ranges]
            close(mx.concatenate([apply_all(p, x) for p in pieces], axis=-1), expected)
    assert len(column_slice(stack, 40, 70)) == 3  # q rows, k rows, v rows: three kinds
    same = [WeightMatrix.of(quantized(16, 64, 4, seed=s)) for s in range(3)]
    assert len(column_slice(same, 8, 40)) == 1  # one packing: one quantized matmul
    assert len(column_slice(same, 8, 40, join=False)) == 3  # rows 8-15, 0-15, 0-7: views


@pytest.mark.parametrize("bits", [None, 4])
def test_row_slices_used_as_views_take_no_memory_and_equal_copies(bits):
    """The split step's gate/up/head rows are views into the loaded matrix (replicated
    weights stay loaded): no new memory, and the same products as a copied slice and
    as rows of the unsliced matmul (numpy for the plain matrix)."""
    plain = nn.Linear(1024, 512, bias=False)  # slices big enough for MLX's large buffers
    module = plain if bits is None else nn.QuantizedLinear.from_linear(plain, 32, bits)
    mx.eval(module.parameters())
    matrix, x = WeightMatrix.of(module), mx.random.normal((1, 1024))
    before = mx.get_active_memory()
    view = matrix.rows(40, 290).evaluated(copy=False)
    assert mx.get_active_memory() == before
    copy = matrix.rows(40, 290).evaluated(copy=True)
    assert mx.get_active_memory() >= before + sum(t.nbytes for t in copy.arrays)
    assert mx.array_equal(view(x), copy(x)).item()
    close(view(x), module(x)[:, 40:290])
    if bits is None:
        expected = np.array(x) @ np.array(plain.weight)[40:290].T
        np.testing.assert_allclose(np.array(view(x)), expected, rtol=1e-5, atol=1e-5)


def test_tied_quantized_embedding_head_is_sliced_by_vocabulary():
    mx.random.seed(5)
    embed = nn.QuantizedEmbedding.from_embedding(nn.Embedding(100, 64), group_size=32, bits=8)
    x = mx.random.normal((1, 64))
    head = WeightMatrix.of(embed)
    parts = [head.rows(a, b)(x) for a, b in split_ranges(100, 3)]
    close(mx.concatenate(parts, axis=-1), embed.as_linear(x))


def test_impossible_cuts_are_refused_with_the_reason():
    assert split_ranges(10, 3) == [(0, 3), (3, 7), (7, 10)]
    assert split_ranges(320, 3, 32) == [(0, 96), (96, 224), (224, 320)]
    with pytest.raises(ValueError, match="10 groups of 32 cannot be split into 11 parts"):
        split_ranges(320, 11, 32)
    matrix = WeightMatrix.of(quantized(8, 64, 4))
    with pytest.raises(ValueError, match="cut groups of 32"):
        matrix.columns(0, 16, keep_bias=True)
    with pytest.raises(TypeError, match="not a Linear"):
        WeightMatrix.of(nn.Conv1d(4, 4, 1))


def test_embedded_model_slicing_obstacles(embedded_model):
    """The embedded GGUF kept quantized (4-bit layers, 8-bit embedding) splits over 2..48
    ranks (W_o by rows: any row count); over 49 its down_proj's 48 groups of 32 inputs
    cannot be shared, and that is said."""
    from spmd_cp.engine.model import CPModel
    from spmd_cp.engine.decode.tp_decode import describe_weights, slicing_obstacle
    from spmd_cp.models.loader import load_model

    model = CPModel(load_model(embedded_model, keep_quantized=True).model)
    assert describe_weights(model.layers[0], model) == "4/8-bit quantized"
    assert slicing_obstacle(model, 2) is None and slicing_obstacle(model, 48) is None
    assert slicing_obstacle(model, 49) == (
        "layer 0: down_proj inputs: 48 groups of 32 cannot be split into 49 parts")


def test_quantized_tensor_parallel_decode_equals_one_rank(tmp_path):
    """--keep-quantized: greedy tokens of N=2 with the decode split (quantized slices)
    equal N=1's, and rank 0's log says the split was used."""
    prompt = ["--prompt", "The three primary colors are", "--max-tokens", "12", "--json",
              "--keep-quantized", "--cp-algo", "pass-kv"]
    single = run_cli(1, ["generate", *prompt]).last_json()
    split = run_cli(2, ["generate", *prompt, "--decode-tp", "on"])
    assert "tensor-parallel slices of the 4/8-bit quantized weights over 2 ranks" in split.stderr
    assert "decode plan: replicated layout" not in split.stderr
    result = split.last_json()
    assert result["tokens"] == single["tokens"] == 12
    assert result["text"] == single["text"]


def write_quantized_model(source: str, target: Path) -> Path:
    """``source`` (an MLX model directory) quantized with mlx's own nn.quantize: 4-bit in
    groups of 32, but k_proj and down_proj 8-bit (a per-layer override, as mlx-lm's
    mixed recipes write it), so q/k/v mix packings and the MLP's groups split unevenly."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model as mlx_lm_load_model

    model, config = mlx_lm_load_model(Path(source))
    overrides = {}

    def bits_for(path: str, module) -> dict | bool:
        if not hasattr(module, "to_quantized"):
            return False
        if path.endswith(("k_proj", "down_proj")):
            overrides[path] = {"group_size": 32, "bits": 8}
            return overrides[path]
        return {"group_size": 32, "bits": 4}

    nn.quantize(model, class_predicate=bits_for)
    target.mkdir(parents=True)
    mx.save_safetensors(str(target / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config["quantization"] = {"group_size": 32, "bits": 4, **overrides}
    (target / "config.json").write_text(json.dumps(config))
    for name in Path(source).iterdir():  # the tokenizer and its chat template
        if name.name not in ("config.json", "model.safetensors"):
            shutil.copy(name, target)
    return target


def test_mixed_quantized_tiny_model_splits_unevenly_and_decodes_as_one_rank(tiny_models,
                                                                            tmp_path):
    """Qwen3 (q/k norms, untied quantized head), 4- and 8-bit layers: o_proj's and
    down_proj's 4 groups of 32 inputs over 3 ranks are 1, 2, 1 groups. Greedy tokens of
    N=3 with the split equal N=1's."""
    model = write_quantized_model(tiny_models["qwen3"], tmp_path / "qwen3-q")
    args = ["generate", "--model", str(model), "--keep-quantized", "--cp-algo", "pass-kv",
            "--prompt", "Once upon a time", "--max-tokens", "10", "--json"]
    single = run_cli(1, args).last_json()
    split = run_cli(3, [*args, "--decode-tp", "on"])
    assert "tensor-parallel slices of the 4/8-bit quantized weights over 3 ranks" in split.stderr
    assert (split.last_json()["text"], split.last_json()["tokens"]) == (single["text"], 10)


def test_a_small_models_q_k_v_rows_spanning_matrices_are_joined_into_one(embedded_model,
                                                                        monkeypatch):
    """At N = 2 SmolLM2's second rank owns q/k/v outputs 480..960: the last 96 rows of
    Wq, all of Wk and Wv. Small (1.1 MB a layer in float32), they are copied into one
    matrix (one matmul, like the first rank's); rows over JOIN_QKV_MAX_BYTES a layer stay
    views. (That the memory forecast counts the copy: test_decode_choice.py's forecast
    against the ranks' model_bytes.)"""
    from spmd_cp.engine.decode import tp_decode
    from spmd_cp.engine.weights.weight_slices import stack_rows
    from spmd_cp.models.loader import load_model

    layer = load_model(embedded_model).model.model.layers[0]
    hidden = layer.self_attn.q_proj.weight.shape[1]
    assert tp_decode.joined_qkv_bytes(layer, 2) == 480 * hidden * 4
    plan = tp_decode.LayerPlan.of(layer, 2)
    first, second = (column_slice(plan.qkv, a, b, join=False) for a, b in plan.qkv_ranges)
    assert (len(first), len(second)) == (1, 3)
    x = mx.random.normal((1, hidden))
    joined = stack_rows(second)
    assert len(joined) == 1
    np.testing.assert_array_equal(np.array(apply_all(joined, x)), np.array(apply_all(second, x)))
    expected = np.concatenate([np.array(m.weight) for m in plan.qkv])[480:] @ np.array(x)[0]
    np.testing.assert_allclose(np.array(apply_all(joined, x))[0], expected, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(tp_decode, "JOIN_QKV_MAX_BYTES", 480 * hidden * 4 - 1)
    assert tp_decode.joined_qkv_bytes(layer, 2) == 0
