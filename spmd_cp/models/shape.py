"""What the rest of spmd-cp needs to know of a model: its architecture family and sizes."""

from __future__ import annotations

from dataclasses import dataclass

# Architectures whose layers the CP forward pass (engine/model.py) reproduces exactly
# (mlx-lm model_type names).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")
# Of those, the families whose sliding-window layers the CP attention runs (a window in
# another family's config is refused: models/loader.py).
SLIDING_WINDOW_MODEL_TYPES = ("gemma3_text", "gemma3")


@dataclass
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    elem_bytes: int = 4
    # The sliding window of a model's local layers (attention/window.py), None without.
    # It bounds what a rank receives per layer, not its KV cache: every key is kept.
    window: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.num_kv_heads * self.head_dim * self.elem_bytes
