"""Slices of a layer's weight matrix, plain or quantized, and their matmul (pure math, no MPI).

Tensor-parallel decode (tp_decode.py) gives each rank a slice of every matrix W (out, in):
rows of W for a column-parallel matmul (each rank computes some outputs) and columns of W
for a row-parallel one (each rank a partial sum over some inputs). MLX's quantized layers
store W packed along the input: ``weight`` (out, in * bits / 32) uint32, and one scale
(and, in affine mode, one bias) per group of ``group_size`` inputs: (out, in / group_size).
Every output row is quantized on its own, so any rows can be cut; inputs can be cut only
on group boundaries (a group of 32, 64 or 128 inputs always fills whole uint32 words).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def is_cpu_row(x: mx.array) -> bool:
    """Whether ``x`` is one (1, in) row on MLX's CPU backend: a decode step's row form
    (engine/decode/one_token.py), whose products with a weight's transposed view take one graph
    node (a (1, 1, in) row makes MLX fold it in two more)."""
    return x.ndim == 2 and x.shape[0] == 1 and mx.default_device().type == mx.DeviceType.cpu


def times_transposed(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ weight.T`` (weight (out, in)).

    One (1, in) row on MLX's CPU backend is a matrix-vector product either way: BLAS
    gets the transposed flag for ``weight.T`` (a view), gemv_forward.c hands it to sgemv
    as the same call as ``weight @ x``, and without the forward OpenBLAS 0.3.21 streams
    it at least as fast, with the same bits (one thread: 15.7 against 9.9 GB/s for a
    49152 x 576 head, 11.8 against 10.9 for 1536 x 576; 36.8 and 35.2 GB/s through the
    forward both ways). A row with leading axes, (1, 1, in), runs as ``weight @ x`` with
    reshapes around it: three nodes, where its product with ``weight.T`` takes four."""
    if x.size == x.shape[-1] and x.ndim != 2 and mx.default_device().type == mx.DeviceType.cpu:
        return (weight @ x.reshape(-1, 1)).reshape(*x.shape[:-1], weight.shape[0])
    return x @ weight.T


def linear(module, x: mx.array) -> mx.array:
    """``module(x)``, through ``times_transposed`` where it is a plain nn.Linear."""
    if type(module) is not nn.Linear:
        return module(x)
    y = times_transposed(x, module["weight"])
    return y + module["bias"] if "bias" in module else y


@dataclass(frozen=True)
class Quantization:
    """How a quantized matrix is packed (mlx.core.quantize's parameters)."""

    group_size: int
    bits: int
    mode: str


