"""The tokenizer a GGUF file's metadata describes, rebuilt as a Hugging Face fast tokenizer
and wrapped for mlx-lm (local data only).

Two vocabularies: byte-level BPE (``tokenizer.ggml.model`` "gpt2": SmolLM2, Qwen,
Llama 3), built here from the tokens, merges and pre-tokenizer type; and Gemma's
SentencePiece-style BPE ("llama" in a ``gemma3`` file: tokens in merge order, no merges,
byte fallback), which transformers' own GGUF converter rebuilds (its ``gemma_tokenizer``
recovers the merges from the token order, as Gemma's tokenizer needs).

Building one is slow for a large vocabulary (Gemma 3's 262,144 tokens: 6.5 s to recover
the merges, 2.6 s for transformers to copy the result, on a 2-core EPYC), and every rank
of every run would pay it. The built tokenizer is kept as a tokenizer.json in the cache
directory, keyed by a hash of the file's tokenizer metadata, and later runs read that
(``tokenizers``' own format, exact by construction); where the cache cannot be written
the tokenizer is used as built.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from functools import partial
from pathlib import Path

from mlx_lm.tokenizer_utils import (BPEStreamingDetokenizer, SPMStreamingDetokenizer,
                                    TokenizerWrapper)
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers as pre

from . import families

# Split regexes of the HF tokenizers these GGUF pre-tokenizer types stand for (the same as
# llama.cpp's). Qwen2 cuts numbers into single digits, Llama 3 into groups of up to three.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
PRE_TOKENIZER_TYPES = ("gpt2", "smollm", "qwen2", "llama-bpe")
# Architectures whose SentencePiece vocabulary ("llama") is read: Gemma's (models/families).
SENTENCEPIECE_ARCHITECTURES = tuple(f.gguf_arch for f in families.FAMILIES
                                    if f.sentencepiece_vocab)
# Part of the cache key: a change to how a tokenizer is built here must change it.
BUILD_VERSION = 1
log = logging.getLogger("spmd_cp")


def meta_value(meta: dict, key: str, default=None):
    """A metadata value as a Python object (mx.load gives numbers as 0-d arrays)."""
    v = meta.get(key, default)
    return v.item() if getattr(v, "ndim", None) == 0 else v


def _pre_tokenizer(pre_type: str):
    """The pre-tokenizer for `tokenizer.ggml.pre`, or a ValueError for unknown ones."""
    byte_level = pre.ByteLevel(add_prefix_space=False, use_regex=True)  # the GPT-2 regex
    if pre_type == "gpt2":
        return byte_level
    if pre_type == "smollm":  # SmolLM's HF tokenizer: single digits, then GPT-2
        return pre.Sequence([pre.Digits(individual_digits=True), byte_level])
    if pre_type in ("qwen2", "llama-bpe"):
        split = _QWEN2_SPLIT if pre_type == "qwen2" else _LLAMA3_SPLIT
        return pre.Sequence([pre.Split(Regex(split), behavior="isolated"),
                             pre.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise ValueError(f"unsupported GGUF tokenizer pre-type {pre_type!r} "
                     f"(supported: {', '.join(PRE_TOKENIZER_TYPES)})")


def build_tokenizer(meta: dict) -> TokenizerWrapper:
    """The tokenizer stored in the GGUF metadata, wrapped for mlx-lm: read from the cache
    when an earlier run built it, else built (and kept there)."""
    kind = meta_value(meta, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2; "
                         f"llama in {', '.join(SENTENCEPIECE_ARCHITECTURES)} files)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    kept = _cache_path(meta)
    if kept.is_file():
        try:
            return _wrap({"tokenizer_file": str(kept)}, meta, tokens)
        except Exception as error:  # noqa: BLE001 - a damaged copy: build it again
            log.debug("tokenizer cache %s unreadable (%s): rebuilding", kept, error)
    tok = _byte_level_bpe(meta) if kind == "gpt2" else _sentencepiece_bpe(meta)
    # Read back from the file where it could be kept: transformers deep-copies an object.
    written = _keep(tok, kept)
    return _wrap({"tokenizer_file": str(written)} if written else {"tokenizer_object": tok},
                 meta, tokens)


def _cache_path(meta: dict) -> Path:
    """Where the tokenizer of this metadata is kept: a hash of every tokenizer field (and
    the architecture, which selects the builder)."""
    from ..runtime.paths import cache_dir

    digest = hashlib.sha256(str(BUILD_VERSION).encode())
    for key in sorted(k for k in meta if k.startswith("tokenizer.")) + \
            ["general.architecture"]:
        value = _as_list(meta_value(meta, key))
        digest.update(json.dumps([key, value], default=str).encode())
    return cache_dir() / "tokenizers" / f"{digest.hexdigest()}.json"


def _keep(tok: Tokenizer, path: Path) -> Path | None:
    """Write ``tok`` to ``path`` atomically (ranks on one host may race); the path, or
    None where it cannot be written (the tokenizer is then used as built)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(tmp))
        os.replace(tmp, path)
        return path
    except OSError as error:
        log.debug("tokenizer not cached (%s)", error)
        tmp.unlink(missing_ok=True)
        return None


