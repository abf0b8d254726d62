"""Gemma 3 (text, and a multimodal checkpoint's language model): sliding-window local
layers and a global one every sixth, norms around each sublayer that compute x (1 + w),
a GELU MLP, a SentencePiece vocabulary in GGUF files."""

from .family import Family

# What llama.cpp's gemma3 takes as fixed rather than from the file (llama-model.cpp):
# every sixth layer global, the local layers' RoPE base 10000 unscaled, and the query
# scale 1/sqrt(head_dim), except in the 62-layer (27B) model: 1/sqrt(hidden / heads).
GEMMA3_PATTERN, GEMMA3_LOCAL_ROPE_BASE, GEMMA3_27B_LAYERS = 6, 10_000.0, 62


def gguf_config(a, config: dict, tensors: dict) -> dict:
    """Its windows, local RoPE base and query scale, as llama.cpp reads the file
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


FAMILY = Family(name="Gemma 3", model_types=("gemma3_text", "gemma3"),
                mlx_module="gemma3_text", mlp="gelu", gguf_arch="gemma3",
                # llama.cpp's ffn_norm is Gemma's pre-feed-forward norm.
                gguf_layer_names={"post_attention_norm": "post_attention_layernorm",
                                  "ffn_norm": "pre_feedforward_layernorm",
                                  "post_ffw_norm": "post_feedforward_layernorm"},
                norms_plus_one=True, sliding_windows=True, sentencepiece_vocab=True,
                gguf_config=gguf_config)
