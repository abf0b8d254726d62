"""What both batched decode steps share (batched_decode.py's MLX step, native_batched.py's
C one): the sequences decoded after one shared prefix, their slots of tail entries on
this rank, and where each sequence's next token is stored."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ...attention.partition import decode_owner
from ..cache.cache import ShardedKVCache

# Tail capacity grows in steps of this many entries (every slot at once).
TAIL_STEP = 64
# A free row's position: later than any query, so no mask lets a query see it.
NO_POSITION = np.iinfo(np.int64).max


@dataclass
class Sequence:
    """One sequence's place in the batch (the same on every rank)."""

    slot: int
    position: int  # the next token's global position
    tail_sizes: list[int]  # every rank's tail entries
    decode_steps: int  # the placement rule's state (ShardedKVCache's, per sequence)
    decode_owner: int
    # each row's storing rank since admit or the last write_back (where ``record``ed)
    placed: list[int] | None = None


class TailSlots:
    """Every slot's tail on this rank, the bookkeeping both steps share: the global
    position of every entry, (S, C), NO_POSITION where a row is free, and each slot's
    entry count. The keys and values are the subclass's (``take``, ``nbytes``)."""

    slot_growth = 1  # slots a growth makes, times those held (at least those asked)

    def __init__(self):
        self.positions = np.zeros((0, 0), np.int64)
        self.lengths: list[int] = []  # each slot's entries here

    def reserve(self, slots: int, capacity: int):
        """Room for ``slots`` slots of ``capacity`` entries; entries kept."""
        old_slots, old_capacity = self.positions.shape
        if slots <= old_slots and capacity <= old_capacity:
            return
        # capacity grows as asked (admit reserves a whole answer's room)
        slots = max(slots, self.slot_growth * old_slots) if slots > old_slots else old_slots
        capacity = -(-max(capacity, old_capacity) // TAIL_STEP) * TAIL_STEP
        positions = np.full((slots, capacity), NO_POSITION, np.int64)
        positions[:old_slots, :old_capacity] = self.positions
        self.positions = positions
        self.lengths += [0] * (slots - old_slots)
        self.grown(old_slots, old_capacity)

    def grown(self, old_slots: int, old_capacity: int):
        """After ``reserve`` grew the positions from (old_slots, old_capacity)."""

    def take(self, index: int, slot: int, keys: mx.array, values: mx.array, start: int,
             stop: int):
        """A sequence's entries, [start, stop) of a cache layer's buffers ``keys`` and
        ``values`` (NKV, C, d), into the start of ``slot``, layer ``index``."""
        raise NotImplementedError

    def settle(self):
        """After a sequence's entries were taken (before its rows in the prefix cache
        are reused)."""

    def release(self):
        """Every slot's memory handed back (no sequence holds one)."""
        self.positions = np.zeros((0, 0), np.int64)
        self.lengths = []

    def clear(self, slot: int):
        self.positions[slot] = NO_POSITION
        self.lengths[slot] = 0


class PrefixBatch:
    """What both batched steps share: the sequences after one shared prefix, their tails
    (a TailSlots) and their placement. Every rank makes the same calls in the same
    order: ``admit`` right after the engine prefilled a sequence's own tokens onto the
    prefix cache, ``step`` (the subclass's) for the sequences decoding now, ``retire``
    when one ends."""

    def __init__(self, engine, prefix: ShardedKVCache, prefix_tokens: int, tails: TailSlots):
        self.engine, self.model, self.comm = engine, engine.model, engine.cp
        self.prefix, self.prefix_tokens = prefix, prefix_tokens
        self.tails = tails
        self.sequences: dict = {}

    def admit(self, key, room: int, source: ShardedKVCache | None = None,
              record: bool = False):
        """Move the tokens the engine just prefilled after the prefix into a free slot
        (the prefix cache is truncated back to the prefix), with room for ``room`` more
        entries (its answer's; the slot grows past it where it must). ``source``: a cache
        of the sequence's own (the server's resident conversation, beginning with the
        prefix) whose entries after the prefix are copied instead, the cache kept whole.
        ``record``: the rows it takes from here on are recorded for the native step's
        ``write_back`` into ``source`` (its prompt's rows, its answer's).
        """
        cache = self.prefix if source is None else source
        slot = min(set(range(len(self.tails.lengths) + 1))
                   - {s.slot for s in self.sequences.values()})
        kept = [int(np.count_nonzero(p < self.prefix_tokens)) for p in cache.rank_positions]
        tail_sizes = [p.size - k for p, k in zip(cache.rank_positions, kept)]
        local = kept[cache.cp_rank]
        entries = cache.positions.size - local  # each layer's last (a window's dropped some)
        self.tails.reserve(slot + 1, entries + room)
        if entries:  # every layer's buffers computed at once (a fork copies them lazily)
            mx.eval([b for layer in cache.layers for b in (layer.keys, layer.values)
                     if b is not None])
        for index, layer in enumerate(cache.layers):
            if entries:
                self.tails.take(index, slot, layer.keys, layer.values,
                                layer.offset - entries, layer.offset)
        self.tails.positions[slot, :entries] = cache.positions[local:]
        self.tails.lengths[slot] = entries
        self.sequences[key] = Sequence(slot, cache.num_tokens, tail_sizes, cache.decode_steps,
                                       cache.decode_owner, [] if record else None)
        self.tails.settle()  # before the next prefill reuses the cache rows past the prefix
        if source is None:
            cache.truncate(self.prefix_tokens)

    def retire(self, key):
        """``key``'s slot is free; the last one out hands every slot's memory back (the
        slots are as long as the longest sequence's: a server's next batch may be
        short)."""
        self.tails.clear(self.sequences.pop(key).slot)
        if not self.sequences:
            self.tails.release()

    @property
    def tail_tokens(self) -> int:
        """Every slot's entries on this rank."""
        return sum(self.tails.lengths)

    @property
    def tail_bytes(self) -> int:
        return self.tails.nbytes

    def _place(self, sequence: Sequence) -> int:
        """The rank that stores ``sequence``'s next token (its own placement rule)."""
        sizes = [p + t for p, t in zip(self.prefix.shard_sizes, sequence.tail_sizes)]
        sequence.decode_owner = decode_owner(sizes, sequence.decode_steps,
                                             self.engine.kv_interleave, sequence.decode_owner)
        sequence.decode_steps += 1
        return sequence.decode_owner
