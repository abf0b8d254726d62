"""Every GGUF tensor type spmd-cp reads, against the gguf package (llama.cpp's own reader
and reference dequantizer): bit for bit per tensor, replicated and by rows for
--shard-weights, and a model holding all of them against mlx-lm's forward of the
reference-dequantized weights on 1 and 2 ranks. A type it does not read is refused in one
line through the CLI.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import run_cli
from gguf_files import (mlx_lm_name, random_tensor, reference_tensors, tokenizer_metadata,
                        write_gguf, write_reference_directory)
from test_gemma3 import check, run_driver

HIDDEN, FFN, LAYERS = 256, 512, 2  # K-quant rows are blocks of 256 values
# One Qwen2 (q/k/v biases, a separate head) with every type read: the 2-D tensors spread
# over them, norms and biases F32.
TYPES = {
    "token_embd": "Q4_K", "output": "Q6_K",
    "blk.0.attn_q": "Q2_K", "blk.0.attn_k": "Q3_K", "blk.0.attn_v": "Q5_K",
    "blk.0.attn_output": "IQ4_XS", "blk.0.ffn_gate": "IQ4_NL", "blk.0.ffn_up": "Q5_0",
    "blk.0.ffn_down": "Q5_1",
    "blk.1.attn_q": "BF16", "blk.1.attn_k": "F16", "blk.1.attn_v": "Q8_0",
    "blk.1.attn_output": "Q4_0", "blk.1.ffn_gate": "Q4_1", "blk.1.ffn_up": "F32",
    "blk.1.ffn_down": "Q4_K",
}  # fmt: skip
READ = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
        "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
CONFIG = {"model_type": "qwen2", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
          "intermediate_size": FFN, "num_attention_heads": 4, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-6, "vocab_size": 49152, "rope_theta": 10000.0,
          "max_position_embeddings": 4096, "tie_word_embeddings": False}


def qwen2_file(path, types: dict, seed: int = 0):
    """A random Qwen2 of ``CONFIG``'s shape with ``types`` {tensor base name: GGUF type}."""
    rng = np.random.RandomState(seed)
    heads, kv_heads = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    head_dim = HIDDEN // heads
    vocab = CONFIG["vocab_size"]
    shapes = {"token_embd": (vocab, HIDDEN), "output": (vocab, HIDDEN)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_q": (HIDDEN, HIDDEN),
                       f"blk.{i}.attn_k": (kv_heads * head_dim, HIDDEN),
                       f"blk.{i}.attn_v": (kv_heads * head_dim, HIDDEN),
                       f"blk.{i}.attn_output": (HIDDEN, HIDDEN),
                       f"blk.{i}.ffn_gate": (FFN, HIDDEN), f"blk.{i}.ffn_up": (FFN, HIDDEN),
                       f"blk.{i}.ffn_down": (HIDDEN, FFN)})
    tensors = {f"{name}.weight": (random_tensor(types[name], shape, rng), types[name])
               for name, shape in shapes.items()}
    vectors = {"output_norm.weight": HIDDEN}
    for i in range(LAYERS):
        vectors.update({f"blk.{i}.attn_norm.weight": HIDDEN, f"blk.{i}.ffn_norm.weight": HIDDEN,
                        f"blk.{i}.attn_q.bias": HIDDEN, f"blk.{i}.attn_k.bias": kv_heads * head_dim,
                        f"blk.{i}.attn_v.bias": kv_heads * head_dim})
    for name, size in vectors.items():
        low = 0.5 if "norm" in name else -0.1
        tensors[name] = (rng.uniform(low, low + 1.0 if "norm" in name else 0.2,
                                     size).astype(np.float32), "F32")
    meta = {f"qwen2.{key}": value for key, value in (
        ("context_length", CONFIG["max_position_embeddings"]), ("embedding_length", HIDDEN),
        ("block_count", LAYERS), ("feed_forward_length", FFN),
        ("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
        ("attention.layer_norm_rms_epsilon", CONFIG["rms_norm_eps"]),
        ("rope.freq_base", CONFIG["rope_theta"]))}
    meta.update(tokenizer_metadata())
    return write_gguf(path, "qwen2", meta, tensors)


@pytest.fixture(scope="module")
def every_type(tmp_path_factory) -> tuple[str, str]:
    """(the GGUF with every type, an MLX directory of its reference-dequantized weights)."""
    root = tmp_path_factory.mktemp("gguf_types")
    gguf_file = str(qwen2_file(root / "every-type.gguf", TYPES))
    return gguf_file, str(write_reference_directory(gguf_file, root / "reference", CONFIG))


def bits_of(array) -> np.ndarray:
    return np.asarray(array, dtype=np.float32).view(np.uint32)


def test_the_file_holds_every_type_read():
    assert sorted(set(TYPES.values()) | {"F32"}) == sorted(READ)


def test_every_type_loads_bit_for_bit_as_the_gguf_package_dequantizes(every_type, tmp_path,
                                                                       monkeypatch):
    """The replicated load (dequantized afresh, then from its float32 copy on disk) and
    --shard-weights' reader (whole tensors and rows [5, 37)) give each tensor's float32
    values exactly as gguf.quants.dequantize does."""
    from mlx.utils import tree_flatten

    from spmd_cp.models.gguf import dequantize_float32
    from spmd_cp.models.loader import load_model
    from spmd_cp.models.tensor_files import GGUFFile

    gguf_file, _ = every_type
    expected = {mlx_lm_name(k): v for k, v in reference_tensors(gguf_file).items()}
    monkeypatch.setenv("SPMD_CP_CACHE", str(tmp_path))
    for attempt in ("converted", "from the float32 copy"):
        held = dict(tree_flatten(load_model(gguf_file).model.parameters()))
        assert held.keys() == expected.keys(), attempt
        for name, array in expected.items():
            assert np.array_equal(bits_of(held[name]), bits_of(array)), (attempt, name)
        assert len(list((tmp_path / "weights").glob("*.safetensors"))) == 1

    files = GGUFFile(gguf_file)
    for name, array in expected.items():
        for rows in (None, (5, 37)) if array.ndim == 2 else (None,):
            part = files.read(name, rows)
            base = name[: -len(".weight")]
            got = (dequantize_float32(part[name], part[f"{base}.scales"],
                                      part[f"{base}.biases"], part[name].shape[-1] * 32 //
                                      (part[f"{base}.scales"].shape[-1] * 32))
                   if f"{base}.scales" in part else part[name])
            want = array if rows is None else array[rows[0]:rows[1]]
            assert np.array_equal(bits_of(got), bits_of(want)), (name, rows)


def test_a_model_of_every_type_matches_mlx_lm_on_one_and_two_ranks(every_type, tmp_path):
    """Scores within 1e-4 and greedy tokens of mlx-lm's qwen2 forward on the
    reference-dequantized weights: one rank whole and chunked, two ranks under every
    algorithm with decode; and the shares --shard-weights reads at N = 2 hold exactly the
    reference's weights (each rank's layers, its vocabulary rows of the embedding and
    the head)."""
    import mlx.core as mx

    from spmd_cp.models.partial_load import load_rank_share

    gguf_file, reference_dir = every_type
    def config(algo, chunk, decode=4):
        return {"algo": algo, "chunk": chunk, "length": 40, "decode": decode, "seed": 7}

    check(run_driver(1, gguf_file, [config("auto", 0), config("pass-q", 13, 0)], tmp_path,
                     ("auto", "no-weight-cache")), reference_dir, 1)
    check(run_driver(2, gguf_file, [config(a, 0) for a in ("pass-kv", "pass-q",
                                                           "allgather-kv", "auto")],
                     tmp_path, ("auto", "no-weight-cache")), reference_dir, 2)

    expected = {k: np.array(v) for k, v in
                mx.load(f"{reference_dir}/model.safetensors").items()}
    for rank in range(2):
        share = load_rank_share(gguf_file, rank, 2).share
        a, b = share.vocab_rows
        for index, packed in share.layers.items():
            assert index % 2 == rank
            for name, array in share.form.convert(packed).items():
                full = f"model.layers.{index}.{name}"
                assert np.array_equal(bits_of(array), bits_of(expected[full])), full
        sharded = load_rank_share(gguf_file, rank, 2).model
        for name, module in (("model.embed_tokens.weight", sharded.model.embed_tokens),
                             ("lm_head.weight", sharded.lm_head)):
            assert np.array_equal(bits_of(module.weight), bits_of(expected[name][a:b])), name


def test_files_mlx_can_read_load_the_same_by_tensor(embedded_model):
    """The embedded Q4_1 file, read by MLX's GGUF reader (as always) and tensor by tensor
    (how a file with other types is read): the same float32 weights bit for bit; decode's
    packed forms are the file's blocks (the Q4_1 layers, the Q8_0 embedding), which the
    gguf package dequantizes to those float32 weights bit for bit."""
    import gguf as gguf_package
    from mlx.utils import tree_flatten

    from spmd_cp.models import gguf

    by_mx_load = dict(tree_flatten(gguf.load_gguf(embedded_model)[0].parameters()))
    by_tensor = dict(tree_flatten(gguf._load_by_tensor(embedded_model, False, None)[0]
                                  .parameters()))
    assert by_mx_load.keys() == by_tensor.keys()
    for name, array in by_mx_load.items():
        assert np.array_equal(bits_of(array), bits_of(by_tensor[name])), name
    del by_tensor
    packed = gguf.packed_weights(embedded_model)
    assert len(packed) == 30 * 7 + 1
    for name, blocks in packed.items():
        values = gguf_package.quants.dequantize(np.asarray(blocks.data), blocks.kind)
        assert np.array_equal(bits_of(values), bits_of(by_mx_load[name])), name


def test_a_type_not_read_is_refused_in_one_line(tmp_path):
    """IQ2_XXS in one matrix: every rank stops before loading, with one line naming the
    tensor, its type and the types read; TQ1_0 likewise by the check itself."""
    from spmd_cp.models import gguf_types

    types = {**TYPES, "blk.0.ffn_down": "IQ2_XXS"}
    path = str(qwen2_file(tmp_path / "iq2.gguf", types))
    result = run_cli(2, ["generate", "--model", path, "--prompt", "Hi", "--max-tokens", "2"],
                     check=False, timeout=120)
    assert result.returncode != 0
    expected = (f"spmd-cp: error: cannot load model {path}: tensor blk.0.ffn_down.weight has "
                f"GGUF type IQ2_XXS, which spmd-cp does not read (it reads: {', '.join(READ)})")
    lines = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert lines and set(lines) == {expected}, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "loaded in" not in result.stderr
    assert gguf_types.refusal([("a.weight", 12), ("blk.3.ffn_up.weight", 34)]) == (
        f"tensor blk.3.ffn_up.weight has GGUF type TQ1_0, which spmd-cp does not read "
        f"(it reads: {', '.join(READ)})")
    assert gguf_types.READ == READ
