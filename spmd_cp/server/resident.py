"""The server's resident KV caches: several conversations' sharded caches kept on the
ranks between requests, least recently used first, bounded by a count and by the memory
forecast.

Every rank holds the same entries in the same order (each its own shard of each); rank
0 decides which entry a request continues and which ones go (``plan``), the decision is
broadcast with the request, and every rank applies it (``take``). Rank 0 reads the token
ids of the entries from its own copies: every rank's are the same.

The memory forecast counts what the entries' buffers take, not the tokens they hold: a
cache grows by whole steps (engine/cache/cache.py, 256 tokens a layer) and keeps its room when
cut back, so four short conversations held 1,024 tokens' room a rank where they held
about 470 tokens (SmolLM2, N = 2). Each rank's room differs (its shards differ); rank 0
keeps the most any rank reported for each entry after the last request (``rooms``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.cache.cache import LayerKV
from ..engine.cache.prompt_cache import common_prefix_length
from .openai_api import ApiError

# A request continues an entry in place when at most this many of its tokens are dropped
# (a follow-up whose repeated answer tokenizes a little differently); else the shared
# prefix is copied into a new entry and the older conversation is kept whole.
IN_PLACE_SLACK = 8

# What MLX may keep of freed buffers for reuse, per rank on the CPU path
# (mx.set_cache_limit), counted in the memory forecast. Set, not left to MLX: its
# documented default is its memory limit (the CPU build of mlx 0.32.4 here starts at 32
# MiB). Measured with serve_soak.py, SmolLM2, N = 2, 90 requests in rounds of 6 under
# three settings in turn (2-core AMD EPYC, shared): unbounded, the cache held 71 MB a
# rank after the first request (the decode plan's measurements) and that request's
# resident peak was 30 MB over the forecast; bounded at 32 MiB it held 0-27 MB; cleared
# before and after every request, the resident set after each request was the same as
# bounded's (882 / 910 MB from request 30 on, ranks 0 / 1: glibc keeps the small freed
# buffers, the count moved from MLX's cache to the process's) and request times were not
# told apart (per-turn medians 0.78 to 1.5 times bounded's). So: bounded, not cleared.
BUFFER_CACHE_BYTES = 32 << 20


@dataclass(frozen=True)
class Plan:
    """How a request uses the resident entries (rank 0's ``ResidentCaches.plan``, applied
    on every rank by ``take``): ``entry`` the one it continues (None: none shares a
    token), ``fork`` a copy of its shared prefix rather than the entry cut down,
    ``reused`` the tokens kept, ``evict`` the entries dropped."""

    entry: int | None
    fork: bool
    reused: int
    evict: tuple[int, ...] = ()


def held_room(kept: int, continued: int, own_tokens: int) -> int:
    """Tokens of K/V room a rank holds besides a request's ``own_tokens``: the ``kept``
    entries' room, and what the request's entry has or gets beyond its tokens (its
    ``continued`` room where it continues one, else a growth step's at most)."""
    return kept + max(continued - own_tokens, LayerKV.step - 1)


class ResidentCaches:
    """The entries, least recently used first."""

    def __init__(self, engine, max_entries: int):
        self.engine = engine
        self.max_entries = max(1, max_entries)
        self.entries = []
        self.rooms = []  # rank 0: each entry's K/V room in tokens on the roomiest rank
        # Entries of requests still joining (serve --max-batch: being prefilled in
        # slices between steps, or queued for the next step's rows) or running ones
        # whose answers go back to them: no other request continues or evicts them;
        # one may copy the tokens they hold so far (a fork).
        self.held: set[int] = set()  # their id()s

    @property
    def num_tokens(self) -> int:
        return sum(cache.num_tokens for cache in self.entries)

    @property
    def nbytes(self) -> int:
        """This rank's bytes of K/V in every entry."""
        return sum(cache.nbytes for cache in self.entries)

    def own_rooms(self) -> list[int]:
        """This rank's K/V room of each entry, in tokens."""
        return [cache.capacity for cache in self.entries]

    def note_rooms(self, every_rank: list[list[int]]):
        """Rank 0: every rank's ``own_rooms``, gathered after a request."""
        self.rooms = [max(rooms) for rooms in zip(*every_rank)]

    def add(self, cache):
        """Every rank: a cache loaded at start (a --save-cache directory) as an entry."""
        self.entries.append(cache)
        self.rooms.append(cache.capacity)
        del self.entries[:-self.max_entries], self.rooms[:-self.max_entries]

    def best_match(self, ids) -> tuple[int | None, int]:
        """(index of the entry sharing the longest prefix with ``ids``, its length)."""
        best, reused = None, 0
        for index, cache in enumerate(self.entries):
            length = common_prefix_length(cache.token_ids, ids)
            if length > reused:
                best, reused = index, length
        return best, reused

    def plan(self, ids, fits) -> Plan:
        """Rank 0: how ``ids`` use the entries. ``entry``: the one sharing the longest
        prefix (None: none shares any); ``fork``: copy that prefix into a new entry
        rather than cut the entry down (it would lose more than IN_PLACE_SLACK tokens: an
        earlier conversation that only begins like this one; or it is ``held``, with
        ``max_entries`` 1 not used at all); ``reused``: the tokens
        kept; ``evict``: entries dropped, least recently used first, to stay within
        ``max_entries`` and memory. ``fits(kept, continued, reused)`` raises ApiError
        while the request does not fit beside the entries kept (``kept``: their room in
        tokens; ``continued``: the room of the entry continued in place, else 0); its
        error stands when no entry is left to evict."""
        index, reused = self.best_match(ids)
        if index is not None and id(self.entries[index]) in self.held and self.max_entries == 1:
            index, reused = None, 0  # a held entry is only ever copied from
        fork = index is not None and (id(self.entries[index]) in self.held or (
            self.entries[index].num_tokens - reused > IN_PLACE_SLACK and self.max_entries > 1))
        in_place = index is not None and not fork
        held = [i for i, cache in enumerate(self.entries) if id(cache) in self.held]
        others = [i for i in range(len(self.entries))
                  if not (in_place and i == index) and i not in held]
        room = self.max_entries - (0 if in_place else 1) - len(held)
        evict = others[:max(0, len(others) - room)]
        while True:
            kept = [i for i in others if i not in evict]
            try:
                fits(sum(self.rooms[i] for i in kept + held),
                     self.rooms[index] if in_place else 0, reused)
                break
            except ApiError:
                if not kept:
                    raise
                evict.append(kept[0])
        return Plan(index, fork, reused, tuple(evict))

    def take(self, plan: Plan):
        """Every rank: apply rank 0's plan; the cache to prefill into, holding the kept
        prefix, now the most recently used entry."""
        index = plan.entry
        source = self.entries[index] if index is not None else None
        if source is None:
            cache = self.engine.new_cache()
        elif plan.fork:
            cache = fork(self.engine, source, plan.reused)
        else:
            cache = source
        rooms = {id(c): room for c, room in zip(self.entries, self.rooms)}
        self.entries = [c for i, c in enumerate(self.entries)
                        if i not in plan.evict and c is not cache]
        cache.truncate(plan.reused)
        self.entries.append(cache)
        self.rooms = [rooms.get(id(c), c.capacity) for c in self.entries]
        return cache


def fork(engine, cache, num_tokens: int):
    """A new cache holding a copy of ``cache``'s first ``num_tokens`` tokens (this rank's
    shard of them: on each rank they are a prefix of its entries)."""
    new = engine.new_cache()
    rank_positions = [p[p < num_tokens] for p in cache.rank_positions]
    new.add_positions(rank_positions, cache.token_ids[:num_tokens])
    count = rank_positions[cache.cp_rank].size
    for source, target in zip(cache.layers, new.layers):
        keys, values = source.fetch()
        if keys is not None and count:
            target.update_and_fetch(keys[:, :count], values[:, :count])
    new.decode_steps, new.decode_owner = cache.decode_steps, cache.decode_owner
    return new
