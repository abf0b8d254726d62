"""``Family``: the facts that set one model family apart (one module per family)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

# llama.cpp's per-layer tensor names (blk.N.<name>) that every family shares, as mlx-lm's
# module paths under model.layers.N; a family's ``gguf_layer_names`` add or replace some.
COMMON_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip


def experts_names(feed_forward: str) -> dict:
    """A mixture's router and stacked experts (experts, out, in) under the layer's
    feed-forward module ``feed_forward`` (mlx-lm's name for it)."""
    return {"ffn_gate_inp": f"{feed_forward}.gate",
            "ffn_gate_exps": f"{feed_forward}.switch_mlp.gate_proj",
            "ffn_up_exps": f"{feed_forward}.switch_mlp.up_proj",
            "ffn_down_exps": f"{feed_forward}.switch_mlp.down_proj"}


def mlp_width(config: dict) -> int:
    """The MLP width one row passes through (a mixture: its chosen experts' together)."""
    return config["intermediate_size"] * (config.get("num_experts_per_tok") or 1)


@dataclass(frozen=True)
class Family:
    """One family: how its configs, GGUF files and layers differ from Llama's."""

    name: str
    # Config ``model_type`` values mlx-lm builds it from; the first is what a GGUF file of
    # the family becomes.
    model_types: tuple[str, ...]
    mlx_module: str  # mlx-lm's module (mlx_lm.models.<it>) for a GGUF file's model
    # The form of the dense MLP class (``MLP``) in mlx-lm's module: "swiglu", "fused_swiglu"
    # (gate|up one matrix: down(swiglu)), "gelu" (down(gelu_approx(gate) * up)); None:
    # the module has none (every layer a mixture of experts).
    mlp: str | None
    gguf_arch: str | None = None  # GGUF general.architecture (None: llama.cpp has none)
    gguf_tensor: str | None = None  # a tensor that tells it from another of the same arch
    gguf_layer_names: dict = field(default_factory=dict)  # over COMMON_LAYER_NAMES
    # Where a layer keeps its MLP or mixture (mlx-lm's attribute name).
    feed_forward: str = "mlp"
    # The RMSNorm computes x (1 + w) and llama.cpp's converter stores 1 + w in every norm
    # weight (its RMSNorm computes x w): the loader takes the 1 off.
    norms_plus_one: bool = False
    # llama.cpp's converter permuted Q/K rows into the interleaved RoPE layout (mlx-lm's
    # ``rope_traditional``); other families keep the half-split layout (NEOX RoPE).
    gguf_rope_traditional: bool = False
    # GGUF may rotate part of each head and carry long-context RoPE factors as tensors.
    gguf_rope_factors: bool = False
    head_dim_from_width: bool = False  # mlx-lm's attention: head_dim = hidden / heads
    sliding_windows: bool = False  # local layers whose windows the CP attention runs
    sentencepiece_vocab: bool = False  # its GGUF vocabulary is SentencePiece's ("llama")
    # What the family's GGUF metadata adds to the config: f(meta value getter, config so
    # far, tensors) -> dict.
    gguf_config: Callable | None = None
    # The MLP width one row passes through, from an HF-style config.
    mlp_width: Callable[[dict], int] = mlp_width

    def layer_names(self) -> dict:
        """GGUF per-layer tensor names -> mlx-lm module paths, for this family."""
        return {**COMMON_LAYER_NAMES, **self.gguf_layer_names}
