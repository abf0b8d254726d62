"""The numpy views a native decode step's C structs point into (native_decode.py).

Every weight, norm and cache buffer the C step reads is an evaluated MLX array seen
through a zero-copy numpy view: its address goes into decode_step.c's ``matrix`` and
``layer`` structs, and the view (with the array behind it) is kept alive as long as the
struct (``Held``). What a module computes is read as it computes it: nn.RMSNorm's weight,
Gemma 3's ``1 + weight``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.gemma3_text import RMSNorm as GemmaRMSNorm

from ...kernels.decode_step import ACTIVATIONS, Matrix
from ..layer_parts import LayerParts, describe_feed_forward
from ..weights.weight_slices import WeightMatrix


def address(array: np.ndarray | None) -> int | None:
    return None if array is None else array.ctypes.data


def float32_view(a: mx.array) -> np.ndarray:
    """A zero-copy float32 numpy view of an evaluated MLX array (rows may lie apart)."""
    mx.eval(a)
    view = np.asarray(a)
    if view.dtype != np.float32 or view.strides[-1] != 4:
        raise TypeError("not float32 with contiguous rows")
    return view


def cache_view(a: mx.array) -> np.ndarray:
    """A zero-copy numpy view of an evaluated cache buffer: float32 as is, a float16 or
    bfloat16 one as its uint16 bits (numpy has no bfloat16; MLX's view shares the
    buffer, so the C step's stores land in the cache itself)."""
    if a.dtype == mx.float32:
        return float32_view(a)
    mx.eval(a)
    view = np.asarray(a.view(mx.uint16))
    if not view.flags["C_CONTIGUOUS"]:
        raise TypeError("a cache buffer that is not contiguous")
    return view


def vector_view(a: mx.array) -> np.ndarray:
    view = float32_view(a)
    if view.ndim != 1:
        raise TypeError("not a vector")
    return view


def norm_weight(module) -> tuple[np.ndarray, float]:
    """(the weight an RMSNorm module multiplies by, its eps): nn.RMSNorm's own, Gemma 3's
    ``1 + weight`` computed in float32 as its module computes it."""
    if type(module) is nn.RMSNorm:
        return vector_view(module["weight"]), float(module.eps)
    if type(module) is GemmaRMSNorm:
        return vector_view(1.0 + module["weight"]), float(module.eps)
    raise TypeError(f"a {type(module).__name__}, not an RMSNorm")


def activation_code(parts: LayerParts) -> int:
    """decode_step.c's code of the layer's MLP activation (SwiGLU, or GELU's tanh form
    times up: Gemma 3's); TypeError for any other feed-forward."""
    if not parts.is_dense:
        raise TypeError(f"its MLP is {describe_feed_forward(parts.feed_forward)}")
    return ACTIVATIONS[parts.activation]


class Held:
    """The numpy views a layer's C struct points into, kept alive with it."""

    def __init__(self):
        self.arrays = []

    def matrix(self, m: WeightMatrix) -> Matrix:
        if m.quant is not None:
            raise TypeError("quantized (not dequantized to float32)")
        weight = float32_view(m.weight)
        if weight.ndim != 2 or weight.strides[0] % 4 or weight.strides[0] < 0:
            raise TypeError("not a row-major matrix")
        bias = None if m.bias is None else vector_view(m.bias)
        self.arrays += [weight, bias]
        return Matrix(weight.ctypes.data, address(bias), weight.shape[0], weight.shape[1],
                      weight.strides[0] // 4)

    def vector(self, view: np.ndarray | None) -> int | None:
        self.arrays.append(view)
        return address(view)
