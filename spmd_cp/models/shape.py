"""What the rest of spmd-cp needs to know of a model: its architecture family and sizes."""

from __future__ import annotations

from dataclasses import dataclass

# Architectures whose layers the CP forward pass (engine/model.py) reproduces exactly
# (mlx-lm model_type names).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "qwen3_moe", "mixtral",
                         "gemma3_text", "gemma3")
# Of those, the families whose sliding-window layers the CP attention runs (a window in
# another family's config is refused: models/loader.py).
SLIDING_WINDOW_MODEL_TYPES = ("gemma3_text", "gemma3")

# Families whose mlx-lm attention takes head_dim = hidden_size / heads, whatever the config says.
HEAD_DIM_FROM_WIDTH = ("phi3", "mixtral")


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
    # The sliding window of a model's local layers (attention/window.py), None without,
    # and how many of the layers are local (mlx-lm's rule: all but every pattern-th).
    window: int | None = None
    local_layers: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        kv = self.kv_elem_bytes or self.elem_bytes
        return 2 * self.layers * self.num_kv_heads * self.head_dim * kv


def shape_of_config(c: dict) -> ModelShape:
    """The shape mlx-lm builds from an HF-style config. ``intermediate`` is the MLP width
    one row passes through: for a mixture of experts its experts' widths together
    (``num_experts_per_tok`` of them), or a dense layer's where that is wider."""
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim")
    if not head_dim or c.get("model_type") in HEAD_DIM_FROM_WIDTH:
        head_dim = c["hidden_size"] // heads
    intermediate = c["intermediate_size"]
    per_token = c.get("num_experts_per_tok") or 0
    if c.get("model_type") == "qwen3_moe":  # some layers may be dense (mlx-lm's rule)
        dense = c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1
        dense = intermediate if dense else 0
        intermediate = max(dense, per_token * c["moe_intermediate_size"])
    elif per_token:  # mixtral: every layer's experts are intermediate_size wide
        intermediate *= per_token
    window = c.get("sliding_window") if c.get("model_type") in SLIDING_WINDOW_MODEL_TYPES \
        else None
    pattern = c.get("sliding_window_pattern") or 0
    local = c["num_hidden_layers"] - c["num_hidden_layers"] // pattern if window and pattern \
        else 0
    return ModelShape(layers=c["num_hidden_layers"], hidden=c["hidden_size"],
                      intermediate=intermediate, num_heads=heads,
                      num_kv_heads=c.get("num_key_value_heads") or heads, head_dim=head_dim,
                      vocab=c["vocab_size"],
                      window=window, local_layers=local)
