"""The native batched step's tails (native_batched.py): each slot's entries after the
prefix that this rank holds, float32 numpy buffers the C step reads and writes in place,
and their way back into a sharded cache (a server's resident entry after its prompt's
rows)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..cache.cache import ShardedKVCache
from .prefix_batch import TailSlots


class NativeTails(TailSlots):
    """The native step's tails: per layer float32 keys and values (S, NKV, C, d), each
    entry rounded as the prefix's cache stores one."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []

    def grown(self, old_slots: int, old_capacity: int):
        """The buffers at the reserved size, entries kept (their addresses change:
        callers read them after)."""
        shape = (*self.positions.shape[:1], self.kv_heads, self.positions.shape[1],
                 self.head_dim)
        for buffers in (self.keys, self.values):
            for index in range(self.layers):
                grown = np.zeros(shape, np.float32)
                if index < len(buffers):
                    grown[:old_slots, :, :old_capacity] = buffers[index]
                    buffers[index] = grown
                else:
                    buffers.append(grown)

    def release(self):
        super().release()
        self.keys, self.values = [], []

    def take(self, index: int, slot: int, keys: mx.array, values: mx.array, start: int,
             stop: int):
        for into, buffer in ((self.keys, keys), (self.values, values)):
            into[index][slot, :, :stop - start] = _entries(buffer, start, stop)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))


def _entries(buffer: mx.array, start: int, stop: int) -> np.ndarray:
    """Entries [start, stop) of a cache layer's buffer (NKV, C, d), read through a
    zero-copy numpy view (numpy has no bfloat16: that one through MLX), each widened
    exactly to float32 by the assignment that takes it."""
    if buffer.dtype == mx.bfloat16:
        return np.asarray(buffer[:, start:stop].astype(mx.float32))
    mx.eval(buffer)
    return np.asarray(buffer)[:, start:stop]


def append_rows(tails: NativeTails, slot: int, placed: list[int], cache: ShardedKVCache,
                token_ids: np.ndarray):
    """Slot ``slot``'s last ``len(placed)`` rows (``placed``: each one's storing rank, in
    position order; this rank's entries are the last of its tail) appended to ``cache``
    at its next positions, every rank's positions recorded. The tail holds each entry
    rounded as the cache stores one: the cache gets the values the step attended to."""
    owners = np.array(placed, np.int64)
    positions = cache.num_tokens + np.arange(owners.size, dtype=np.int64)
    cache.add_positions([positions[owners == rank] for rank in range(cache.cp_size)],
                        token_ids)
    mine = int(np.count_nonzero(owners == cache.cp_rank))
    end = tails.lengths[slot]
    if not mine:
        return
    for index, layer in enumerate(cache.layers):
        layer.append_float32(tails.keys[index][slot, :, end - mine:end],
                             tails.values[index][slot, :, end - mine:end])
