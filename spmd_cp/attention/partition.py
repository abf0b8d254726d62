"""Which rank holds which sequence positions. Pure functions: no MPI, no MLX.

Head-tail ("load-balanced", "zigzag", DualChunkSwap) sharding: the new tokens of a
prefill call are cut into 2N chunks and rank i takes chunks i and 2N-1-i, so every rank
gets one cheap early chunk and one expensive late chunk and the causal work is even.
Every rank computes every rank's positions: the ring algorithms need their peers'
positions for masking and the Alltoall sizes.
"""

from __future__ import annotations

import numpy as np


def head_tail_positions(
    num_tokens: int, cp_size: int, start: int = 0, shard_sizes=None
) -> list[np.ndarray]:
    """Global positions of new tokens ``[start, start + num_tokens)`` for each rank.

    Args:
        num_tokens: tokens in this prefill call (any value >= 0; fewer than ``cp_size``
            leaves some ranks empty).
        cp_size: number of ranks N.
        start: global position of the first new token (tokens already cached).
        shard_sizes: tokens each rank already caches; when the 2N chunks cannot be
            equal, the extra tokens go to the least loaded ranks so that shards stay
            balanced over many chunked-prefill calls.

    Returns:
        A list of N sorted int64 arrays that together cover the range exactly once.
    """
    num_chunks = 2 * cp_size
    base, extra = divmod(num_tokens, num_chunks)
    loads = np.zeros(cp_size, np.int64) if shard_sizes is None else np.asarray(shard_sizes)
    by_load = np.argsort(loads, kind="stable")
    chunk_sizes = np.full(num_chunks, base, np.int64)
    for k in range(extra):
        # First give every rank's head chunk one extra token, then the tail chunks.
        rank = by_load[k % cp_size]
        chunk_sizes[rank if k < cp_size else num_chunks - 1 - rank] += 1
    bounds = start + np.concatenate([[0], np.cumsum(chunk_sizes)])
    chunk = [np.arange(bounds[c], bounds[c + 1], dtype=np.int64) for c in range(num_chunks)]
    return [np.concatenate([chunk[r], chunk[num_chunks - 1 - r]]) for r in range(cp_size)]


def owner_of(position: int, rank_positions: list[np.ndarray]) -> int:
    """The rank whose positions include ``position``."""
    for rank, positions in enumerate(rank_positions):
        if positions.size and np.any(positions == position):
            return rank
    raise ValueError(f"position {position} is on no rank")


def decode_owner(shard_sizes, decode_step: int, interleave: int, previous: int) -> int:
    """The rank that stores generated token number ``decode_step``'s K/V.

    Tokens go in runs of ``interleave`` (vLLM's cp_kv_cache_interleave_size) to the
    least loaded rank at the start of each run, so shard sizes never drift more than
    one run apart however long the answer grows.
    """
    if decode_step % interleave == 0:
        return least_loaded_rank(shard_sizes)
    return previous


def least_loaded_rank(shard_sizes) -> int:
    """The rank that caches the fewest tokens (lowest rank on ties).

    Decode places a generated token's K/V there: every rank knows every shard size, so
    all ranks agree on the owner without communicating.
    """
    return int(np.argmin(np.asarray(shard_sizes)))
