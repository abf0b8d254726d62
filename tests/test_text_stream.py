"""The answer's text as it streams (engine/generation.py's TextStream), in one process with
real tokenizers: the embedded SmolLM2's byte-level BPE and a SentencePiece-style one with
byte fallback. Reference: the tokenizer decoding the whole token list at once."""

from __future__ import annotations

import random

import pytest

from spmd_cp.engine.generation import TextStream

TEXT = ("Grüße aus Köln: 日本語のテキスト, emoji 🙂🚀, naïve café. Ελληνικά και русский. "
        "The quick brown fox jumps over the lazy dog. ")


@pytest.fixture(scope="module")
def smollm2():
    import mlx.core as mx

    from spmd_cp.models.gguf import build_tokenizer, default_model_path

    _, meta = mx.load(default_model_path(), return_metadata=True)
    return build_tokenizer(meta)


@pytest.fixture(scope="module")
def byte_fallback():
    """Llama 2's layout in miniature: "▁" for spaces, the first space stripped on decode,
    every character outside the vocabulary as its UTF-8 bytes (<0xE6> ...)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyzTG.,:üöé", "▁the", "▁qu"]:
        vocab.setdefault(piece, len(vocab))
    model = models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>")
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def answer_ids(tokenizer, length: int, seed: int, noise: bool = True) -> list[int]:
    """``length`` token ids: pieces of multilingual text, with ``noise`` runs of random
    ids between (bytes that split characters or form none), and a last token that
    completes its text. (A byte-fallback decoder turns every byte of a run that is not
    UTF-8 into U+FFFD, characters already complete included: no stream can show that
    before the run ends, so its answers hold whole characters.)"""
    rng = random.Random(seed)
    text_ids = tokenizer.encode(TEXT * 40, add_special_tokens=False)
    if not noise:  # the text as it is: whole characters, about ``length`` tokens of it
        one = tokenizer.encode(TEXT, add_special_tokens=False)
        return one * max(1, round(length / len(one)))
    ids = []
    while len(ids) < length - 1:
        start = rng.randrange(len(text_ids) - 40)
        ids += text_ids[start:start + rng.randrange(5, 40)]
        if noise:
            ids += [rng.randrange(3, 300) for _ in range(rng.randrange(0, 4))]
    return ids[:length - 1] + tokenizer.encode(" fox", add_special_tokens=False)[-1:]


def streamed(tokenizer, ids: list[int], stop=()) -> tuple[str, str, int | None]:
    """(the text written piece by piece, the stream's final text, the token a stop
    string ended it at) for an answer of ``ids``, fed as Answer feeds it."""
    pieces = []
    stream = TextStream(tokenizer, list(stop), pieces.append)
    stopped_at = None
    for count in range(1, len(ids) + 1):
        if stream.push(ids[:count]):
            stopped_at = count
            break
    stream.finish()
    return "".join(pieces), stream.text, stopped_at


@pytest.mark.parametrize("name", ["smollm2", "byte_fallback"])
def test_the_streamed_text_of_a_long_answer_is_its_whole_decode(request, name):
    tokenizer = request.getfixturevalue(name)
    for seed in range(3):
        ids = answer_ids(tokenizer, 1500, seed, noise=name == "smollm2")
        expected = tokenizer.decode(ids)
        # bytes that form no character; each of 日本語 split over byte tokens
        assert "\ufffd" in expected if name == "smollm2" else "語" in expected
        written, text, stopped_at = streamed(tokenizer, ids)
        assert stopped_at is None and written == text == expected


def whole_decode_stream(tokenizer, ids, stop):
    """What a stream that decodes the whole list at every token finds: the first token
    whose text holds a stop string, and the text up to it."""
    for count in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:count])
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            return count, text[:min(hits)]
    return None, tokenizer.decode(ids)


@pytest.mark.parametrize("name", ["smollm2", "byte_fallback"])
@pytest.mark.parametrize("stop", [["Köln"], ["fox jumps", "語の"], ["🚀"], [". Ε", "zzz"]])
def test_stop_strings_end_the_answer_where_the_whole_decode_holds_them(request, name, stop):
    tokenizer = request.getfixturevalue(name)
    ids = answer_ids(tokenizer, 400, seed=11, noise=name == "smollm2")
    written, text, stopped_at = streamed(tokenizer, ids, stop)
    expected_at, expected = whole_decode_stream(tokenizer, ids, stop)
    assert (stopped_at, text) == (expected_at, expected) and written == text
    assert expected_at is not None


@pytest.mark.parametrize("name", ["smollm2", "byte_fallback"])
def test_an_answer_cut_inside_a_character_drops_the_incomplete_bytes(request, name):
    """max_tokens reached between the tokens of one character: no U+FFFD at the end."""
    tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode("Grüße 日本", add_special_tokens=False)
    cuts = [n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd")]
    assert cuts  # the model's tokens split 日 or 本
    for n in cuts:
        written, text, _ = streamed(tokenizer, ids[:n])
        if name == "smollm2":  # bytes decoded at once: the incomplete ones are the U+FFFDs
            expected = tokenizer.decode(ids[:n]).rstrip("\ufffd")
        else:  # a byte run that is not UTF-8 is all U+FFFD: the tokens up to its last character
            expected = tokenizer.decode(ids[:max(k for k in range(n) if k not in cuts)])
        assert text == written == expected and not text.endswith("\ufffd")


def test_streaming_decodes_a_few_tokens_per_token_not_the_whole_answer(smollm2):
    """Linear in the answer's length: the tokens decoded over a 4,000-token answer stay
    within a few per token (decoding the whole answer at each token: 8 million)."""
    ids = answer_ids(smollm2, 4000, seed=5)
    decoded = []

    class Counting:
        def decode(self, tokens):
            decoded.append(len(tokens))
            return smollm2.decode(tokens)

    written, text, _ = streamed(Counting(), ids)
    assert written == text == smollm2.decode(ids)
    assert sum(decoded) < 40 * len(ids), sum(decoded)
