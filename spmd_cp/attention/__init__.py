"""Context-parallel attention: pure block math (block.py) and the algorithms over MPI.

Each algorithm is a factory returning ``attend(q, keys, values, q_pos, k_pos, scale)``:
this rank's queries and this rank's cached shard in, this rank's attention output out.
"""

from __future__ import annotations

from .block import block_attention, merge_partials, merge_stacked
from .gather import allgather_kv_attention, decode_attention

PREFILL_ALGOS = ("auto", "pass-kv", "pass-q", "allgather-kv")


def prefill_attention(algo: str, comm, rank_positions, cache):
    """The attention function for one prefill call and the name of the algorithm chosen."""
    if algo in ("auto", "allgather-kv"):
        return allgather_kv_attention(comm), "allgather-kv"
    raise ValueError(f"unknown --cp-algo {algo!r} (choose from {', '.join(PREFILL_ALGOS)})")


__all__ = ["block_attention", "merge_partials", "merge_stacked", "prefill_attention",
           "decode_attention", "PREFILL_ALGOS"]
