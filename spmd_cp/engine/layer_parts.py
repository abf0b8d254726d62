"""The projections of one mlx-lm decoder layer, whatever family wrote it.

The families store the same maths under different names: Llama, Mistral and Qwen keep
q, k and v (and the MLP's gate and up) as separate matrices, Phi-3 fuses them (``qkv_proj``
of q|k|v outputs, ``gate_up_proj`` of gate|up), and the mixtures of experts (Qwen3-MoE,
Mixtral) replace the dense MLP with a router over stacked experts, which Mixtral keeps
under ``block_sparse_moe`` instead of ``mlp``. ``LayerParts`` reads those names once per
layer; the layer loop (model.py), the split step (tp_decode.py), the native step and the
decode estimate ask it instead of the modules. Which family has which MLP form and
feed-forward name is the family's module's to say (models/families).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module

import mlx.core as mx
import mlx.nn as nn

from ..models import families
from .weights.weight_slices import WeightMatrix



def mlp_classes(form: str) -> tuple:
    """mlx-lm's dense MLP classes of the families whose MLP has ``form``
    (models/families: Family.mlp)."""
    modules = dict.fromkeys(f.mlx_module for f in families.FAMILIES if f.mlp == form)
    return tuple(import_module(f"mlx_lm.models.{name}").MLP for name in modules)


# mlx-lm's MLPs that compute down(swiglu(gate(x), up(x))) with separate gate and up
# matrices, Phi-3's, whose gate|up is one matrix, and those that compute
# down(gelu_approx(gate(x)) * up(x)) (Gemma 3's). The layer loop and the decode steps
# run each through its matrices.
SWIGLU_MLPS = mlp_classes("swiglu")
FUSED_SWIGLU_MLPS = mlp_classes("fused_swiglu")
GELU_MLPS = mlp_classes("gelu")

# Rows of a prefill's MLP computed (and evaluated) at once: its hidden units' arrays
# (rows x I floats, a few of them alive) are then one tile's. Gemma 3 270M's MLP over
# 15,000 rows peaked 407 MB above its input whole, 87 MB in tiles of 2,048 (mlx 0.32.4).
MLP_TILE_ROWS = 2048


def in_row_tiles(mlp, x: mx.array) -> mx.array:
    """``mlp(x)`` for x (1, n, D): whole up to MLP_TILE_ROWS rows, else tile by tile,
    each evaluated before the next (MLX evaluates a lazy concatenation's tiles
    together, which saves nothing). Each row's maths is its own, whole or tiled."""
    if x.ndim < 3 or x.shape[1] <= MLP_TILE_ROWS:
        return mlp(x)
    tiles = []
    for start in range(0, x.shape[1], MLP_TILE_ROWS):
        tiles.append(mlp(x[:, start:start + MLP_TILE_ROWS]))
        mx.eval(tiles[-1])
    return mx.concatenate(tiles, axis=1)


# Where a decoder layer keeps its feed-forward module, by family (mlx-lm's names).
FEED_FORWARD_NAMES = tuple(dict.fromkeys(f.feed_forward for f in families.FAMILIES))


def feed_forward(layer) -> nn.Module:
    """The layer's MLP or mixture of experts."""
    for name in FEED_FORWARD_NAMES:
        if name in layer:
            return layer[name]
    raise TypeError(f"a {type(layer).__name__} without an MLP")


def describe_feed_forward(mlp) -> str:
    """'a mixture of 8 experts (2 a token)' or the class name: why a step refuses it."""
    experts = getattr(mlp, "num_experts", None)
    if experts is not None:
        per_token = getattr(mlp, "top_k", None) or getattr(mlp, "num_experts_per_tok", "?")
        return f"a mixture of {experts} experts ({per_token} a token)"
    return f"a {type(mlp).__name__}"


