"""Qwen3: Llama's layers with per-head q and k norms (attn_q_norm, attn_k_norm)."""

from .family import Family

FAMILY = Family(name="Qwen3", model_types=("qwen3",), mlx_module="qwen3", mlp="swiglu",
                gguf_arch="qwen3")
