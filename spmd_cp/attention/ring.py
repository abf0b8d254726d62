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

Messages travel in the KV dtype (half precision on the GPU path; the partials' lse keeps
its 32 bits: block.pack_partial) and every merge accumulates in float32. With fused
attention (the GPU path) each partial is fused.fused_partial, and one rank, which merges
nothing, is a plain fused causal attention.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..runtime.comm import Comm
from ..runtime.device import use_fused_attention
from .block import (block_attention, lse_width, merge_partials, merge_stacked, pack_partial,
                    unpack_partial)
from .fused import fused_output, fused_partial


def _partial_attention(fused: bool | None):
    """The (out, lse) function of one block: fused on the GPU path (None: the policy)."""
    if fused is None:
        fused = use_fused_attention()
    return fused_partial if fused else block_attention


def _single_rank(partial):
    """One rank merges nothing: with the fused partial, skip the lse too."""

    def attend(q, keys, values, q_pos, k_pos, scale):
        if partial is fused_partial:
            return fused_output(q, keys, values, q_pos, k_pos, scale)
        return block_attention(q, keys, values, q_pos, k_pos, scale)[0]

    return attend


def pass_kv_attention(comm: Comm, cached_positions: list[np.ndarray], fused: bool | None = None):
    """Ring attention passing K/V. ``cached_positions``: every rank's cache positions."""
    size, rank = comm.size, comm.rank
    partial = _partial_attention(fused)
    if size == 1:
        return _single_rank(partial)

    def attend(q, keys, values, q_pos, k_pos, scale):
        block = mx.stack([keys, values])  # (2, NKV, S_owner, d): one message per step
        owner = rank  # whose shard ``block`` is
        out = lse = None
        for step in range(size):
            transfer = None
            if step < size - 1:
                # ring_prev forwards the shard it holds now: that of owner - 1.
                incoming = (owner - 1) % size
                shape = (2, keys.shape[0], cached_positions[incoming].size, keys.shape[2])
                transfer = comm.sendrecv_start(block, comm.ring_next, comm.ring_prev, shape)
            part_out, part_lse = partial(q, block[0], block[1], q_pos,
                                         cached_positions[owner], scale)
            if out is None:
                out, lse = part_out, part_lse
            else:
                out, lse = merge_partials(out, lse, part_out, part_lse)
            mx.eval(out, lse)  # compute now, while the transfer is in flight
            if transfer is not None:
                block, owner = transfer.wait(), incoming
        return out

    return attend


def pass_q_attention(comm: Comm, query_positions: list[np.ndarray], fused: bool | None = None):
    """Ring attention passing Q. ``query_positions``: every rank's new (query) positions."""
    size, rank = comm.size, comm.rank
    partial = _partial_attention(fused)
    if size == 1:
        return _single_rank(partial)

    def attend(q, keys, values, q_pos, k_pos, scale):
        num_heads, _, head_dim = q.shape
        visitor, owner = q, rank
        partials = [None] * size  # partials[o]: owner o's queries against my K/V
        for step in range(size):
            transfer = None
            if step < size - 1:
                incoming = (owner - 1) % size
                shape = (num_heads, query_positions[incoming].size, head_dim)
                transfer = comm.sendrecv_start(visitor, comm.ring_next, comm.ring_prev, shape)
            out, lse = partial(visitor, keys, values, query_positions[owner], k_pos, scale)
            partials[owner] = pack_partial(out, lse, keys.dtype)
            mx.eval(partials[owner])
            if transfer is not None:
                visitor, owner = transfer.wait(), incoming
        n_local = query_positions[rank].size
        width = head_dim + lse_width(keys.dtype)
        returned = comm.alltoallv_arrays(partials, [(num_heads, n_local, width)] * size)
        stacked = mx.stack(returned)  # (N, NH, n, d+w): my queries against every shard
        out, _ = merge_stacked(*unpack_partial(stacked, head_dim))
        return out

    return attend
