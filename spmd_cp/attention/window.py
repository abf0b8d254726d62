"""Sliding-window layers under pass-KV: each rank receives only the keys its queries'
windows reach, straight from their owners.

A ring forwards every shard through every rank, N - 1 steps. A local layer of window W
(Gemma 3's) lets a query at position p see the keys at p - W + 1 to p only, so with
head-tail shards most of a shard lies behind every window of most ranks: at 8K tokens
on 4 ranks (2,048-token shards) and W = 1,024, a rank's queries see at most two other
ranks' 1,024-token chunks, and only the neighbouring chunks of its own. So a windowed
layer sends each other rank exactly the keys that rank's queries can see, in one
Alltoallv: nothing is forwarded, no key travels that no query of its receiver sees,
and each rank then attends to its own shard and what arrived, within the window.

What is sent is decided from positions alone (every rank knows every rank's cached and
query positions), once per prefill call and window, so all ranks agree on every
message's size without asking.

The bytes are tallied on the communicator beside the total (``--json``'s
``window_kv_bytes``), with what a full ring would have forwarded for the same layers
(``window_kv_ring_bytes``): the saving is their difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .block import block_attention


def keys_seen(k_pos: np.ndarray, q_pos: np.ndarray, window: int) -> np.ndarray:
    """Indices into ``k_pos`` of the keys some query at ``q_pos`` sees through
    ``window`` (k <= q < k + window): per key, the first query at or after it decides."""
    if k_pos.size == 0 or q_pos.size == 0:
        return np.zeros(0, np.int64)
    queries = np.sort(q_pos)
    first = np.searchsorted(queries, k_pos, side="left")
    seen = first < queries.size
    seen[seen] = queries[first[seen]] < k_pos[seen] + window
    return np.flatnonzero(seen)


@dataclass(frozen=True)
class WindowPlan:
    """One rank's messages for one window: per rank, the indices of this rank's keys it
    is sent (nothing to itself), and the positions of the keys it sends this rank."""

    send: list
    recv: list

    @classmethod
    def of(cls, rank: int, cached_positions: list, query_positions: list, window: int):
        size = len(cached_positions)
        mine = cached_positions[rank]
        empty = np.zeros(0, np.int64)
        send = [empty if r == rank else keys_seen(mine, query_positions[r], window)
                for r in range(size)]
        recv = [empty if r == rank else cached_positions[r][
                    keys_seen(cached_positions[r], query_positions[rank], window)]
                for r in range(size)]
        return cls(send, recv)


def busiest_exchange(cached_positions: list, query_positions: list, window: int) -> int:
    """Keys the busiest rank sends or receives in one windowed layer's exchange: the
    sizes every rank's ``WindowPlan`` gives (what ``--cp-algo auto`` weighs, choose.py)."""
    size = len(cached_positions)
    counts = np.array([[0 if s == r else keys_seen(cached_positions[s], query_positions[r],
                                                   window).size
                        for r in range(size)] for s in range(size)])  # [sender, receiver]
    return int(max(counts.sum(axis=1).max(), counts.sum(axis=0).max()))


def ring_key_count(rank: int, shard_sizes: list) -> int:
    """Keys a full pass-KV ring has ``rank`` forward: the shards of N - 1 owners."""
    size = len(shard_sizes)
    return sum(shard_sizes[(rank - step) % size] for step in range(size - 1))


def window_kv_attention(comm, cached_positions: list, query_positions: list,
                        held: dict | None = None):
    """Attention of a sliding-window layer by the exchange above: ``attend(q, keys,
    values, q_pos, k_pos, scale, window)``. ``cached_positions``: every rank's cache
    positions; ``query_positions``: every rank's new (query) positions of this call;
    ``held``: per window, every rank's positions its layers hold where they dropped the
    keys behind every window (engine/cache/cache.py)."""
    plans: dict = {}  # window -> WindowPlan, made once per call
    ring_keys = ring_key_count(comm.rank, [p.size for p in cached_positions])
    held = held or {}

    def attend(q, keys, values, q_pos, k_pos, scale, window):
        if window not in plans:
            plans[window] = WindowPlan.of(comm.rank, held.get(window, cached_positions),
                                          query_positions, window)
        plan = plans[window]
        block = mx.stack([keys, values])  # (2, NKV, S, d): one message per receiver
        num_kv, head_dim = keys.shape[0], keys.shape[2]
        sends = [mx.take(block, mx.array(index.astype(np.int32)), axis=2)
                 for index in plan.send]
        before = comm.bytes_sent
        received = comm.alltoallv_arrays(
            sends, [(2, num_kv, p.size, head_dim) for p in plan.recv])
        key_bytes = 2 * num_kv * head_dim * block.dtype.size
        comm.window_kv_bytes += comm.bytes_sent - before
        comm.window_kv_ring_bytes += ring_keys * key_bytes
        others = [r for r in range(comm.size) if r != comm.rank and plan.recv[r].size]
        all_keys = mx.concatenate([keys] + [received[r][0] for r in others], axis=1)
        all_values = mx.concatenate([values] + [received[r][1] for r in others], axis=1)
        positions = np.concatenate([k_pos] + [plan.recv[r] for r in others])
        out, _ = block_attention(q, all_keys, all_values, q_pos, positions, scale, window)
        return out

    return attend
