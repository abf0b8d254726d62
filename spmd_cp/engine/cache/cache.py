"""The sharded KV cache: this rank's slice of every layer's keys and values.

Each rank caches the K/V of the positions it owns, in the order they arrived. The
global position of every cached entry is kept beside it (one array shared by all
layers), because attention masks come from positions, never from buffer offsets.
Every rank also tracks every rank's shard size, so ownership decisions (where the next
prefill extras and decode tokens go) need no communication.

A sliding-window layer (window W: a query at p sees keys p - W + 1 .. p) may drop the
keys no later query can see once a prefill has passed them (``drop_behind_window``):
it then holds a suffix of the rank's positions, those at or after its window's floor,
and ``layer_positions`` / ``rank_positions_within`` name them. At 30K tokens that is
most of a Gemma 3 cache (five of every six layers keep 512 keys, not 30K). Whoever
owns the cache says how far back it may later be truncated (``rewinds_to``): keys a
query from there on could see are kept.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ...attention.partition import decode_owner


_BUFFER_VERSIONS = itertools.count()  # LayerKV.buffers_version: never the same twice


class LayerKV:
    """One layer's local keys and values, (NKV, S, d), grown in steps like mlx-lm's KVCache."""

    step = 256

    def __init__(self, dtype: mx.Dtype | None = None):
        self.keys = None
        self.values = None
        self.offset = 0
        self.dtype = dtype  # what appends are stored as (None: as they arrive)
        # Entries of the rank's positions before this buffer's first: a sliding-window
        # layer's keys behind every later window, dropped (drop_front).
        self.dropped = 0
        # Renewed at every change that may move the buffers (MLX's ``a[...] = b`` may give
        # the same array object a new one), unique across all caches of the process (a
        # cache built after another is freed may live at its address): a native decode
        # step re-reads the buffers' addresses when it differs from the one it saw.
        self.buffers_version = next(_BUFFER_VERSIONS)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append (NKV, n, d) keys/values; return the whole local shard including them."""
        if self.dtype is not None:
            keys, values = keys.astype(self.dtype), values.astype(self.dtype)
        n = keys.shape[1]
        if n == 0:
            return self.fetch() if self.keys is not None else (keys, values)
        self._make_room(n, keys.shape[0], keys.shape[2], keys.dtype, values.dtype)
        self.buffers_version = next(_BUFFER_VERSIONS)
        if self.offset == 0 and n == self.keys.shape[1]:
            # MLX answers an update of the whole buffer with the update itself, which may
            # be a transposed view of the projection: the buffers must be contiguous rows
            # (the native decode step writes into them in place).
            self.keys, self.values = mx.contiguous(keys), mx.contiguous(values)
        else:
            self.keys[:, self.offset : self.offset + n] = keys
            self.values[:, self.offset : self.offset + n] = values
        self.offset += n
        return self.keys[:, : self.offset], self.values[:, : self.offset]

    def _make_room(self, n: int, kv_heads: int, head_dim: int, key_dtype: mx.Dtype,
                   value_dtype: mx.Dtype):
        """Capacity for ``n`` more entries (grown by whole steps, the entries kept)."""
        if self.keys is not None and self.offset + n <= self.keys.shape[1]:
            return
        self.buffers_version = next(_BUFFER_VERSIONS)
        grow = ((n + self.step - 1) // self.step) * self.step
        shape = (kv_heads, grow, head_dim)
        new_k, new_v = mx.zeros(shape, key_dtype), mx.zeros(shape, value_dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys[:, : self.offset], new_k], axis=1)
            self.values = mx.concatenate([self.values[:, : self.offset], new_v], axis=1)

    def append_float32(self, keys: np.ndarray, values: np.ndarray):
        """Append (NKV, n, d) float32 keys/values that the cache's dtype holds exactly
        (a native step's entries, rounded as this cache stores them), written into the
        buffers in place through numpy views: no MLX op (an update a layer copied a
        whole buffer)."""
        n = keys.shape[1]
        dtype = self.dtype or mx.float32
        self._make_room(n, keys.shape[0], keys.shape[2], dtype, dtype)
        mx.eval(self.keys, self.values)
        self.buffers_version = next(_BUFFER_VERSIONS)
        for buffer, new in ((self.keys, keys), (self.values, values)):
            if buffer.dtype == mx.bfloat16:  # its upper half: exact for bfloat16 values
                view, new = np.asarray(buffer.view(mx.uint16)), \
                    (np.ascontiguousarray(new, np.float32).view(np.uint32) >> 16)
            else:
                view = np.asarray(buffer)
            view[:, self.offset:self.offset + n] = new
        self.offset += n

    def reserve_row(self, kv_heads: int, head_dim: int) -> int:
        """The row of one more entry, which the caller writes into the buffers in place
        once evaluated (engine/decode/native_decode.py); it counts from now on."""
        dtype = self.dtype or mx.float32
        self._make_room(1, kv_heads, head_dim, dtype, dtype)
        self.offset += 1
        return self.offset - 1

    def truncate(self, length: int):
        """Keep the rank's first ``length`` positions' entries (the buffer is reused by
        later appends); an empty layer forgets what it dropped."""
        self.offset = min(self.offset, max(length - self.dropped, 0))
        if length == 0:
            self.dropped = 0

    def drop_front(self, count: int):
        """Forget the first ``count`` entries and hand their memory back now: the rest
        are copied into buffers of their own (evaluated here, so the old ones go)."""
        count = min(count, self.offset)
        if count <= 0:
            return
        self.keys = mx.contiguous(self.keys[:, count:self.offset])
        self.values = mx.contiguous(self.values[:, count:self.offset])
        mx.eval(self.keys, self.values)
        self.offset -= count
        self.dropped += count
        self.buffers_version = next(_BUFFER_VERSIONS)

    def shard(self, k: mx.array, v: mx.array, store: bool):
        """This rank's keys/values for the layer after (maybe) appending the new ``k``,
        ``v``, in their dtype (a half-precision cache on the CPU path read in float32).
        (A batched decode step's layers answer the same call: batched_decode.py.)"""
        if store:
            keys, values = self.update_and_fetch(k, v)
        else:
            keys, values = self.fetch()
            if keys is None:  # nothing cached here yet: an empty shard of the right shape
                return k[:, :0], v[:, :0]
        if keys.dtype != k.dtype:
            keys, values = keys.astype(k.dtype), values.astype(k.dtype)
        return keys, values

    def fetch(self):
        if self.keys is None:
            return None, None
        return self.keys[:, : self.offset], self.values[:, : self.offset]

    @property
    def capacity(self) -> int:
        """Entries the buffers hold room for: at most ``step - 1`` beyond the most this
        layer held since it last grew, and unchanged by ``truncate``."""
        return 0 if self.keys is None else self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V entries held (not of spare capacity)."""
        if self.keys is None:
            return 0
        per_token = self.keys.shape[0] * self.keys.shape[2] * self.keys.dtype.size
        return 2 * self.offset * per_token


class GrowingInts:
    """An int64 array appended to at its end, in a buffer that doubles as it fills: a
    decode step's one position costs O(1), not a copy of every position so far (8 MB a
    token at a million). ``values`` is a view; an append or a truncation may reuse the
    buffer's tail, so a view held across them may change (none is: readers take the
    current one)."""

    def __init__(self):
        self._buffer = np.zeros(0, np.int64)
        self._size = 0

    @property
    def values(self) -> np.ndarray:
        return self._buffer[:self._size]

    def extend(self, values) -> np.ndarray:
        values = np.asarray(values, np.int64).reshape(-1)
        end = self._size + values.size
        if end > self._buffer.size:
            grown = np.zeros(max(end, 2 * self._buffer.size, 64), np.int64)
            grown[:self._size] = self._buffer[:self._size]
            self._buffer = grown
        self._buffer[self._size:end] = values
        self._size = end
        return self.values

    def truncate(self, size: int) -> np.ndarray:
        self._size = min(self._size, size)
        return self.values


NO_REWIND = np.iinfo(np.int64).max  # ShardedKVCache.rewinds_to: never truncated back


class Checkpoint(NamedTuple):
    """What ``ShardedKVCache.rollback`` returns to: a length and the decode placement."""

    num_tokens: int
    decode_steps: int
    decode_owner: int


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
        self._positions = [GrowingInts() for _ in range(cp_size)]
        self.rank_positions = [p.values for p in self._positions]  # views, in rank order
        self.num_tokens = 0  # tokens cached across all ranks (= next global position)
        self._token_ids = GrowingInts()
        self.token_ids = self._token_ids.values  # the id at every global position (a view)
        self.decode_steps = 0  # tokens added by decode: the placement rule counts them
        self.decode_owner = 0
        # The fewest tokens the owner may later truncate this cache back to (besides
        # none): a sliding-window layer keeps every key a query from there on may see.
        # 0 (the default) keeps every key; NO_REWIND: only what the next query may see.
        self.rewinds_to = 0
        self.window_floors: dict[int, int] = {}  # window -> its layers' first position held

    @property
    def positions(self) -> np.ndarray:
        """This rank's cached positions, in the order of its K/V entries."""
        return self.rank_positions[self.cp_rank]

    def layer_positions(self, layer: "LayerKV") -> np.ndarray:
        """This rank's positions of ``layer``'s entries (a suffix of ``positions``)."""
        return self.positions[layer.dropped:]

    def rank_positions_within(self, window: int | None) -> list[np.ndarray]:
        """Every rank's positions held by the layers of ``window`` (None: every layer's
        positions): each rank's suffix from the window's floor on."""
        floor = self.window_floors.get(window, 0) if window is not None else 0
        if floor <= 0:
            return self.rank_positions
        return [p[np.searchsorted(p, floor):] for p in self.rank_positions]

    def drop_behind_window(self, index: int, window: int):
        """Drop layer ``index``'s keys that no query at or after ``num_tokens`` (nor,
        after a truncation, at or after ``rewinds_to``) can see through ``window``.
        Every rank calls it for the same layers at the same point (a prefill's), so
        all keep the same floors."""
        floor = min(self.num_tokens, self.rewinds_to) - window + 1
        layer = self.layers[index]
        layer.drop_front(int(np.searchsorted(self.layer_positions(layer), floor)))
        if floor > self.window_floors.get(window, 0):
            self.window_floors[window] = floor

    @property
    def shard_sizes(self) -> list[int]:
        return [int(p.size) for p in self.rank_positions]

    def add_positions(self, rank_positions: list[np.ndarray], token_ids: np.ndarray):
        """Record a forward pass's new positions on every rank (before its layers run)
        and the token ids at those positions (consecutive, from ``num_tokens`` on)."""
        self.token_ids = self._token_ids.extend(token_ids)
        for rank, positions in enumerate(rank_positions):
            self.rank_positions[rank] = self._positions[rank].extend(positions)
            self.num_tokens += int(positions.size)

    def append_placed(self, owners: np.ndarray, token_ids: np.ndarray, keys: list,
                      values: list, placement: tuple[int, int]):
        """Append tokens a decode step placed elsewhere (a native batched step's rows):
        ``owners`` each one's storing rank in position order, from ``num_tokens`` on;
        ``keys``/``values`` per layer this rank's entries of them (NKV, n, d), float32
        that this cache's dtype holds exactly (LayerKV.append_float32); ``placement``
        the decode placement rule's state after them (decode_steps, decode_owner)."""
        positions = self.num_tokens + np.arange(owners.size, dtype=np.int64)
        self.add_positions([positions[owners == rank] for rank in range(self.cp_size)],
                           token_ids)
        if np.any(owners == self.cp_rank):
            for layer, layer_keys, layer_values in zip(self.layers, keys, values):
                layer.append_float32(layer_keys, layer_values)
        self.decode_steps, self.decode_owner = placement

    def place_decode_token(self, interleave: int) -> int:
        """The rank that caches the next decode token (counted as placed).

        Every rank runs the same rule on the same shard sizes, so all agree unasked.
        """
        self.decode_owner = decode_owner(self.shard_sizes, self.decode_steps, interleave,
                                         self.decode_owner)
        self.decode_steps += 1
        return self.decode_owner

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(self.num_tokens, self.decode_steps, self.decode_owner)

    def rollback(self, checkpoint: Checkpoint):
        """Back to ``checkpoint``: positions after it forgotten, decode placement restored
        (a decode step queued past the token that ended a generation is undone so)."""
        self.truncate(checkpoint.num_tokens)
        self.decode_steps, self.decode_owner = checkpoint.decode_steps, checkpoint.decode_owner

    def set_token(self, position: int, token_id: int):
        """Record the id of a token that was fed before its value was known (-1)."""
        self.token_ids[position] = token_id

    def truncate(self, num_tokens: int):
        """Forget every position >= ``num_tokens`` on every rank (e.g. back to a shared
        document after answering one question about it).

        Positions arrive in increasing order on each rank, so what stays is a prefix of
        each rank's entries. A sliding-window layer must still hold what a query at
        ``num_tokens`` sees (the owner's ``rewinds_to`` promised it); 0 empties it all.
        """
        lost = [w for w, floor in self.window_floors.items() if floor > num_tokens - w + 1]
        if num_tokens and lost:
            raise ValueError(f"cannot truncate to {num_tokens} tokens: sliding-window layers "
                             f"dropped the keys before {self.window_floors[lost[0]]}")
        if num_tokens == 0:
            self.window_floors = {}
        for rank, positions in enumerate(self.rank_positions):
            kept = int(np.count_nonzero(positions < num_tokens))  # a prefix
            self.rank_positions[rank] = self._positions[rank].truncate(kept)
        keep = self.rank_positions[self.cp_rank].size
        for layer in self.layers:
            layer.truncate(keep)
        self.num_tokens = min(self.num_tokens, num_tokens)
        self.token_ids = self._token_ids.truncate(self.num_tokens)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def capacity(self) -> int:
        """This rank's K/V room in tokens: the memory its buffers take is this many
        tokens' (every layer grows alike)."""
        return max((layer.capacity for layer in self.layers), default=0)

    # -- saving and restoring (prompt_cache.py) ------------------------------------------
    def state(self) -> tuple[dict, dict]:
        """(this rank's arrays, the facts every rank shares) to save the cache by.

        The arrays: "positions" and each non-empty layer's "layer.<i>.keys"/"values";
        the facts (JSON types): token ids, shard sizes and the decode placement.
        """
        if self.window_floors:
            raise ValueError("a cache whose sliding-window layers dropped keys is not saved")
        arrays = {"positions": mx.array(self.positions)}
        for index, layer in enumerate(self.layers):
            keys, values = layer.fetch()
            if keys is not None and keys.shape[1] > 0:
                arrays[f"layer.{index}.keys"] = keys
                arrays[f"layer.{index}.values"] = values
        shared = {"num_tokens": self.num_tokens, "token_ids": self.token_ids.tolist(),
                  "shard_sizes": self.shard_sizes, "decode_steps": self.decode_steps,
                  "decode_owner": self.decode_owner}
        return arrays, shared

    @classmethod
    def from_state(cls, num_layers: int, cp_rank: int, rank_positions: list[np.ndarray],
                   arrays: dict, shared: dict, dtype: mx.Dtype | None = None) -> "ShardedKVCache":
        """The cache ``state()`` described, given every rank's "positions" array
        (``dtype``: the KV dtype new entries are stored as, as in ``__init__``).

        Raises ValueError when the positions disagree with the shared facts.
        """
        cache = cls(num_layers, cp_rank, len(rank_positions), dtype)
        cache.add_positions([np.asarray(p, np.int64) for p in rank_positions],
                            np.asarray(shared["token_ids"], np.int64))
        if (cache.shard_sizes != list(shared["shard_sizes"])
                or cache.num_tokens != shared["num_tokens"]):
            raise ValueError("shard sizes do not match")
        for index, layer in enumerate(cache.layers):
            if f"layer.{index}.keys" in arrays:
                layer.update_and_fetch(arrays[f"layer.{index}.keys"],
                                       arrays[f"layer.{index}.values"])
        cache.decode_steps, cache.decode_owner = shared["decode_steps"], shared["decode_owner"]
        return cache
