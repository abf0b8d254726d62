"""Qwen3-MoE: Qwen3's attention and a router over stacked experts under ``mlp`` (a layer
without a router is a dense MLP)."""

from .family import Family, experts_names


def gguf_config(a, config: dict, tensors: dict) -> dict:
    """Its expert counts and widths (llama.cpp normalizes the chosen experts' weights)."""
    width = a("expert_feed_forward_length")
    dense = [i for i in range(a("block_count")) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    return {"num_experts": a("expert_count"), "num_experts_per_tok": a("expert_used_count"),
            "moe_intermediate_size": width, "decoder_sparse_step": 1,
            "mlp_only_layers": dense, "norm_topk_prob": True,
            "intermediate_size": a("feed_forward_length") or width}


def mlp_width(c: dict) -> int:
    """Its chosen experts' widths together, or a dense layer's where that is wider (some
    layers may be dense: mlx-lm's rule)."""
    dense = c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1
    dense = c["intermediate_size"] if dense else 0
    return max(dense, (c.get("num_experts_per_tok") or 0) * c["moe_intermediate_size"])


FAMILY = Family(name="Qwen3-MoE", model_types=("qwen3_moe",), mlx_module="qwen3_moe",
                mlp="swiglu", gguf_arch="qwen3moe", gguf_layer_names=experts_names("mlp"),
                gguf_config=gguf_config, mlp_width=mlp_width)
