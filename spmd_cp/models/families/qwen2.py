"""Qwen2 / Qwen2.5: Llama's layers with q/k/v biases (config ``attention_bias``)."""

from .family import Family

FAMILY = Family(name="Qwen2", model_types=("qwen2",), mlx_module="qwen2", mlp="swiglu",
                gguf_arch="qwen2")
