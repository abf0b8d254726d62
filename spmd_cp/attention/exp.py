"""``exp`` of attention scores and MLP gates on x86 CPUs: a polynomial ``mx.compile`` fuses.

MLX's CPU backend evaluates ``exp`` one element at a time on x86 (its vector types are
one lane wide there, and each step of its polynomial calls libm's ``fmaf``): 8.7 ns per
element on the 2-core test machine, where a float32 add costs 0.2 ns. Prefill computes
one ``exp`` per visible (query, key, head) score, about half of its CPU time at 3K
tokens, and one per row and hidden unit in the MLPs' SiLU, another 10%
(docs/CPU_SPEED.md). The same arithmetic written as MLX elementwise ops and compiled is
a loop the C++ compiler vectorizes: 0.9 ns per element.

The polynomial is the classic single-precision one (Cephes ``expf``): ``x = n ln2 + r``
with ``n`` the nearest integer to ``x / ln2`` (rounded by adding 1.5 * 2^23, no call
to ``floor``) and ``ln2`` split in two so that ``r`` is exact; ``e^r`` by a degree-7
polynomial evaluated in Estrin's form (shallower than Horner's, so MLX fuses it into
fewer kernels); ``2^n`` built from its exponent bits. Accuracy against a float64
``exp``: within 2 ulp for ``x`` in [-87.3, 88] (tests/test_exp.py); 0 for ``x <= -88``
and ``-inf``; a subnormal approximation between (absolute error below 1.2e-38); NaN
stays NaN; defined for ``x <= 88`` only (no clip above: the callers pass ``x <= 0``).
Attention only takes the exponential of scores minus their maximum (``x <= 0``), where
this is as good as any exp for a softmax: the weights' absolute errors stay below one
ulp of the largest weight, 1. The SiLU takes ``e^-|g|`` only.

Compiled per input shape: a shapeless compile would take the constants as broadcast
inputs (nine more graph nodes and strided loops, 2.3 ns per element). Decode's scores
grow by a key every step, so the compiled functions are kept for the last
``SHAPES_KEPT`` shapes only, each traced once (0.15 ms): MLX drops a compiled function's
cache entries with it, so memory stays flat however long the generation.

MLX's CPU compiler is the system's ``g++``; without it ``mx.compile`` silently runs the
ops one by one (4.8 ns per element and 20 graph nodes), so then, where MLX cannot write
its kernels (runtime/device.compiled_kernels_work), and on GPUs and
non-x86 CPUs (MLX's Arm build has vector ``exp``), ``mx.exp`` is kept. A call on fewer
than ``MIN_ELEMENTS`` elements (a softmax: ``SOFTMAX_MIN_ELEMENTS``) keeps ``mx.exp`` too:
the compiled form is six graph nodes, which cost more than they save on a short row.
``--no-fast-exp`` (``use_polynomial_exp(False)``) keeps MLX's ``exp`` (and mlx-lm's
SiLU) everywhere.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
from collections import OrderedDict

import mlx.core as mx
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

from ..kernels.header_constants import defines
from ..runtime.device import compiled_kernels_work
_WANTED = {"polynomial": True}  # --fast-exp (RunConfig.fast_exp), set once by the command
# Below this many elements the six nodes of the compiled form cost more than the
# per-element saving (7.8 ns; a node costs 5-8 us on the CPU path).
MIN_ELEMENTS = 8192
# A decode query's softmax takes the compiled form from fewer elements: 30 layers of one
# query row (9 heads) over 256 keys, 2,304 scores a layer, 1.43 against 1.72 ms with
# MLX's exp (and 1.61 through MLX's fused attention); over 128 keys no faster.
SOFTMAX_MIN_ELEMENTS = 2048

# The polynomial's numbers, from the C header the native decode step compiles
# (kernels/exp_polynomial.h says what each is): one source for both.
_POLYNOMIAL = defines()
LOG2E, LN2_HI, LN2_LO = (_POLYNOMIAL[f"EXP_{n}"] for n in ("LOG2E", "LN2_HI", "LN2_LO"))
ROUNDING_SHIFT, LOWEST = _POLYNOMIAL["EXP_ROUNDING_SHIFT"], _POLYNOMIAL["EXP_LOWEST"]
# No upper clip: every caller passes x <= 0, and up to 88 (n = 127) the bits hold. Each
# clip is a NaN-checking maximum or minimum: without this one the kernels run 30% faster.
C0, C1, C2, C3, C4, C5 = (_POLYNOMIAL[f"EXP_C{i}"] for i in range(6))
EXPONENT_BIAS = int(_POLYNOMIAL["FLOAT_EXPONENT_BIAS"])
MANTISSA_BITS = int(_POLYNOMIAL["FLOAT_MANTISSA_BITS"])


def _mantissa_and_exponent_bits(x: mx.array) -> tuple[mx.array, mx.array]:
    """``(e^r, bits of 2^n)`` with ``exp(x) = e^r * 2^n``: the elementwise part."""
    x = mx.maximum(x, LOWEST)  # also maps -inf to LOWEST; NaN stays
    n = (x * LOG2E + ROUNDING_SHIFT) - ROUNDING_SHIFT
    r = (x - n * LN2_HI) - n * LN2_LO
    r2 = r * r
    tail = (C0 + C1 * r) + r2 * (C2 + C3 * r) + (r2 * r2) * (C4 + C5 * r)
    e_r = (r + 1.0) + r2 * tail
    return e_r, mx.left_shift(n.astype(mx.int32) + EXPONENT_BIAS, MANTISSA_BITS)


class PerShape:
    """``mx.compile(function)`` per input shape, kept for the last ``capacity`` shapes
    (see the module's docstring)."""

    def __init__(self, function, capacity: int):
        self.function, self.capacity = function, capacity
        self.compiled: OrderedDict = OrderedDict()

    def __call__(self, *arrays: mx.array):
        key = tuple((a.shape, a.dtype) for a in arrays)
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.compiled[key] = mx.compile(self.function)
            if len(self.compiled) > self.capacity:
                self.compiled.popitem(last=False)
        else:
            self.compiled.move_to_end(key)  # most recently used last
        return compiled(*arrays)


# Enough for a prompt's tile shapes (full, edges, diagonals) and a few decode rows.
SHAPES_KEPT = 16


def _shifted_parts(x: mx.array, shift: mx.array):
    return _mantissa_and_exponent_bits(x - shift)


def _scaled_parts(x: mx.array, shift: mx.array, scale: mx.array):
    return _mantissa_and_exponent_bits((x - shift) * scale)


_compiled_shifted_parts = PerShape(_shifted_parts, SHAPES_KEPT)
_compiled_scaled_parts = PerShape(_scaled_parts, SHAPES_KEPT)


def _scaled_mlx_exp(x: mx.array, shift: mx.array, scale: mx.array) -> mx.array:
    return mx.exp((x - shift) * scale)  # compiled: one node


_scaled_exp = PerShape(_scaled_mlx_exp, SHAPES_KEPT)


def _compiled_exp(x: mx.array, shift: mx.array, scale: mx.array | None = None) -> mx.array:
    """``exp((x - shift) * scale)`` through the compiled kernels. (A view cannot be
    compiled: the exponent bits are viewed as floats outside.)"""
    if scale is None:
        e_r, bits = _compiled_shifted_parts(x, shift)
    else:
        e_r, bits = _compiled_scaled_parts(x, shift, scale)
    return e_r * bits.view(mx.float32)


def polynomial_exp(x: mx.array, compiled: bool = True) -> mx.array:
    """``exp(x)`` of a float32 array by the polynomial above, through attention's compiled
    kernels (shifted by 0, which changes no bit); ``compiled=False`` runs the same ops one
    by one (the reference for the compiled kernels' arithmetic)."""
    if compiled:
        return _compiled_exp(x, mx.array(0.0, mx.float32))
    e_r, bits = _mantissa_and_exponent_bits(x)
    return e_r * bits.view(mx.float32)


def use_polynomial_exp(wanted: bool):
    """Whether the compiled polynomial may be taken (``--fast-exp``): set by a command
    before any attention runs."""
    if _WANTED["polynomial"] != wanted:
        _WANTED["polynomial"] = wanted
        polynomial_exp_enabled.cache_clear()


def polynomial_exp_wanted() -> bool:
    """Whether the command allows the polynomial (``--fast-exp``, its default)."""
    return _WANTED["polynomial"]


@functools.lru_cache(maxsize=None)
def polynomial_exp_enabled() -> bool:
    """Whether this process computes attention's ``exp`` by the compiled polynomial."""
    if not _WANTED["polynomial"]:
        return False
    if os.environ.get("MLX_DISABLE_COMPILE"):  # mx.compile would run the ops one by one
        return False
    return (mx.default_device().type == mx.DeviceType.cpu
            and platform.machine().lower() in ("x86_64", "amd64")
            and shutil.which("g++") is not None and compiled_kernels_work())


def _polynomial_wanted(x: mx.array, minimum: int = MIN_ELEMENTS) -> bool:
    return x.size >= minimum and x.dtype == mx.float32 and polynomial_exp_enabled()


@functools.lru_cache(maxsize=64)
def scalar(value: float) -> mx.array:
    """A float32 scalar array, made once per value (a constant every layer reuses)."""
    array = mx.array(value, mx.float32)
    mx.eval(array)
    return array


def softmax_exp(scores: mx.array, maxima: mx.array, scale: float | None = None) -> mx.array:
    """``mx.exp(scores - maxima)``: float32 scores and their (broadcast) maxima, finite,
    so that every argument is <= 0. With ``scale`` (> 0): ``exp((scores - maxima) *
    scale)``, the softmax of scores not yet scaled, in the same kernels (decode's
    scores: no graph nodes to scale the query first)."""
    polynomial = _polynomial_wanted(scores, SOFTMAX_MIN_ELEMENTS)
    if scale is None:
        return _compiled_exp(scores, maxima) if polynomial else mx.exp(scores - maxima)
    factor = scalar(scale)
    if polynomial:
        return _compiled_exp(scores, maxima, factor)
    return _scaled_exp(scores, maxima, factor)


def _sigmoid_times(gate: mx.array, up: mx.array, e_r: mx.array, two_to_n: mx.array):
    """``silu(gate) * up`` from ``t = e^-|gate| = e_r * two_to_n``, stable both ways:
    ``sigmoid(g) = 1 / (1 + t)`` for g >= 0 and ``t / (1 + t)`` below."""
    t = e_r * two_to_n
    return gate * (mx.where(gate >= 0, 1.0, t) / (1.0 + t)) * up


def _negative_abs_parts(gate: mx.array):
    return _mantissa_and_exponent_bits(-mx.abs(gate))


_compiled_negative_abs_parts = PerShape(_negative_abs_parts, SHAPES_KEPT)
_compiled_sigmoid_times = PerShape(_sigmoid_times, SHAPES_KEPT)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` (mlx-lm's ``swiglu``), its exp by the polynomial where attention
    takes it (``softmax_exp``): prefill's MLPs compute one sigmoid per row and hidden
    unit, 10% of a 3K-token prefill through MLX's scalar exp."""
    if not _polynomial_wanted(gate):
        return mlx_lm_swiglu(gate, up)
    e_r, bits = _compiled_negative_abs_parts(gate)
    return _compiled_sigmoid_times(gate, up, e_r, bits.view(mx.float32))
