"""Ring CP attention: pass-KV and pass-Q (Yang et al. 2024, arXiv 2411.01783).

pass-KV: the K/V shards travel the ring, N-1 Sendrecv steps; every rank merges its
queries' partial attention against each shard as it passes. The next shard's transfer
is in flight while the current one is computed. Bytes sent per rank per layer: the
shards it forwards, (N-1) * 2 * S/N * NKV * d * e on average (S = cached + new tokens).

pass-Q: the query blocks travel instead; every rank attends each visiting query block
to its stationary local K/V (cached prefix included) and keeps the partial for its
owner; one Alltoallv returns the partials home, where they are merged. Ring bytes per
rank per layer: (N-1) * T/N * NH * d * e; Alltoallv: (N-1) * T/N * NH * (d+1) * e.
Cheaper than pass-KV when few new tokens attend to a long cached prefix.

A sliding-window layer (``window``) under pass-KV takes window.py's exchange instead:
each rank receives only the keys its queries' windows reach, from their owners, and no
shard is forwarded. Under pass-Q the queries travel as before and each block is
attended within the window (tiles behind it are skipped).

K/V and Q messages travel in the KV dtype (half precision on the GPU path); a partial in
the precision it was computed to (block.partial_dtype: the fused kernel's in the KV dtype,
the tiled blocks' in float32; its lse keeps its 32 bits: block.pack_partial), and every
merge accumulates in float32. With fused attention (the GPU path) each partial is
fused.fused_partial, and one rank, which merges nothing, is a plain fused causal
attention.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..runtime.comm import Comm
from ..runtime.device import Compute
from .block import (block_attention, lse_width, merge_partials, merge_stacked, pack_partial,
                    partial_dtype, unpack_partial)
from .fused import fused_output, fused_partial
from .window import window_kv_attention


def _partial_attention(fused: bool | None):
    """The (out, lse) function of one block: MLX's fused attention or the tiled blocks
    (None: the default runtime.device.Compute's choice)."""
    if fused is None:
        fused = Compute.resolve().fused
    return fused_partial if fused else block_attention


def _single_rank(partial):
    """One rank merges nothing: with the fused partial, skip the lse too."""

    def attend(q, keys, values, q_pos, k_pos, scale, window=None):
        if partial is fused_partial:
            return fused_output(q, keys, values, q_pos, k_pos, scale, window)
        return block_attention(q, keys, values, q_pos, k_pos, scale, window)[0]

    return attend


def ring_pass(comm: Comm, payload: mx.array, shape_of):
    """Yield ``(owner, payload)`` for the N steps of a ring: step s holds the payload that
    rank ``rank - s`` started with. The next payload's Sendrecv (to ``ring_next``, from
    ``ring_prev``, which forwards what it holds: that of ``owner - 1``, shaped
    ``shape_of(owner - 1)``) is in flight while the caller computes on this one; the
    caller evaluates its work before asking for the next step."""
    owner = comm.rank
    for step in range(comm.size):
        transfer = None
        if step < comm.size - 1:
            incoming = (owner - 1) % comm.size
            transfer = comm.sendrecv_start(payload, comm.ring_next, comm.ring_prev,
                                           shape_of(incoming))
        yield owner, payload
        if transfer is not None:
            payload, owner = transfer.wait(), incoming


def pass_kv_attention(comm: Comm, cached_positions: list[np.ndarray], fused: bool | None = None,
                      query_positions: list[np.ndarray] | None = None,
                      window_held: dict | None = None):
    """Ring attention passing K/V. ``cached_positions``: every rank's cache positions;
    ``query_positions``: every rank's new (query) positions, which a sliding-window layer
    needs (window.py; None: this call has no such layer); ``window_held``: per window,
    every rank's positions its layers hold where they dropped keys (cache.py)."""
    size = comm.size
    partial = _partial_attention(fused)
    if size == 1:
        return _single_rank(partial)
    windowed = None if query_positions is None else window_kv_attention(
        comm, cached_positions, query_positions, window_held)

    def attend(q, keys, values, q_pos, k_pos, scale, window=None):
        if window is not None:
            return windowed(q, keys, values, q_pos, k_pos, scale, window)
        block = mx.stack([keys, values])  # (2, NKV, S_owner, d): one message per step

        def shape_of(owner):
            return (2, keys.shape[0], cached_positions[owner].size, keys.shape[2])

        out = lse = None
        for owner, shard in ring_pass(comm, block, shape_of):
            part_out, part_lse = partial(q, shard[0], shard[1], q_pos,
                                         cached_positions[owner], scale)
            if out is None:
                out, lse = part_out, part_lse
            else:
                out, lse = merge_partials(out, lse, part_out, part_lse)
            mx.eval(out, lse)  # compute now, while the next transfer is in flight
        return out

    return attend


def pass_q_attention(comm: Comm, query_positions: list[np.ndarray], fused: bool | None = None):
    """Ring attention passing Q. ``query_positions``: every rank's new (query) positions."""
    size, rank = comm.size, comm.rank
    partial = _partial_attention(fused)
    if size == 1:
        return _single_rank(partial)

    def attend(q, keys, values, q_pos, k_pos, scale, window=None):
        num_heads, _, head_dim = q.shape
        partials = [None] * size  # partials[o]: owner o's queries against my K/V
        message = partial_dtype(keys.dtype, partial is fused_partial)

        def shape_of(owner):
            return (num_heads, query_positions[owner].size, head_dim)

        for owner, visitor in ring_pass(comm, q, shape_of):
            out, lse = partial(visitor, keys, values, query_positions[owner], k_pos, scale,
                               window)
            partials[owner] = pack_partial(out, lse, message)
            mx.eval(partials[owner])  # compute now, while the next transfer is in flight
        n_local = query_positions[rank].size
        width = head_dim + lse_width(message)
        returned = comm.alltoallv_arrays(partials, [(num_heads, n_local, width)] * size)
        stacked = mx.stack(returned)  # (N, NH, n, d+w): my queries against every shard
        out, _ = merge_stacked(*unpack_partial(stacked, head_dim))
        return out

    return attend
