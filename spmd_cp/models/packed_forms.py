"""The packed forms of a quantized matrix that decode's kernels read
(kernels/gemv_forward.c, gguf_blocks.h): MLX's affine triple and a GGUF file's own
blocks, with the row and column views the split decode step cuts from them."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


# How gemv_forward.c reads scales and biases (GROUP_FLOAT32, ...): widened to float32
# exactly, so a file's float16 or bfloat16 ones are kept as they are (half the bytes).
GROUP_KINDS = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}


@dataclass(frozen=True)
class Packed:
    """A matrix (rows, cols) in MLX's affine packing: ``weight`` uint32 (rows, cols * bits
    / 32), ``scales`` and ``biases`` (rows, cols / group) as float32, float16 or
    bfloat16; its weights are ``scale * q + bias`` in float32 arithmetic."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group: int

    @classmethod
    def of(cls, weight: mx.array, scales: mx.array, biases: mx.array, bits: int,
           group: int) -> Packed:
        if scales.dtype not in GROUP_KINDS or biases.dtype != scales.dtype:
            scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        return cls(weight, scales, biases, bits, group)

    def dequantized(self) -> mx.array:
        """The float32 matrix, in float32 arithmetic (scales and biases widened first)."""
        from .gguf import dequantize_float32

        return dequantize_float32(self.weight, self.scales, self.biases, self.bits, self.group)

    @property
    def cols(self) -> int:
        return self.weight.shape[1] * 32 // self.bits

    def rows(self, start: int, stop: int) -> Packed:
        return Packed(self.weight[start:stop], self.scales[start:stop],
                      self.biases[start:stop], self.bits, self.group)

    def columns(self, start: int, stop: int) -> Packed | None:
        """Inputs [start, stop), or None where the cut falls inside a group."""
        if start % self.group or stop % self.group:
            return None
        per_word = 32 // self.bits
        return Packed(self.weight[:, start // per_word:stop // per_word],
                      self.scales[:, start // self.group:stop // self.group],
                      self.biases[:, start // self.group:stop // self.group],
                      self.bits, self.group)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes + self.biases.nbytes


@dataclass(frozen=True)
class Blocks:
    """A matrix (rows, cols) as a GGUF file stores it in a type of ``BLOCK_TYPES``: ``data``
    uint8 (rows, row bytes), each row's blocks contiguous (a column slice's rows lie
    further apart than their width), ``kind`` the GGML type id."""

    data: np.ndarray
    kind: int
    cols: int

    @property
    def block(self) -> tuple[int, int]:
        from .gguf_types import block_of

        return block_of(self.kind)

    def rows(self, start: int, stop: int) -> Blocks:
        return Blocks(self.data[start:stop], self.kind, self.cols)

    def columns(self, start: int, stop: int) -> Blocks | None:
        """Inputs [start, stop), or None where a cut falls inside a block."""
        values, size = self.block
        if start % values or stop % values:
            return None
        return Blocks(self.data[:, start // values * size:stop // values * size], self.kind,
                      stop - start)

    @property
    def nbytes(self) -> int:
        return self.data.shape[0] * self.data.shape[1]
