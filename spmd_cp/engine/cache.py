"""The sharded KV cache: this rank's slice of every layer's keys and values.

Each rank caches the K/V of the positions it owns, in the order they arrived. The
global position of every cached entry is kept beside it (one array shared by all
layers), because attention masks come from positions, never from buffer offsets.
Every rank also tracks every rank's shard size, so ownership decisions (where the next
prefill extras and decode tokens go) need no communication.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class LayerKV:
    """One layer's local keys and values, (NKV, S, d), grown in steps like mlx-lm's KVCache."""

    step = 256

    def __init__(self, dtype: mx.Dtype | None = None):
        self.keys = None
        self.values = None
        self.offset = 0
        self.dtype = dtype  # what appends are stored as (None: as they arrive)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append (NKV, n, d) keys/values; return the whole local shard including them."""
        if self.dtype is not None:
            keys, values = keys.astype(self.dtype), values.astype(self.dtype)
        n = keys.shape[1]
        if n == 0:
            return self.fetch() if self.keys is not None else (keys, values)
        if self.keys is None or self.offset + n > self.keys.shape[1]:
            grow = ((n + self.step - 1) // self.step) * self.step
            shape = (keys.shape[0], grow, keys.shape[2])
            new_k, new_v = mx.zeros(shape, keys.dtype), mx.zeros(shape, values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys[:, : self.offset], new_k], axis=1)
                self.values = mx.concatenate([self.values[:, : self.offset], new_v], axis=1)
        self.keys[:, self.offset : self.offset + n] = keys
        self.values[:, self.offset : self.offset + n] = values
        self.offset += n
        return self.keys[:, : self.offset], self.values[:, : self.offset]

    def truncate(self, length: int):
        """Keep the first ``length`` entries (the buffer is reused by later appends)."""
        self.offset = min(self.offset, length)

    def fetch(self):
        if self.keys is None:
            return None, None
        return self.keys[:, : self.offset], self.values[:, : self.offset]

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V entries held (not of spare capacity)."""
        if self.keys is None:
            return 0
        per_token = self.keys.shape[0] * self.keys.shape[2] * self.keys.dtype.size
        return 2 * self.offset * per_token


class ShardedKVCache:
    """All layers' local K/V plus the global positions they hold."""

    def __init__(self, num_layers: int, cp_rank: int, cp_size: int,
                 dtype: mx.Dtype | None = None):
        # dtype: the KV dtype (engine.model.kv_dtype_for: float32 on the CPU path, the
        # model's on a GPU); every rank must hold the same, it fixes the messages' layout.
        self.layers = [LayerKV(dtype) for _ in range(num_layers)]
        self.cp_rank = cp_rank
        self.cp_size = cp_size
        # Every rank's cached positions, in cache order. Partitioning is deterministic,
        # so all ranks keep identical copies without communicating (8 bytes a token).
        self.rank_positions = [np.zeros(0, np.int64) for _ in range(cp_size)]
        self.num_tokens = 0  # tokens cached across all ranks (= next global position)
        self.token_ids = np.zeros(0, np.int64)  # the id at every global position
        self.decode_steps = 0  # tokens added by decode: the placement rule counts them
        self.decode_owner = 0

    @property
    def positions(self) -> np.ndarray:
        """This rank's cached positions, in the order of its K/V entries."""
        return self.rank_positions[self.cp_rank]

    @property
    def shard_sizes(self) -> list[int]:
        return [int(p.size) for p in self.rank_positions]

    def add_positions(self, rank_positions: list[np.ndarray], token_ids: np.ndarray):
        """Record a forward pass's new positions on every rank (before its layers run)
        and the token ids at those positions (consecutive, from ``num_tokens`` on)."""
        self.token_ids = np.concatenate([self.token_ids, np.asarray(token_ids, np.int64)])
        for rank, positions in enumerate(rank_positions):
            self.rank_positions[rank] = np.concatenate([self.rank_positions[rank], positions])
            self.num_tokens += int(positions.size)

    def set_token(self, position: int, token_id: int):
        """Record the id of a token that was fed before its value was known (-1)."""
        self.token_ids[position] = token_id

    def truncate(self, num_tokens: int):
        """Forget every position >= ``num_tokens`` on every rank (e.g. back to a shared
        document after answering one question about it).

        Positions arrive in increasing order on each rank, so what stays is a prefix of
        each rank's entries.
        """
        for rank, positions in enumerate(self.rank_positions):
            self.rank_positions[rank] = positions[positions < num_tokens]
        keep = self.rank_positions[self.cp_rank].size
        for layer in self.layers:
            layer.truncate(keep)
        self.num_tokens = min(self.num_tokens, num_tokens)
        self.token_ids = self.token_ids[:self.num_tokens]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)
