"""A prefill MLP's gated activation in C on the CPU path: ``gelu_approx(gate) * up``.

mlx-lm's ``nn.gelu_approx`` (Gemma 3's MLP) is a compiled MLX expression whose CPU code
calls the C library's ``powf`` (for x**3) and ``tanhf`` one value at a time on one thread:
in a 1,836-token prefill of Gemma 3 270M on one thread, those calls were a fifth of the
time (``perf``, the 2-core AMD EPYC machine). The native decode step's kernel
(kernels/decode_step.c: tanh from the polynomial exp, eight values a vector, on the
step's pool of threads) computes the same values to float32 rounding. Used for a
prefill's rows (``MIN_ROWS`` or more) where the arrays are float32 in CPU memory, the
library is there and ``--no-fast-exp`` is not given (it keeps MLX's maths, as for
attention); elsewhere mlx-lm's expression.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..attention.exp import polynomial_exp_wanted
from ..attention.native_prefill import pooled_library
from ..kernels import decode_step

# Fewer rows than this keep mlx-lm's expression: the C kernel evaluates its inputs, which
# inside a decode step's graph (a row a sequence) would cut the graph at every layer
# (as the batched step found of prefill attention's kernel: a step twice as long).
MIN_ROWS = 64


def _native(gate: mx.array) -> bool:
    return (gate.dtype == mx.float32 and mx.default_device() == mx.cpu
            and polynomial_exp_wanted() and pooled_library() is not None)


def gelu_gate(gate: mx.array, up: mx.array) -> mx.array:
    """``nn.gelu_approx(gate) * up`` (evaluated where the C kernel computes it)."""
    rows = gate.size // gate.shape[-1] if gate.ndim else 0
    if rows < MIN_ROWS or gate.shape != up.shape or not _native(gate):
        return nn.gelu_approx(gate) * up
    mx.eval(gate, up)
    gates, ups = (np.ascontiguousarray(x) for x in (gate, up))
    out = np.empty_like(gates)
    pooled_library().spmd_cp_decode_activation(
        decode_step.ACTIVATIONS["gelu_approx"], gates.ctypes.data, ups.ctypes.data,
        gates.size, out.ctypes.data)
    return mx.array(out)
