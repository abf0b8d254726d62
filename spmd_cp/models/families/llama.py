"""Llama (1 to 3.x) and the models written as it: separate q/k/v and gate/up, SwiGLU."""

from .family import Family

FAMILY = Family(name="Llama", model_types=("llama",), mlx_module="llama", mlp="swiglu",
                gguf_arch="llama", gguf_rope_traditional=True)
