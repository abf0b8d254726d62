"""Context-parallel attention: pure block math (block.py) and the algorithms over MPI.

Each algorithm is a factory returning ``attend(q, keys, values, q_pos, k_pos, scale,
window=None)``: this rank's queries and this rank's cached shard in, this rank's
attention output out; ``window`` is a sliding-window layer's (block.py).
"""

from __future__ import annotations

from .block import block_attention, merge_partials, merge_stacked
from .choose import LinkAndCompute, WindowTraffic, choose_prefill_algo, estimate_layer_seconds
from .gather import allgather_kv_attention, decode_attention
from .ring import pass_kv_attention, pass_q_attention
from .window import busiest_exchange

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
    # Every rank's positions the sliding-window layers hold as the call begins (their
    # keys behind every window may be gone: cache.py), alike for every layer of a window.
    held = {w: cache.rank_positions_within(w) for w in set(model_windows(model))}
    if algo == "auto":
        new_tokens = sum(p.size for p in new_positions)
        head_dim = getattr(model.layers[0].self_attn, "head_dim", None) or 64
        algo, reason = choose_prefill_algo(
            new_tokens, cache.num_tokens - new_tokens, comm.size, model.num_heads,
            model.num_kv_heads, model.elem_bytes, measured, head_dim,
            windowed=window_traffic(model, held, new_positions))
    if algo == "pass-kv":
        return (pass_kv_attention(comm, cache.rank_positions, fused,
                                  query_positions=new_positions, window_held=held),
                algo, reason)
    if algo == "pass-q":
        return pass_q_attention(comm, new_positions, fused), algo, reason
    if algo == "allgather-kv":
        return allgather_kv_attention(comm, cache.rank_positions, fused, held), algo, reason
    raise ValueError(f"unknown --cp-algo {algo!r} (choose from {', '.join(PREFILL_ALGOS)})")


def model_windows(model) -> list[int]:
    """The window of each of the model's sliding-window layers."""
    return [form.window for form in getattr(model, "forms", ()) if form.window is not None]


def window_traffic(model, held, query_positions: list) -> WindowTraffic | None:
    """The model's sliding-window layers and what pass-KV's exchange sends in each for
    these positions (window.py), or None for a model without them. Positions alone
    decide it, so every rank computes the same. ``held``: every rank's cached positions,
    or per window those its layers hold."""
    windows = model_windows(model)
    if len(query_positions) == 1 or not windows:
        return None
    of = held.get if isinstance(held, dict) else lambda _: held
    keys = {w: busiest_exchange(of(w), query_positions, w) for w in set(windows)}
    return WindowTraffic(layers=len(model.forms), local=len(windows), window=max(windows),
                         keys=round(sum(keys[w] for w in windows) / len(windows)))


__all__ = ["model_windows", "block_attention", "merge_partials", "merge_stacked",
           "prefill_attention", "decode_attention", "choose_prefill_algo",
           "estimate_layer_seconds", "LinkAndCompute", "WindowTraffic", "window_traffic",
           "PREFILL_ALGOS"]
