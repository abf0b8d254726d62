"""What the rest of spmd-cp needs to know of a model: its architecture family and sizes."""

from __future__ import annotations

from dataclasses import dataclass

from . import families

# Architectures whose layers the CP forward pass (engine/model.py) reproduces exactly
# (mlx-lm model_type names; models/families).
SUPPORTED_MODEL_TYPES = families.SUPPORTED_MODEL_TYPES
# Of those, the families whose sliding-window layers the CP attention runs (a window in
# another family's config is refused: models/loader.py).
SLIDING_WINDOW_MODEL_TYPES = tuple(t for f in families.FAMILIES if f.sliding_windows
                                   for t in f.model_types)


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
    family = families.by_model_type(c.get("model_type"))
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim")
    if not head_dim or (family and family.head_dim_from_width):
        head_dim = c["hidden_size"] // heads
    intermediate = (family.mlp_width if family else families.family.mlp_width)(c)
    window = c.get("sliding_window") if family and family.sliding_windows else None
    pattern = c.get("sliding_window_pattern") or 0
    local = c["num_hidden_layers"] - c["num_hidden_layers"] // pattern if window and pattern \
        else 0
    return ModelShape(layers=c["num_hidden_layers"], hidden=c["hidden_size"],
                      intermediate=intermediate, num_heads=heads,
                      num_kv_heads=c.get("num_key_value_heads") or heads, head_dim=head_dim,
                      vocab=c["vocab_size"],
                      window=window, local_layers=local)
