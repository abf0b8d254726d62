"""Phi-3 and the mixtures of experts (Qwen3-MoE, Mixtral) against mlx-lm's own forward.

One launch per rank count runs every family through every ``--cp-algo``, whole and
chunked prefill, a prompt cache saved and reloaded, and (N > 1) the split decode step
(tests/families_driver.py); the references are mlx-lm's unmodified models on the whole
sequence, in this process. In this process too: GGUF files of each family, the split
step's reason for experts it cannot cut, and the refusal of another family.
"""

from __future__ import annotations

import json
import sys
from functools import lru_cache

import numpy as np
import pytest

from conftest import TESTS, run_ranks, write_tiny_model
from families_driver import ALGOS, CHUNK, DECODE, LENGTH, TP_LENGTH, prompt_ids

DRIVER = [sys.executable, str(TESTS / "families_driver.py")]
TOLERANCE = dict(rtol=1e-4, atol=1e-4)

# Tiny random models of each family: 8 query heads over 2 KV heads as conftest's; Phi-3
# and Mixtral take head_dim = hidden / heads = 8 (their mlx-lm attention reads no head_dim).
FAMILIES = {
    # fused q|k|v and gate|up, half the head rotated (a plain RoPE: the native step runs it)
    "phi3": {"model_type": "phi3", "partial_rotary_factor": 0.5, "head_dim": 8},
    # Phi-3's long-context RoPE (mlx-lm's SuScaledRoPE): MLX's decode step runs it
    "phi3-longrope": {"model_type": "phi3", "head_dim": 8, "max_position_embeddings": 64,
                      "original_max_position_embeddings": 16, "rope_scaling": {
                          "type": "longrope", "short_factor": [1.0] * 4,
                          "long_factor": [1.0, 1.5, 2.0, 4.0]}},
    # experts in layers 0 and 2, a dense MLP in layer 1; q/k norms
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                  "mlp_only_layers": [1], "norm_topk_prob": True},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
                "intermediate_size": 48, "head_dim": 8},
}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("families")
    return {name: str(write_tiny_model(root / name, extra["model_type"], seed=3,
                                       extra_config=extra))
            for name, extra in FAMILIES.items()}


@pytest.fixture(scope="module")
def quantized_moe(family_models, tmp_path_factory) -> str:
    """The Qwen3-MoE model 4-bit quantized by mlx-lm's convert (experts included; the
    router at 8 bits, as its quant_predicate says): run at N = 2 only."""
    from mlx_lm.convert import convert

    out = tmp_path_factory.mktemp("quantized") / "qwen3_moe-4bit"
    convert(family_models["qwen3_moe"], str(out), quantize=True, q_group_size=32, q_bits=4)
    return str(out)


