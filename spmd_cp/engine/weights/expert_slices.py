"""A mixture of experts' share for the split decode step: hidden units [a, b) of every
expert (pure MLX, no MPI).

A SwiGLU expert computes down(silu(gate x) * up x), and its hidden units are independent:
a rank that keeps rows [a, b) of every expert's gate and up and the same columns of its
down computes a partial sum of each expert's output, and the ranks' partial sums add up
to it. The router is small and stays whole on every rank: each rank picks the same
experts for the token (the hidden state holds the same bits on every rank) and weighs
its partial sums with the same scores, so one sum across the ranks completes the layer,
as it does a dense MLP's. mlx-lm's own mixture module runs over the sliced experts.
Each rank reads 1/N of the chosen experts' weights, and holds a copy of 1/N of every
expert (a slice across the experts' hidden units is not a view BLAS can stream).
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def experts_obstacle(mlp) -> str | None:
    """Why the split step cannot cut ``mlp``'s experts, or None."""
    switch = getattr(mlp, "switch_mlp", None)
    if type(switch) is not SwitchGLU:
        return f"its MLP ({type(mlp).__name__}) is neither SwiGLU nor a mixture of experts"
    for name in EXPERT_PROJECTIONS:
        module = switch[name]
        if type(module) is not SwitchLinear:
            return f"its experts' {name} is a {type(module).__name__}"
        if "bias" in module:
            return f"its experts' {name} has a bias"
    return None


def expert_width(mlp) -> int:
    """Hidden units of each expert (the rows of its gate)."""
    return mlp.switch_mlp.gate_proj["weight"].shape[1]


def expert_bytes(mlp) -> int:
    """Bytes of every expert's matrices (not the router)."""
    return sum(v.nbytes for _, v in tree_flatten(mlp.switch_mlp.parameters()))


def experts_per_token(mlp) -> int:
    return getattr(mlp, "top_k", None) or mlp.num_experts_per_tok


def expert_slice(mlp, start: int, stop: int) -> nn.Module:
    """A shallow copy of the mixture module whose experts keep hidden units [start, stop)
    (copies, evaluated); its output is this share's partial sum of the layer's. The
    router is a shallow copy too: it keeps its weights when a layer-sharded store swaps
    the layer's parameters out (engine/weights/weights.py)."""
    switch = copy.copy(mlp.switch_mlp)
    for name in EXPERT_PROJECTIONS:
        piece = copy.copy(switch[name])
        weight = piece["weight"]  # (experts, out, in)
        cut = weight[:, :, start:stop] if name == "down_proj" else weight[:, start:stop]
        piece["weight"] = mx.contiguous(cut)
        switch[name] = piece
    local = copy.copy(mlp)
    for name, child in mlp.children().items():
        if isinstance(child, nn.Module):
            local[name] = switch if name == "switch_mlp" else copy.copy(child)
    mx.eval(switch.parameters())
    return local
