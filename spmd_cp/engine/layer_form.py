"""What the layer loop (model.py) reads of each layer besides mlx-lm's modules: its
attention window and where its norms sit. Read once from the modules when the CP model
is built, so the loop asks per-layer attributes and never a family's name.

Gemma 3 (mlx_lm.models.gemma3_text) differs from the Llama-shaped families in three
ways the loop must follow; its modules do the rest (the ``1 + weight`` RMSNorm, the
q/k norms, each layer's RoPE with the local or global base, query_pre_attn_scalar in
``attn.scale``, the GELU MLP):

- five of every six layers attend within a sliding window (``attn.is_sliding``; the
  window is the model's ``window_size``);
- every sublayer's output is normed before the residual add (``post_attention_layernorm``
  on the attention output, ``post_feedforward_layernorm`` on the MLP's), and the MLP's
  input is normed by ``pre_feedforward_layernorm``;
- the embedding is scaled by sqrt(hidden size), rounded to bfloat16 as mlx-lm does.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class LayerForm:
    window: int | None  # a sliding-window layer's window (keys p - W + 1 .. p); None: global
    mlp_norm: str  # the attribute of the layer that norms the MLP's input
    sandwich: bool  # attention and MLP outputs normed before the residual add (Gemma)

    @property
    def plain(self) -> bool:
        """Whether the layer is Llama-shaped: no window, the norms where Llama has them."""
        return self.window is None and not self.sandwich


def layer_form(layer: nn.Module, window_size: int | None) -> LayerForm:
    """The form of one mlx-lm transformer block (``window_size``: the model's)."""
    sliding = bool(getattr(layer.self_attn, "is_sliding", False))
    sandwich = "post_feedforward_layernorm" in layer
    return LayerForm(window=window_size if sliding else None,
                     mlp_norm="pre_feedforward_layernorm" if sandwich
                     else "post_attention_layernorm",
                     sandwich=sandwich)


def layer_forms(inner: nn.Module) -> list[LayerForm]:
    """Every layer's form, for mlx-lm's inner model (``model.model``)."""
    window_size = getattr(inner, "window_size", None)
    return [layer_form(inner.layers[i], window_size) for i in range(len(inner.layers))]


def embedding_scale(inner: nn.Module) -> mx.array | None:
    """The factor mlx-lm multiplies the embedding by (Gemma 3: sqrt(hidden size) as a
    bfloat16 scalar, cast to the hidden state's dtype where used), or None."""
    from mlx_lm.models.gemma3_text import Gemma3Model

    if isinstance(inner, Gemma3Model):
        return mx.array(inner.args.hidden_size ** 0.5, mx.bfloat16)
    return None
