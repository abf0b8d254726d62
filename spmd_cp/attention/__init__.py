"""Context-parallel attention: pure block math (block.py) and the algorithms over MPI.

Each algorithm is a factory returning ``attend(q, keys, values, q_pos, k_pos, scale,
window=None)``: this rank's queries and this rank's cached shard in, this rank's
attention output out; ``window`` is a sliding-window layer's (block.py).
"""

from __future__ import annotations

from .block import block_attention, merge_partials, merge_stacked
from .choose import LinkAndCompute, choose_prefill_algo, estimate_layer_seconds
from .gather import allgather_kv_attention, decode_attention
from .ring import pass_kv_attention, pass_q_attention

PREFILL_ALGOS = ("auto", "pass-kv", "pass-q", "allgather-kv")


def prefill_attention(algo: str, comm, new_positions, cache, model, measured=None):
    """The attention function for one prefill call, the algorithm used, and why.

    Args:
        new_positions: every rank's positions of this call's new tokens.
        cache: the sharded cache, already holding those positions.
        model: a CPModel (head counts for the auto choice; its attention kernel).
        measured: LinkAndCompute for ``auto`` (None: decide on head counts alone).
    """
    reason = "requested"
    fused = model.compute.fused
    if algo == "auto":
        new_tokens = sum(p.size for p in new_positions)
        head_dim = getattr(model.layers[0].self_attn, "head_dim", None) or 64
        algo, reason = choose_prefill_algo(new_tokens, cache.num_tokens - new_tokens, comm.size,
                                           model.num_heads, model.num_kv_heads,
                                           model.elem_bytes, measured, head_dim)
    if algo == "pass-kv":
        return (pass_kv_attention(comm, cache.rank_positions, fused,
                                  query_positions=new_positions), algo, reason)
    if algo == "pass-q":
        return pass_q_attention(comm, new_positions, fused), algo, reason
    if algo == "allgather-kv":
        return allgather_kv_attention(comm, cache.rank_positions, fused), algo, reason
    raise ValueError(f"unknown --cp-algo {algo!r} (choose from {', '.join(PREFILL_ALGOS)})")


__all__ = ["block_attention", "merge_partials", "merge_stacked", "prefill_attention",
           "decode_attention", "choose_prefill_algo", "estimate_layer_seconds", "LinkAndCompute",
           "PREFILL_ALGOS"]
