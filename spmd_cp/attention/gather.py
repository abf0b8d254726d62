"""All-gather CP attention: prefill gathers K/V (vLLM's PCP), decode gathers partials (DCP).

The simplest exact forms. Prefill: every rank receives every rank's K/V shard for the
layer, attends its own queries to all of it, and drops it before the next layer; bytes
sent per rank per layer: (N-1) * 2 * S_local * NKV * d * e. Decode: the new token's
query is replicated, each rank attends it to its own shard, and the (out, lse) partials
meet in one Allgather of NH * (d + 1) floats per rank per layer (in the KV dtype for the
fused kernel's partials on the GPU path, else float32, the lse's 32 bits riding along:
block.partial_dtype, block.pack_partial).

With fused attention (attention/fused.py; the GPU path) the gathered K/V are put in
position order and every query run is one fused call: no log-sum-exp anywhere.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..runtime.comm import Comm
from ..runtime.device import Compute
from .block import (SCORE_TILE_ELEMENTS, block_attention, decode_partial_packed,
                    merge_packed_sums, merge_stacked, merge_stacked_columns, pack_partial,
                    partial_dtype, unpack_partial, window_start)
from .exp import SOFTMAX_MIN_ELEMENTS, polynomial_exp_enabled, scalar
from .fused import decode_partial, fused_output, in_position_order


def allgather_kv_attention(comm: Comm, rank_positions: list[np.ndarray],
                           fused: bool | None = None, window_held: dict | None = None):
    """Prefill attention that gathers the whole layer's K/V on every rank.

    ``rank_positions``: every rank's cached positions (the cache's), which fix the order
    of the gathered keys; ``window_held``: per window, every rank's positions its layers
    hold where they dropped the keys behind every window (engine/cache/cache.py). ``fused``:
    MLX's fused attention (None: the default runtime.device.Compute's choice).
    """
    all_pos = np.concatenate(rank_positions)
    window_pos = {w: np.concatenate(held) for w, held in (window_held or {}).items()}
    fused = Compute.resolve().fused if fused is None else fused

    def attend(q, keys, values, q_pos, k_pos, scale, window=None):
        all_keys = comm.allgather_rows(keys, axis=1)
        all_values = comm.allgather_rows(values, axis=1)
        if fused and window is None:
            all_keys, all_values, positions = in_position_order(all_keys, all_values, all_pos)
            return fused_output(q, all_keys, all_values, q_pos, positions, scale)
        positions = all_pos if window is None else window_pos.get(window, all_pos)
        out, _ = block_attention(q, all_keys, all_values, q_pos, positions, scale, window)
        return out

    return attend


DECODE_MERGES = ("allgather", "allreduce")

# On one rank nothing is merged, so no lse is needed and MLX's fused attention can serve
# the decode query. It wins over few keys: 30 layers of 9 heads over 128 keys 1.02 against
# 1.16 ms. Where the softmax takes the compiled exp (exp.SOFTMAX_MIN_ELEMENTS scores),
# block_attention's decode tile is faster: over 256 / 1K / 3K keys 1.43 / 3.31 / 7.70
# against 1.61 / 5.53 / 15.64 ms. Without the compiled exp the fused attention serves up
# to FUSED_DECODE_MAX_KEYS (the measured crossing then: 30 layers over 1K keys 6.8 vs
# 10.4 ms, over 4K 49 vs 31; benchmarks/decode_overhead.py).
FUSED_DECODE_MAX_KEYS = 2048


def fused_decode_max_keys(num_heads: int) -> int:
    """The most keys one rank's decode query attends to through MLX's fused attention."""
    if polynomial_exp_enabled():
        return -(-SOFTMAX_MIN_ELEMENTS // num_heads) - 1  # the tile from its compiled exp on
    return FUSED_DECODE_MAX_KEYS


def decode_attention(comm: Comm, merge: str = "allgather", compute: Compute | None = None):
    """Attention of one replicated query over the sharded cache, merged across ranks.

    ``allgather``: one Allgather of every rank's (out, lse), then the local exact merge.
    ``allreduce`` (Tree Attention, arXiv 2408.04093): an Allreduce of the max lse, then an
    Allreduce-sum of the rescaled outputs and their weights: two smaller collectives
    whose size does not grow with N. Its sums stay float32 whatever the KV dtype.
    ``compute``: the model's path and attention kernel (runtime/device.Compute; None:
    the default's). ``comm``: a Comm, or
    graph collectives (runtime/graph_comm.py) that leave the merge inside MLX's graph.
    A sliding-window layer's query attends to the suffix of each shard inside its
    window (a rank caches its positions in increasing order), an empty one on most
    ranks; the partials merged are the same size.
    """
    compute = compute or Compute.resolve()
    fused, compiled_merge = compute.fused, not compute.gpu
    newest = {}  # the shard's newest position, found once a step: every layer's is the same

    def newest_key(k_pos: np.ndarray) -> int:
        if newest.get("of") is not k_pos:
            newest.update(of=k_pos, position=int(k_pos.max()) if k_pos.size else -1)
        return newest["position"]

    def attend(q, keys, values, q_pos, k_pos, scale, window=None):
        if window is not None:  # a sliding-window layer: the keys behind its window go
            start = window_start(k_pos, int(q_pos[0]), window)
            keys, values, k_pos = keys[:, start:], values[:, start:], k_pos[start:]
        if comm.size == 1:
            return single_rank_decode(q, keys, values, q_pos, k_pos, scale, fused)
        if compiled_merge and merge == "allgather" and not fused and _whole_shard(
                q, keys, q_pos, newest_key(k_pos)):
            partials = comm.allgather_stack(decode_partial_packed(q, keys, values, scale))
            merged = _merge_sums(partials, q.shape[-1], scalar(scale))
            return merged.reshape(q.shape)
        if fused:
            out, lse = decode_partial(q, keys, values, q_pos, k_pos, scale)
        else:
            out, lse = block_attention(q, keys, values, q_pos, k_pos, scale)  # (NH,1,d), (NH,1)
        if merge == "allreduce":
            lse_max = comm.allreduce(lse, "max")
            weight = mx.exp(lse - mx.where(lse_max == float("-inf"), 0.0, lse_max))[..., None]
            summed = comm.allreduce(mx.concatenate([weight * out, weight], axis=-1), "sum")
            total = summed[..., -1:]
            return summed[..., :-1] / mx.where(total > 0, total, 1.0)
        partials = comm.allgather_stack(pack_partial(out, lse, partial_dtype(keys.dtype, fused)))
        if partials.dtype == mx.float32 and compiled_merge:
            return _merge_float32(partials, q.shape[-1]).reshape(q.shape)
        merged, _ = merge_stacked(*unpack_partial(partials, q.shape[-1]))
        return merged

    return attend


def _whole_shard(q, keys, q_pos, newest_key: int) -> bool:
    """Whether one float32 query row sees this rank's whole shard (its newest position
    ``newest_key``, -1 if empty) in one score tile (decode on the CPU path): then its
    partial travels unnormalized (block.decode_partial_packed), in fewer graph nodes
    than (out, lse)."""
    return (q.shape[1] == 1 and q.dtype == keys.dtype == mx.float32
            and q_pos[0] >= newest_key and q.shape[0] * keys.shape[1] <= SCORE_TILE_ELEMENTS)


# Compiled once (the shapes of a model's decode partials stay; only N varies them).
_merge_sums = mx.compile(merge_packed_sums)


@mx.compile
def _merge_float32(partials: mx.array, head_dim: int) -> mx.array:
    """The merged output (1, NH, 1, d) of float32 partials packed as (N, NH, 1, d + 1),
    compiled, with the lse kept as the packed column and no axis squeezed: on the CPU
    path the merge's graph nodes per layer fall from 25 to 9 with the caller's reshape
    (engine/decode/one_token.py says why that counts); the same arithmetic as
    ``merge_stacked``, bit for bit (tests/test_one_token.py)."""
    return merge_stacked_columns(partials[..., :head_dim], partials[..., head_dim:])[0]


def single_rank_decode(q, keys, values, q_pos, k_pos, scale, fused: bool):
    """One rank: nothing to merge, so no lse. The decode query sees every cached key."""
    if fused:
        return mx.fast.scaled_dot_product_attention(q[None], keys[None], values[None],
                                                    scale=scale).squeeze(0)  # a view
    if keys.shape[1] <= fused_decode_max_keys(q.shape[0]):
        q, keys, values = (x.astype(mx.float32)[None] for x in (q, keys, values))
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale).squeeze(0)
    return block_attention(q, keys, values, q_pos, k_pos, scale)[0]
