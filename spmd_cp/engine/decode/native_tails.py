"""The native batched step's tails (native_batched.py): each slot's entries after the
prefix that this rank holds, float32 numpy buffers the C step reads and writes in place."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .prefix_batch import TailSlots


class NativeTails(TailSlots):
    """The native step's tails: per layer float32 keys and values (S, NKV, C, d), each
    entry rounded as the prefix's cache stores one."""

    # Slots double as they grow: a server's requests join one by one, and each growth
    # copies every slot's buffers and touches new pages (60-80 ms at 8 slots of 128
    # entries for SmolLM2 at N = 2, by hand).
    slot_growth = 2

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

    def last_entries(self, slot: int, count: int) -> tuple[list, list]:
        """Slot ``slot``'s last ``count`` entries here, per layer (NKV, count, d) views of
        the keys and of the values."""
        end = self.lengths[slot]
        return ([k[slot, :, end - count:end] for k in self.keys],
                [v[slot, :, end - count:end] for v in self.values])

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))


def _entries(buffer: mx.array, start: int, stop: int) -> np.ndarray:
    """Entries [start, stop) of a cache layer's buffer (NKV, C, d), read through a
    zero-copy numpy view (numpy has no bfloat16: that one through MLX), each widened
    exactly to float32 by the assignment that takes it."""
    if buffer.dtype == mx.bfloat16:
        return np.asarray(buffer[:, start:stop].astype(mx.float32))
    return np.asarray(buffer)[:, start:stop]