@lru_cache(maxsize=None)
def reference(path: str, length: int, seed: int):
    """mlx-lm's own model on the whole prompt: every prompt token's logprob and the
    greedy continuation (its generate_step)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(__import__("pathlib").Path(path))
    model.set_dtype(mx.float32)
    ids = prompt_ids(length, seed)
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    logprobs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    scored = logprobs[np.arange(length - 1), ids[1:]]
    tokens = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=DECODE,
                                                sampler=lambda x: mx.argmax(x, axis=-1))]
    return scored, tokens


def models_at(n: int, family_models: dict, quantized_moe: str) -> dict:
    """Every family at every N; the variants of one (Phi-3's long-context RoPE, a
    quantized mixture) at N = 2 only, where shards, chunks and the split step all meet."""
    if n == 2:
        return {**family_models, "qwen3_moe-4bit": quantized_moe}
    return {k: v for k, v in family_models.items() if k != "phi3-longrope"}


@pytest.fixture(scope="module")
def launches(family_models, quantized_moe, tmp_path_factory) -> dict:
    """{N: (the driver's results, rank 0's log)} for N = 1, 2, 3."""
    out = {}
    work = tmp_path_factory.mktemp("family-runs")
    for n in (1, 2, 3):
        result = work / f"out-{n}.json"
        models = models_at(n, family_models, quantized_moe)
        launch = run_ranks(n, DRIVER + [json.dumps(models), str(result), str(work)],
                           timeout=600)
        out[n] = (json.loads(result.read_text())["results"], launch.stderr)
    return out


@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_family_and_algorithm_equals_mlx_lm(family_models, quantized_moe, launches, n):
    """Scores (1e-4 in float32) and greedy continuations of whole and chunked prefills,
    and of a prompt cache saved part-way, loaded back and continued."""
    results, _ = launches[n]
    paths = models_at(n, family_models, quantized_moe)
    assert set(results) == set(paths)
    for family, path in paths.items():
        scored, tokens = reference(path, LENGTH, 1)
        runs = results[family]
        assert set(runs["algos"]) == {f"{a}/{c}" for a in ALGOS for c in (0, CHUNK)}
        for key, run in runs["algos"].items():
            np.testing.assert_allclose(run["logprob"], scored, **TOLERANCE,
                                       err_msg=f"{family} {key} N={n}")
            assert run["greedy"] == tokens, (family, key, n)
        assert runs["saved_cache"] == tokens, (family, n)


def test_decode_steps_and_split_at_two_ranks(family_models, quantized_moe, launches):
    """At N = 2, over replicated and layer-sharded weights, the split step (Phi-3's fused
    matrices cut by rows, a mixture's experts by their hidden units) equals mlx-lm; the
    native step runs Phi-3 with a plain RoPE and refuses what it cannot compute, with
    the reason."""
    results, log = launches[2]
    for family, path in {**family_models, "qwen3_moe-4bit": quantized_moe}.items():
        scored, tokens = reference(path, TP_LENGTH, 2)
        for weights in ("split", "sharded"):
            run = results[family][weights]
            np.testing.assert_allclose(run["logprob"], scored, **TOLERANCE,
                                       err_msg=f"{family} {weights}")
            assert run["greedy"] == tokens, (family, weights)
            assert run["tp_used"], (family, weights)
    assert "replicated layout (the weights cannot be split" not in log, log
    steps = {family: runs["algos"]["pass-kv/0"]["decode_step"]
             for family, runs in results.items()}
    from conftest import C_HELPERS_BUILD

    if C_HELPERS_BUILD:
        assert steps == {"phi3": "native", "phi3-longrope": "mlx", "qwen3_moe": "mlx",
                         "mixtral": "mlx", "qwen3_moe-4bit": "mlx"}, steps
        assert "graph step (rank 0: layer 0: its RoPE is a SuScaledRoPE)" in log
        assert "graph step (rank 0: layer 0: its MLP is a mixture of 4 experts " \
               "(2 a token), which the native step does not compute)" in log


def test_split_step_names_experts_it_cannot_cut(family_models):
    """Experts kept quantized (--keep-quantized): the split step says why it does not
    divide them, the line the engine logs before it decodes replicated."""
    import mlx.nn as nn

    from spmd_cp.engine.model import CPModel
    from spmd_cp.engine.decode.tp_decode import slicing_obstacle
    from spmd_cp.models.loader import load_model

    loaded = load_model(family_models["mixtral"], keep_quantized=True)
    nn.quantize(loaded.model, group_size=32, bits=4,
                class_predicate=lambda path, _: path.endswith("switch_mlp.gate_proj"))
    assert slicing_obstacle(CPModel(loaded.model), 2) == (
        "layer 0: its experts' gate_proj is a QuantizedSwitchLinear (a mixture of 4 experts "
        "(2 a token)), which the split step does not divide")


def test_a_refused_family_names_the_supported_ones(tmp_path):
    from spmd_cp.errors import UserError
    from spmd_cp.models.loader import check_model_path
    from spmd_cp.models.shape import SUPPORTED_MODEL_TYPES

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    with pytest.raises(UserError) as error:
        check_model_path(str(tmp_path))
    assert str(error.value).count("\n") == 0
    assert f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})" in str(error.value)
    assert {"phi3", "qwen3_moe", "mixtral"} <= set(SUPPORTED_MODEL_TYPES)


def write_gguf(model_dir: str, out: str) -> str:
    """The MLX model in ``model_dir`` as a float32 GGUF file the way llama.cpp's converter
    writes its family (Mixtral as ``llama`` with stacked experts and Q/K rows permuted for
    the interleaved RoPE; Phi-3's long-context factors as tensors), with the embedded
    model's tokenizer."""
    import mlx.core as mx

    from spmd_cp.models import families, gguf

    config = json.loads((__import__("pathlib").Path(model_dir) / "config.json").read_text())
    kind = config["model_type"]
    arch = {"mixtral": "llama", "qwen3_moe": "qwen3moe"}.get(kind, kind)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // heads if kind in ("phi3", "mixtral") else config["head_dim"]
    names = {v: k for k, v in gguf._TOP_LEVEL.items()}
    names.update({f"model.layers.{{}}.{v}": f"blk.{{}}.{k}"
                  for k, v in families.by_model_type(kind).layer_names().items()})
    tensors = {}
    for name, array in mx.load(f"{model_dir}/model.safetensors").items():
        base, suffix = name.rsplit(".", 1)
        parts = base.split(".")
        key = base if base in names else ".".join(parts[:2] + ["{}"] + parts[3:])
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):  # convert_hf_to_gguf's permute
            count = heads if base.endswith("q_proj") else kv_heads
            array = array.reshape(count, 2, head_dim // 2, -1).swapaxes(1, 2).reshape(array.shape)
        tensors[f"{names[key].format(*parts[2:3])}.{suffix}"] = array
    _, meta = mx.load(gguf.default_model_path(), return_metadata=True)
    meta = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    meta["general.architecture"] = arch
    a = lambda key, value: meta.__setitem__(f"{arch}.{key}", mx.array(value))  # noqa: E731
    for key, value in (("embedding_length", config["hidden_size"]),
                       ("block_count", config["num_hidden_layers"]),
                       ("feed_forward_length", config["intermediate_size"]),
                       ("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
                       ("attention.key_length", head_dim),
                       ("attention.layer_norm_rms_epsilon", config["rms_norm_eps"]),
                       ("rope.freq_base", config["rope_theta"]),
                       ("context_length", config["max_position_embeddings"]),
                       ("rope.dimension_count",
                        int(head_dim * config.get("partial_rotary_factor", 1.0)))):
        a(key, value)
    if kind in ("qwen3_moe", "mixtral"):
        a("expert_count", config.get("num_experts") or config.get("num_local_experts"))
        a("expert_used_count", config["num_experts_per_tok"])
        if kind == "qwen3_moe":
            a("expert_feed_forward_length", config["moe_intermediate_size"])
    scaling = config.get("rope_scaling")
    if scaling:
        tensors["rope_factors_long.weight"] = mx.array(scaling["long_factor"], mx.float32)
        tensors["rope_factors_short.weight"] = mx.array(scaling["short_factor"], mx.float32)
        a("rope.scaling.original_context_length", config["original_max_position_embeddings"])
    mx.save_gguf(out, tensors, meta)
    return out


def test_gguf_files_of_each_family_score_as_mlx_lm(family_models, tmp_path):
    """A GGUF file of each family, written as llama.cpp's converter lays it out, loads to
    a model whose CP scores (one rank) equal mlx-lm's on the MLX directory, and whose
    weight layout (doctor, the forecast, --shard-weights) counts every weight."""
    from mlx.utils import tree_flatten
    from mpi4py import MPI

    from spmd_cp.engine.engine import Engine
    from spmd_cp.engine.model import CPModel
    from spmd_cp.models.loader import load_model
    from spmd_cp.models.partial_load import weight_layout
    from spmd_cp.runtime.comm import Comm

    for family in ("phi3-longrope", "qwen3_moe", "mixtral"):
        path = family_models[family]
        gguf_file = write_gguf(path, str(tmp_path / f"{family}.gguf"))
        loaded = load_model(gguf_file)
        held = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
        assert weight_layout(gguf_file).replicated == weight_layout(path).replicated == held
        engine = Engine(CPModel(loaded.model), Comm(MPI.COMM_SELF), algo="pass-kv")
        _, records = engine.prefill(engine.new_cache(), prompt_ids(LENGTH, 1), score=True)
        np.testing.assert_allclose(records.logprob, reference(path, LENGTH, 1)[0],
                                   **TOLERANCE, err_msg=family)