@dataclass(frozen=True)
class LayerParts:
    """One layer's projection modules as mlx-lm holds them.

    ``qkv``: (q_proj, k_proj, v_proj) or (qkv_proj,), whose outputs concatenated are
    q|k|v (``qkv_widths``). ``gate_up``: (gate_proj, up_proj) or (gate_up_proj,)
    of gate|up, ``down`` the MLP's output projection, ``activation`` what the gate goes
    through before it multiplies up ("silu": SwiGLU; "gelu_approx": Gemma 3's); all None
    where the feed-forward is not a dense MLP (a mixture of experts). The layer loop runs
    a dense MLP through these matrices, a mixture as mlx-lm's module ``feed_forward``."""

    attn: nn.Module
    qkv: tuple
    o: nn.Module
    feed_forward: nn.Module
    gate_up: tuple | None
    down: nn.Module | None
    activation: str | None

    @classmethod
    def of(cls, layer) -> LayerParts:
        attn, mlp = layer.self_attn, feed_forward(layer)
        fused = "qkv_proj" in attn
        qkv = (attn.qkv_proj,) if fused else (attn.q_proj, attn.k_proj, attn.v_proj)
        if isinstance(mlp, SWIGLU_MLPS + GELU_MLPS):
            gate_up, down = (mlp.gate_proj, mlp.up_proj), mlp.down_proj
        elif isinstance(mlp, FUSED_SWIGLU_MLPS):
            gate_up, down = (mlp.gate_up_proj,), mlp.down_proj
        else:
            gate_up = down = None
        activation = None if gate_up is None else (
            "gelu_approx" if isinstance(mlp, GELU_MLPS) else "silu")
        return cls(attn, qkv, attn.o_proj, mlp, gate_up, down, activation)

    @property
    def qkv_widths(self) -> tuple[int, int, int]:
        """Output widths of q, k and v (read from the weights: a layer-sharded store's
        must hold the layer's parameters)."""
        if len(self.qkv) == 3:
            return tuple(WeightMatrix.of(m).out_width for m in self.qkv)
        head_dim = self.attn.head_dim
        return (self.attn.n_heads * head_dim, *(2 * (self.attn.n_kv_heads * head_dim,)))

    @property
    def is_swiglu(self) -> bool:
        return self.activation == "silu"

    @property
    def is_dense(self) -> bool:
        """A dense MLP (SwiGLU or GELU), not a mixture of experts."""
        return self.gate_up is not None

    def named(self) -> list[tuple[str, nn.Module]]:
        """(mlx-lm's name, module) of every projection the split step divides as a
        matrix (not a mixture's experts)."""
        qkv = ("q_proj", "k_proj", "v_proj") if len(self.qkv) == 3 else ("qkv_proj",)
        named = [*zip(qkv, self.qkv), ("o_proj", self.o)]
        if self.is_dense:
            gate_up = ("gate_proj", "up_proj") if len(self.gate_up) == 2 else ("gate_up_proj",)
            named += [*zip(gate_up, self.gate_up), ("down_proj", self.down)]
        return named

    def modules(self) -> list:
        return [module for _, module in self.named()]

    def qkv_matrices(self) -> list[WeightMatrix]:
        """The q/k/v matrices stacked by rows (one for a fused q|k|v)."""
        return [WeightMatrix.of(m) for m in self.qkv]

    def gate_up_matrices(self) -> tuple[WeightMatrix, WeightMatrix]:
        """(gate, up): a fused gate|up's halves are views of its rows."""
        if len(self.gate_up) == 2:
            return tuple(WeightMatrix.of(m) for m in self.gate_up)
        fused = WeightMatrix.of(self.gate_up[0])
        half = fused.out_width // 2
        return fused.rows(0, half), fused.rows(half, 2 * half)


    def dense_mlp_matrices(self) -> tuple[WeightMatrix, WeightMatrix, WeightMatrix]:
        """(gate, up, down) of a dense MLP."""
        return (*self.gate_up_matrices(), WeightMatrix.of(self.down))


def key_projection_name(attn) -> str:
    """The name of the module whose output holds the keys (k_proj, or a fused qkv_proj):
    its dtype is the dtype keys are computed in."""
    return "k_proj" if "k_proj" in attn else "qkv_proj"


def head_counts(attn) -> tuple[int, int]:
    """(query heads, KV heads) of an attention module (Mixtral's are named
    ``num_heads`` and ``num_key_value_heads``)."""
    if hasattr(attn, "n_heads"):
        return attn.n_heads, attn.n_kv_heads
    return attn.num_heads, attn.num_key_value_heads
