"""The model a GGUF file describes: its architecture's mlx-lm module and the HF-style config
(mlx-lm ModelArgs keys) its metadata and tensor names give, with what llama.cpp takes as
fixed rather than from the file (Gemma 3's windows and scales). Reading the weights is
gguf.py's; this module reads no tensor data.
"""

from __future__ import annotations

import importlib

from . import families
from .gguf_tokenizer import meta_value as _value


def model_module(model_type: str):
    """mlx-lm's module for a GGUF file's model_type (``gguf_config``'s)."""
    return importlib.import_module(f"mlx_lm.models.{families.by_model_type(model_type).mlx_module}")


def gguf_config(meta: dict, tensors: dict) -> dict:
    """The HF-style config dict (mlx-lm ModelArgs keys) described by the GGUF metadata."""
    arch = _value(meta, "general.architecture")
    family = families.of_gguf(arch, tensors)
    a = lambda key, default=None: _value(meta, f"{arch}.{key}", default)  # noqa: E731
    model_type = family.model_types[0]
    heads = a("attention.head_count")
    head_dim = a("attention.key_length") or a("embedding_length") // heads
    config = {
        "model_type": model_type,
        "hidden_size": a("embedding_length"),
        "num_hidden_layers": a("block_count"),
        "intermediate_size": a("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": a("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": a("attention.layer_norm_rms_epsilon"),
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "rope_theta": a("rope.freq_base", 10000.0),
        # convert_hf_to_gguf.py permutes llama Q/K rows into the interleaved RoPE layout
        # (verified: gives correct text). It does not permute qwen2/qwen3/phi3 (llama.cpp
        # runs them with NEOX RoPE), so those keep the half-split layout.
        "rope_traditional": family.gguf_rope_traditional,
        "max_position_embeddings": a("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    config.update(_rope_config(family, a, tensors, head_dim))
    if family.gguf_config is not None:
        config.update(family.gguf_config(a, config, tensors))
    return config


def _rope_config(family, a, tensors: dict, head_dim: int) -> dict:
    """RoPE scaling and partial rotation; refuses what we would silently get wrong rather
    than produce plausible garbage. Phi-3 may rotate part of each head and carry its
    long-context factors as tensors (mlx-lm's SuScaledRoPE)."""
    scaling = a("rope.scaling.type", "none")
    phi3_long = family.gguf_rope_factors and "rope_factors_long.weight" in tensors
    if "rope_freqs.weight" in tensors or (scaling not in ("none", "linear") and not phi3_long):
        raise ValueError(f"GGUF RoPE scaling {scaling!r} / rope_freqs is not supported")
    rotated = a("rope.dimension_count", head_dim)
    if rotated != head_dim and not family.gguf_rope_factors:
        raise ValueError("GGUF partial rotary embeddings are not supported")
    config = {"partial_rotary_factor": rotated / head_dim} if rotated != head_dim else {}
    if phi3_long:
        config["rope_scaling"] = {
            "type": "longrope", "long_factor": tensors["rope_factors_long.weight"].tolist(),
            "short_factor": tensors["rope_factors_short.weight"].tolist()}
        config["original_max_position_embeddings"] = a("rope.scaling.original_context_length")
    elif scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": a("rope.scaling.factor")}
    return config


def model_type_of(arch: str, tensor_names) -> str:
    """mlx-lm's model_type for a GGUF architecture (llama.cpp writes Mixtral as ``llama``
    with experts: models/families)."""
    return families.of_gguf(arch, tensor_names).model_types[0]
