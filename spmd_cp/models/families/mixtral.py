"""Mixtral: Llama's attention and a router over stacked experts under
``block_sparse_moe``; llama.cpp writes it as ``llama`` with expert tensors."""

from .family import Family, experts_names


def gguf_config(a, config: dict, tensors: dict) -> dict:
    return {"num_local_experts": a("expert_count"), "num_experts_per_tok": a("expert_used_count")}


FAMILY = Family(name="Mixtral", model_types=("mixtral",), mlx_module="mixtral", mlp=None,
                gguf_arch="llama", gguf_tensor="blk.0.ffn_gate_exps.weight",
                gguf_layer_names=experts_names("block_sparse_moe"),
                feed_forward="block_sparse_moe", gguf_rope_traditional=True,
                head_dim_from_width=True, gguf_config=gguf_config)
