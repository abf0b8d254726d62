"""What the rest of spmd-cp needs to know of a model: its architecture family and sizes."""

from __future__ import annotations

from dataclasses import dataclass

# Architectures whose layers the CP forward pass (engine/model.py) reproduces exactly
# (mlx-lm model_type names).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    elem_bytes: int = 4  # the activations' element size
    kv_elem_bytes: int | None = None  # the KV cache's (None: elem_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        kv = self.kv_elem_bytes or self.elem_bytes
        return 2 * self.layers * self.num_kv_heads * self.head_dim * kv
