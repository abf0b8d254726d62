"""Phi-3: q|k|v fused into one matrix and gate|up into another; a head rotated in part,
and long-context RoPE factors (mlx-lm's SuScaledRoPE) carried as GGUF tensors."""

from .family import Family

FAMILY = Family(name="Phi-3", model_types=("phi3",), mlx_module="phi3", mlp="fused_swiglu",
                gguf_arch="phi3",
                gguf_layer_names={"attn_qkv": "self_attn.qkv_proj",
                                  "ffn_up": "mlp.gate_up_proj"},
                gguf_rope_factors=True, head_dim_from_width=True)
