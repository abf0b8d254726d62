"""Prefill attention's tiles in C on the CPU path: ``block_attention`` of many queries
through kernels/prefill_attention.h, on every thread of the rank.

MLX's CPU graph runs a tile's elementwise work (the mask, the row maxima, the
exponentials, the merges) on one thread and only its products through the BLAS: with
two threads a layer's attention over 3,000 keys ran less than 10% faster than with one
(a hand run on the 2-core AMD EPYC machine; docs/CPU_SPEED.md). The C kernel
takes each KV head's query heads over a block of positions as one task, on the native
decode step's pool of threads (as many as the BLAS may use, blas/libraries.py), and
computes the same (out, lse) partial to float32 rounding (the sums in another order).
Used where the arrays live in CPU memory and the library is there (built with the
system's C compiler, kernels/decode_step.py) and ``--no-fast-exp`` is not given;
elsewhere, and for fewer than ``MIN_QUERIES`` queries (a decode step's), MLX's tiles
compute it.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from ..blas.libraries import rank_threads
from ..kernels import decode_step
from .exp import polynomial_exp_wanted

# Fewer query positions than this keep MLX's tiles: a decode query's attention has its
# own kernels (the native step's, or block.py's decode tile).
MIN_QUERIES = 16


@functools.lru_cache(maxsize=1)
def pooled_library():
    """The loaded library with its pool of threads started (the rank's threads), or None:
    for the prefill's kernels, which run outside a decode step (this module's attention,
    engine/activation.py's MLP gate)."""
    library, _ = decode_step.library()
    if library is not None:
        library.spmd_cp_decode_set_threads(rank_threads())
    return library


def usable(q: mx.array) -> bool:
    """Whether ``native_attention`` computes this block: enough queries, the arrays in
    CPU memory (MLX's default device), the polynomial exp allowed (``--no-fast-exp``
    keeps MLX's ops: its exp, its sums' order), the library built."""
    return (q.shape[1] >= MIN_QUERIES and mx.default_device() == mx.cpu
            and polynomial_exp_wanted() and pooled_library() is not None)


def _heads_apart(x) -> np.ndarray:
    """float32 (H, T, d) as numpy, its rows contiguous within each head and the heads
    any distance apart: the first T rows of a cache buffer (a prefill's shard of the
    cache, fetched at every layer) are read where they lie, not copied."""
    array = np.asarray(x)
    if (array.dtype != np.float32 or array.strides[2] != 4 or array.strides[1] != 4 * x.shape[2]
            or array.strides[0] % 4):
        array = np.ascontiguousarray(array, np.float32)
    return array


def native_attention(q, k, v, q_pos: np.ndarray, k_pos: np.ndarray, scale: float,
                     window: int | None = None):
    """``block_attention``'s (out, lse) of float32 ``q`` (NH, Tq, d) over ``k``, ``v``
    (NKV, Tk, d) at those positions, computed by the C kernel."""
    num_heads, tq, d = q.shape
    num_kv, tk, _ = k.shape
    keys, values = (_heads_apart(x) for x in (k, v))  # evaluates them
    step = keys.strides[0] // 4
    if values.strides[0] != keys.strides[0]:
        keys, values = (np.ascontiguousarray(x) for x in (keys, values))
        step = tk * d
    arrays = [np.ascontiguousarray(q, np.float32), keys, values]
    positions = [np.ascontiguousarray(p, np.int64) for p in (q_pos, k_pos)]
    out = np.empty((num_heads, tq, d), np.float32)
    lse = np.empty((num_heads, tq), np.float32)
    failed = pooled_library().spmd_cp_prefill_attend(
        *(a.ctypes.data for a in arrays + positions), num_heads, num_kv, tq, tk, d, step,
        float(scale), int(window or 0), out.ctypes.data, lse.ctypes.data)
    if failed:
        raise MemoryError("prefill attention: no memory for a thread's scratch")
    return mx.array(out), mx.array(lse)
