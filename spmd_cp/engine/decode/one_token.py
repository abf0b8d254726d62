"""One-token forward passes (decode steps) in fewer MLX graph nodes on the CPU path.

A decode step of SmolLM2-135M (30 layers) was about 4,100 graph nodes. On MLX's CPU
backend every node costs its build and its hand-over to the compute thread: 3.2 us
alone, 4.2-4.9 us with two ranks on two cores (a chain of 4,000 multiplies of 576
floats), so 13-20 ms of a 70-95 ms step went to nodes that compute next to nothing. On
a GPU, RoPE and RMSNorm are one fused kernel each; on the CPU they run as their
fallbacks, 29 and 11 nodes, four times per layer. For a single token:

- RoPE at one position is a linear map of each head's vector, so its (d, d) matrix is
  the model's own RoPE module applied to the identity: built once per step for every
  layer whose module rotates the same way, then one matmul for q and one for k. Each
  output element sums two products and zeros, so the result is the module's bit for
  bit for MLX's RoPE (plain, linear-scaled, traditional, partial) and mlx-lm's
  Llama-3 RoPE (tests/test_one_token.py). YaRN and LongRoPE scale x before rotating,
  which a matrix folds into its entries (1 ulp apart): those, and any other module,
  keep running as themselves.
- RMSNorm through ``mx.compile``: the elementwise tail fused into one node (3 instead
  of 11), the same arithmetic in the same order.
- The row form: the hidden state is a (1, D) row, not (1, 1, D). MLX multiplies a 2-D
  row by a weight's transposed view in one node (weight_slices.is_cpu_row), where a
  row with a leading axis is folded with a reshape on each side; RoPE's matrices
  multiply (H, d) heads for the same reason. The same BLAS call (sgemv), the same bits.

The GPU path keeps MLX's fused kernels; float32 is the only dtype taken this way (a
half-precision RoPE rounds differently from a matmul in that precision).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import Llama3RoPE

from ...runtime.device import Compute


def lean_graph(rows: int, compute: Compute) -> bool:
    """Whether a forward pass over ``rows`` local rows takes this module's forms."""
    return rows == 1 and not compute.gpu


@mx.compile
def _rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


def rms_norm(module: nn.Module, x: mx.array) -> mx.array:
    """``module(x)``, compiled when it is a plain float32 RMSNorm."""
    if type(module) is nn.RMSNorm and x.dtype == mx.float32:
        return _rms_norm(x, module["weight"], module.eps)
    return module(x)


# RoPE modules whose one-token output a matrix reproduces bit for bit (see above).
EXACT_AS_MATRIX = (nn.RoPE, Llama3RoPE)


def rotation_matrix(rope: nn.Module, head_dim: int, position: int) -> mx.array:
    """(d, d) float32 R with ``x @ R == rope(x, offset=position)`` for one token: row j
    is the rotated j-th unit vector."""
    basis = mx.eye(head_dim, dtype=mx.float32)[None, :, None, :]  # d heads of one token
    return rope(basis, offset=position)[0, :, 0, :]


def _signature(module: nn.Module) -> tuple:
    """What a RoPE module's output depends on: its class and every attribute (arrays by
    their bytes), so modules with equal signatures rotate identically."""
    items = []
    for name, value in sorted({**vars(module), **dict(module)}.items()):
        if isinstance(value, mx.array):
            value = (str(value.dtype), value.shape,
                     np.array(value.astype(mx.float32)).tobytes())
        else:
            value = repr(value)
        items.append((name, value))
    return type(module), tuple(items)


class RopeMatrices:
    """The RoPE matrices of one position for a model's layers, built once per step for
    each group of layers whose modules rotate alike (grouped once per set of modules)."""

    def __init__(self):
        self._modules: list = []
        self._representative: list = []  # per layer: the first layer rotating alike, or None

    def _group(self, ropes: list):
        """Find each layer's representative (once per set of modules)."""
        if len(ropes) != len(self._modules) or any(
                a is not b for a, b in zip(ropes, self._modules)):
            first: dict = {}
            self._modules = list(ropes)
            self._representative = [
                first.setdefault(_signature(r), i) if type(r) in EXACT_AS_MATRIX else None
                for i, r in enumerate(ropes)]

    def at(self, ropes: list, position: int):
        """``matrix(layer_index, head_dim)`` for one step at ``position``: the layer's
        RoPE matrix, or None where its module must run itself (not EXACT_AS_MATRIX)."""
        return self._per_layer(ropes, lambda rope, d: rotation_matrix(rope, d, position))

    def rows(self, ropes: list, positions: np.ndarray):
        """``matrices(layer_index, head_dim)``: (n, d, d), row b's the RoPE matrix at
        ``positions[b]`` (rows of several sequences in one batched decode step), or None
        where the module must run itself."""
        return self._per_layer(ropes, lambda rope, d: mx.stack(
            [rotation_matrix(rope, d, int(p)) for p in positions]))

    def _per_layer(self, ropes: list, build):
        """``matrix(layer_index, head_dim)``: ``build(rope, head_dim)`` for the layer's
        group, built on first asking and shared by the layers that rotate alike."""
        self._group(ropes)
        built: dict = {}

        def matrix(index: int, head_dim: int) -> mx.array | None:
            key = (self._representative[index], head_dim)
            if key[0] is None:
                return None
            if key not in built:
                built[key] = build(ropes[key[0]], head_dim)
            return built[key]

        return matrix

    def block(self, ropes: list, head_dim: int, start: int, count: int) -> list:
        """Per layer: the (count, d, d) RoPE matrices of positions ``start`` to
        ``start + count - 1`` (one array for the layers that rotate alike; the bits of
        ``rotation_matrix`` at each position: the module computes each position's angles
        from ``offset`` and its index the same way), or None where the module has no
        matrix form. One module call per group for ``count`` decode steps."""
        self._group(ropes)
        built: dict = {}
        for representative in set(self._representative) - {None}:
            built[representative] = rotation_matrices(ropes[representative], head_dim,
                                                      start, count)
        return [built.get(r) for r in self._representative]


def rotation_matrices(rope: nn.Module, head_dim: int, start: int, count: int) -> mx.array:
    """(count, d, d): ``rotation_matrix`` at positions ``start`` .. ``start + count - 1``,
    contiguous, in one call of the module."""
    basis = mx.eye(head_dim, dtype=mx.float32)[None, :, None, :]
    rotated = rope(mx.broadcast_to(basis, (1, head_dim, count, head_dim)), offset=start)
    return mx.contiguous(rotated[0].transpose(1, 0, 2))