def _byte_level_bpe(meta: dict) -> Tokenizer:
    pre_type = meta_value(meta, "tokenizer.ggml.pre", "gpt2")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    # Llama 3's HF tokenizer takes a whole word from the vocabulary before trying merges.
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                     ignore_merges=pre_type == "llama-bpe")
    tok = Tokenizer(bpe)
    if pre_type == "qwen2":
        tok.normalizer = normalizers.NFC()  # as in Qwen2's HF tokenizer.json
    tok.pre_tokenizer = _pre_tokenizer(pre_type)
    tok.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens are matched whole in the text, so that
    # "<|im_start|>" is one id; only control tokens are skipped by skip_special_tokens.
    types = _as_list(meta["tokenizer.ggml.token_type"])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == 4])
    return tok


def _sentencepiece_bpe(meta: dict) -> Tokenizer:
    """Gemma's vocabulary through transformers' GGUF converter (control tokens special,
    user-defined ones matched whole, as llama.cpp does)."""
    arch = meta_value(meta, "general.architecture")
    if arch not in SENTENCEPIECE_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF tokenizer: a SentencePiece vocabulary ('llama') "
                         f"is read for {', '.join(SENTENCEPIECE_ARCHITECTURES)} files, "
                         f"not {arch!r}")
    try:
        from transformers.integrations.gguf import gguf_tokenizer_mapping as converter
    except ImportError as error:
        raise ValueError(f"this GGUF's SentencePiece tokenizer needs transformers' GGUF "
                         f"tokenizer converter, which the installed transformers lacks "
                         f"({error})") from None
    fields = {name: _as_list(meta[f"tokenizer.{key}"])
              for key, name in converter.GGUF_TOKENIZER_MAPPING["tokenizer"].items()
              if f"tokenizer.{key}" in meta}
    return converter.convert_gguf_tokenizer(arch, fields)[0]


def _as_list(value):
    return value.tolist() if hasattr(value, "tolist") else value


def _detokenizer(tok: Tokenizer):
    """mlx-lm's streaming detokenizer for the tokenizer's decoder, chosen as mlx-lm's
    own loader chooses it from a tokenizer.json."""
    from mlx_lm import tokenizer_utils as mlx_lm_tokenizers

    decoder = json.loads(tok.decoder.__getstate__()) if tok.decoder is not None else None
    if mlx_lm_tokenizers._is_spm_decoder(decoder):
        return SPMStreamingDetokenizer
    if mlx_lm_tokenizers._is_spm_decoder_no_space(decoder):
        return partial(SPMStreamingDetokenizer, trim_space=False)
    return BPEStreamingDetokenizer


def _wrap(source: dict, meta: dict, tokens: list) -> TokenizerWrapper:
    """HF fast tokenizer + mlx-lm wrapper, with the special tokens and BOS policy of the
    file. ``source``: transformers' ``tokenizer_file`` or ``tokenizer_object``."""
    from transformers import PreTrainedTokenizerFast  # slow import, only needed here

    ids = {k: meta_value(meta, f"tokenizer.ggml.{k}_token_id")
           for k in ("bos", "eos", "unknown", "padding")}
    named = lambda k: tokens[ids[k]] if ids[k] is not None else None  # noqa: E731
    # llama.cpp adds BOS unless the file says not to (SmolLM2 says not to).
    add_bos = (bool(meta_value(meta, "tokenizer.ggml.add_bos_token", True))
               and ids["bos"] is not None)
    hf = PreTrainedTokenizerFast(
        **source, bos_token=named("bos"), eos_token=named("eos"),
        unk_token=named("unknown"), pad_token=named("padding"), add_bos_token=add_bos,
        add_eos_token=False, chat_template=meta_value(meta, "tokenizer.chat_template"))
    eos = [ids["eos"]] if ids["eos"] is not None else []
    return TokenizerWrapper(hf, _detokenizer(hf.backend_tokenizer), eos_token_ids=eos)
