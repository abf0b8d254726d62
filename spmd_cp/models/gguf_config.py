"""The model a GGUF file describes: its architecture's mlx-lm module and the HF-style config
(mlx-lm ModelArgs keys) its metadata and tensor names give, with what llama.cpp takes as
fixed rather than from the file (Gemma 3's windows and scales). Reading the weights is
gguf.py's; this module reads no tensor data.
"""

from __future__ import annotations

import importlib

from mlx_lm.models import gemma3_text, llama, phi3, qwen2, qwen3, qwen3_moe

from .gguf_tokenizer import meta_value as _value

ARCHITECTURES = {"llama": llama, "qwen2": qwen2, "qwen3": qwen3, "phi3": phi3,
                 "qwen3moe": qwen3_moe, "gemma3": gemma3_text}

# What llama.cpp's gemma3 takes as fixed rather than from the file (llama-model.cpp):
# every sixth layer global, the local layers' RoPE base 10000 unscaled, and the query
# scale 1/sqrt(head_dim), except in the 62-layer (27B) model: 1/sqrt(hidden / heads).
GEMMA3_PATTERN, GEMMA3_LOCAL_ROPE_BASE, GEMMA3_27B_LAYERS = 6, 10_000.0, 62


def check_architecture(arch: str):
    """The mlx-lm model module for a GGUF `general.architecture`, or a ValueError."""
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[arch]


def model_module(model_type: str):
    """mlx-lm's module for a model_type (``gguf_config``'s)."""
    return importlib.import_module(f"mlx_lm.models.{model_type}")


def gguf_config(meta: dict, tensors: dict) -> dict:
    """The HF-style config dict (mlx-lm ModelArgs keys) described by the GGUF metadata."""
    arch = _value(meta, "general.architecture")
    check_architecture(arch)
    a = lambda key, default=None: _value(meta, f"{arch}.{key}", default)  # noqa: E731
    model_type = model_type_of(arch, tensors)
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
        "rope_traditional": arch == "llama",
        "max_position_embeddings": a("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    config.update(_rope_config(arch, a, tensors, head_dim))
    config.update(_experts_config(model_type, a, tensors))
    if model_type == "gemma3_text":
        config.update(_gemma3_config(a, config))
    return config


def _gemma3_config(a, config: dict) -> dict:
    """Gemma 3's windows, local RoPE base and query scale, as llama.cpp reads the file
    (``GEMMA3_PATTERN``); a file without ``attention.sliding_window`` has no local layers.
    The linear RoPE scaling of the file applies to the global layers only, in llama.cpp
    and in mlx-lm's module alike."""
    if a("final_logit_softcapping"):
        raise ValueError("GGUF gemma3 final_logit_softcapping is not supported "
                         "(mlx-lm's Gemma 3 has none)")
    window = a("attention.sliding_window") or None
    wide = config["num_hidden_layers"] == GEMMA3_27B_LAYERS
    return {"sliding_window": window,
            "sliding_window_pattern": GEMMA3_PATTERN if window else 1,
            "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
            "query_pre_attn_scalar": (config["hidden_size"] // config["num_attention_heads"]
                                      if wide else config["head_dim"])}


def _rope_config(arch: str, a, tensors: dict, head_dim: int) -> dict:
    """RoPE scaling and partial rotation; refuses what we would silently get wrong rather
    than produce plausible garbage. Phi-3 may rotate part of each head and carry its
    long-context factors as tensors (mlx-lm's SuScaledRoPE)."""
    scaling = a("rope.scaling.type", "none")
    phi3_long = arch == "phi3" and "rope_factors_long.weight" in tensors
    if "rope_freqs.weight" in tensors or (scaling not in ("none", "linear") and not phi3_long):
        raise ValueError(f"GGUF RoPE scaling {scaling!r} / rope_freqs is not supported")
    rotated = a("rope.dimension_count", head_dim)
    if rotated != head_dim and arch != "phi3":
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


def _experts_config(model_type: str, a, tensors: dict) -> dict:
    """A mixture's expert counts and widths (llama.cpp's Qwen3-MoE normalizes the chosen
    experts' weights; a layer without a router is a dense MLP)."""
    if model_type == "qwen3_moe":
        width = a("expert_feed_forward_length")
        dense = [i for i in range(a("block_count"))
                 if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
        return {"num_experts": a("expert_count"), "num_experts_per_tok": a("expert_used_count"),
                "moe_intermediate_size": width, "decoder_sparse_step": 1,
                "mlp_only_layers": dense, "norm_topk_prob": True,
                "intermediate_size": a("feed_forward_length") or width}
    if model_type == "mixtral":
        return {"num_local_experts": a("expert_count"),
                "num_experts_per_tok": a("expert_used_count")}
    return {}


def model_type_of(arch: str, tensor_names) -> str:
    """mlx-lm's model_type for a GGUF architecture: llama.cpp writes Mixtral as ``llama``
    with experts."""
    if arch == "llama" and "blk.0.ffn_gate_exps.weight" in tensor_names:
        return "mixtral"
    return {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}.get(arch, arch)