@dataclass(frozen=True)
class WeightMatrix:
    """y = x @ W.T + bias for a plain or quantized W (out, in)."""

    weight: mx.array
    quant: Quantization | None = None
    scales: mx.array | None = None
    biases: mx.array | None = None  # the quantization's per-group offsets (affine mode)
    bias: mx.array | None = None  # the layer's additive output bias (qwen2's q/k/v)

    @classmethod
    def of(cls, module) -> WeightMatrix:
        """The matrix of an nn.Linear, nn.QuantizedLinear, nn.Embedding or
        nn.QuantizedEmbedding (an embedding read as the tied LM head, W = (vocab, D))."""
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            quant = Quantization(module.group_size, module.bits, module.mode)
            return cls(module["weight"], quant, module["scales"], module.get("biases"),
                       module.get("bias"))
        if isinstance(module, (nn.Linear, nn.Embedding)):
            return cls(module["weight"], bias=module.get("bias"))
        raise TypeError(f"a {type(module).__name__}, not a Linear or QuantizedLinear")

    @property
    def out_width(self) -> int:
        return self.weight.shape[0]

    @property
    def in_width(self) -> int:
        if self.quant is None:
            return self.weight.shape[1]
        return self.weight.shape[1] * 32 // self.quant.bits

    @property
    def in_align(self) -> int:
        """A row-parallel cut must fall between groups and between packed uint32 words."""
        if self.quant is None:
            return 1
        return math.lcm(self.quant.group_size, 32 // math.gcd(self.quant.bits, 32))

    @cached_property
    def transposed(self) -> mx.array:
        """W.T as a view (no copy), evaluated once: a decode row's product is then one
        graph node."""
        view = self.weight.T
        mx.eval(view)
        return view

    def __call__(self, x: mx.array) -> mx.array:
        if self.quant is None:
            y = x @ self.transposed if is_cpu_row(x) else times_transposed(x, self.weight)
        else:
            q = self.quant
            y = mx.quantized_matmul(x, self.weight, scales=self.scales, biases=self.biases,
                                    transpose=True, group_size=q.group_size, bits=q.bits,
                                    mode=q.mode)
        return y if self.bias is None else y + self.bias

    def rows(self, start: int, stop: int) -> WeightMatrix:
        """Outputs [start, stop): the slice of a column-parallel matmul."""
        cut = lambda t: None if t is None else t[start:stop]  # noqa: E731
        return replace(self, weight=cut(self.weight), scales=cut(self.scales),
                       biases=cut(self.biases), bias=cut(self.bias))

    def columns(self, start: int, stop: int, keep_bias: bool) -> WeightMatrix:
        """Inputs [start, stop) (on group boundaries): a row-parallel matmul's partial sum.

        The output bias must be added once across the ranks' partial sums: ``keep_bias``
        on one rank only."""
        bias = self.bias if keep_bias else None
        if self.quant is None:
            return replace(self, weight=self.weight[:, start:stop], bias=bias)
        if start % self.in_align or stop % self.in_align:
            raise ValueError(f"inputs [{start}, {stop}) cut groups of {self.in_align}")
        group, bits = self.quant.group_size, self.quant.bits
        cut = lambda t: None if t is None else t[:, start // group:stop // group]  # noqa: E731
        packed = self.weight[:, start * bits // 32:stop * bits // 32]
        return replace(self, weight=packed, scales=cut(self.scales), biases=cut(self.biases),
                       bias=bias)

    @property
    def arrays(self) -> list[mx.array]:
        return [t for t in (self.weight, self.scales, self.biases, self.bias) if t is not None]

    def materialized(self) -> WeightMatrix:
        """A copy of the slice in its own memory, evaluated (not a view of all of W)."""
        own = lambda t: None if t is None else mx.contiguous(t)  # noqa: E731
        copy = replace(self, weight=own(self.weight), scales=own(self.scales),
                       biases=own(self.biases), bias=own(self.bias))
        mx.eval(copy.arrays)
        return copy

    def evaluated(self, copy: bool) -> WeightMatrix:
        """The slice ready to use: ``materialized`` where ``copy``, else evaluated as it is.
        A slice of whole rows of a row-major W is a view into W's memory (MLX shares the
        buffer): no time or memory spent while W itself stays loaded."""
        if copy:
            return self.materialized()
        mx.eval(self.arrays)
        return self


def stack_rows(matrices: list[WeightMatrix]) -> list[WeightMatrix]:
    """[Wq; Wk; Wv] as few matrices as possible: neighbours packed alike (and alike in
    having an output bias) become one, so q, k and v of one layer are one matmul."""
    merged = [matrices[0]]
    for m in matrices[1:]:
        last = merged[-1]
        if m.quant != last.quant or (m.bias is None) != (last.bias is None):
            merged.append(m)
            continue
        join = lambda a, b: None if a is None else mx.concatenate([a, b])  # noqa: E731
        merged[-1] = replace(last, weight=join(last.weight, m.weight),
                             scales=join(last.scales, m.scales),
                             biases=join(last.biases, m.biases), bias=join(last.bias, m.bias))
    return merged


def split_ranges(total: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering [0, total), cut at multiples of ``align``,
    sizes differing by at most one ``align``; ValueError where some part would be empty."""
    if total % align:
        raise ValueError(f"{total} is not a multiple of {align}")
    units = total // align
    if units < parts:
        raise ValueError(f"{units} groups of {align} cannot be split into {parts} parts")
    bounds = np.linspace(0, units, parts + 1).round().astype(int) * align
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def column_slice(matrices: list[WeightMatrix], start: int, stop: int,
                 join: bool = True) -> list[WeightMatrix]:
    """Outputs [start, stop) of the matrices stacked by rows (e.g. q, k, v); their
    outputs concatenated are the stack's outputs [start, stop). ``join``: as the fewest
    matmuls (neighbours packed alike become one matrix, a copy); else one matrix per
    stacked matrix touched, each a view of its rows."""
    parts, offset = [], 0
    for m in matrices:
        lo, hi = max(start, offset), min(stop, offset + m.out_width)
        if lo < hi:
            parts.append(m.rows(lo - offset, hi - offset))
        offset += m.out_width
    return stack_rows(parts) if join else parts


def apply_all(parts: list[WeightMatrix], x: mx.array) -> mx.array:
    """The concatenated outputs of ``column_slice``'s matmuls."""
    outs = [m(x) for m in parts]
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)
