"""The server's resident KV caches: several conversations' sharded caches kept on the
ranks between requests, least recently used first, bounded by a count and by the memory
forecast.

Every rank holds the same entries in the same order (each its own shard of each); rank
0 decides which entry a request continues and which ones go (``plan``), the decision is
broadcast with the request, and every rank applies it (``take``). Rank 0 reads the token
ids of the entries from its own copies: every rank's are the same.
"""

from __future__ import annotations

from ..engine.prompt_cache import common_prefix_length
from .openai_api import ApiError

# A request continues an entry in place when at most this many of its tokens are dropped
# (a follow-up whose repeated answer tokenizes a little differently); else the shared
# prefix is copied into a new entry and the older conversation is kept whole.
IN_PLACE_SLACK = 8


class ResidentCaches:
    """The entries, least recently used first."""

    def __init__(self, engine, max_entries: int):
        self.engine = engine
        self.max_entries = max(1, max_entries)
        self.entries = []

    @property
    def num_tokens(self) -> int:
        return sum(cache.num_tokens for cache in self.entries)

    @property
    def nbytes(self) -> int:
        """This rank's bytes of K/V in every entry."""
        return sum(cache.nbytes for cache in self.entries)

    def add(self, cache):
        """Every rank: a cache loaded at start (a --save-cache directory) as an entry."""
        self.entries.append(cache)
        del self.entries[:-self.max_entries]

    def best_match(self, ids) -> tuple[int | None, int]:
        """(index of the entry sharing the longest prefix with ``ids``, its length)."""
        best, reused = None, 0
        for index, cache in enumerate(self.entries):
            length = common_prefix_length(cache.token_ids, ids)
            if length > reused:
                best, reused = index, length
        return best, reused

    def plan(self, ids, fits) -> dict:
        """Rank 0: how ``ids`` use the entries. ``entry``: the one sharing the longest
        prefix (None: none shares any); ``fork``: copy that prefix into a new entry
        rather than cut the entry down (it would lose more than IN_PLACE_SLACK tokens: an
        earlier conversation that only begins like this one); ``reused``: the tokens
        kept; ``evict``: entries dropped, least recently used first, to stay within
        ``max_entries`` and memory. ``fits(resident_tokens, reused)`` raises ApiError
        while the request plus the other entries' tokens do not fit; its error stands
        when no entry is left to evict."""
        index, reused = self.best_match(ids)
        fork = index is not None and \
            self.entries[index].num_tokens - reused > IN_PLACE_SLACK and self.max_entries > 1
        in_place = index is not None and not fork
        others = [i for i in range(len(self.entries)) if not (in_place and i == index)]
        room = self.max_entries - (0 if in_place else 1)
        evict = others[:max(0, len(others) - room)]
        while True:
            kept = [i for i in others if i not in evict]
            try:
                fits(sum(self.entries[i].num_tokens for i in kept), reused)
                break
            except ApiError:
                if not kept:
                    raise
                evict.append(kept[0])
        return {"entry": index, "fork": fork, "reused": reused, "evict": evict}

    def take(self, plan: dict):
        """Every rank: apply rank 0's plan; the cache to prefill into, holding the kept
        prefix, now the most recently used entry."""
        index = plan["entry"]
        source = self.entries[index] if index is not None else None
        if source is None:
            cache = self.engine.new_cache()
        elif plan["fork"]:
            cache = fork(self.engine, source, plan["reused"])
        else:
            cache = source
        self.entries = [c for i, c in enumerate(self.entries)
                        if i not in plan["evict"] and c is not cache]
        cache.truncate(plan["reused"])
        self.entries.append(cache)
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
