"""Which prefill algorithm: Algorithm 1 of Yang et al. 2024 (arXiv 2411.01783), with costs. Pure.

pass-KV moves (T + P) tokens' K/V around the ring, pass-Q moves the T new queries (and
returns their partials). pass-KV wins outright when

    T / (T + P) >= 2 * NKV / NH            (the new tokens are a large share of the
                                            context: K/V of all is no bigger than Q of new)

Below that share, Yang et al. pick pass-KV once T >= N * C * NKV * e / (2 * NH * BW), the
point where attention compute hides the K/V transfer. Measured here that was wrong for
short follow-ups on a cached document (pass-KV 1.03-1.17x pass-Q's time): a transfer
that hides still costs the CPU its copies (stacking the shard, the wire buffers, the
kernel's or MPI's own), and every ring step costs a fixed latency. So below the share
threshold the two are compared by estimated time per layer (``estimate_layer_seconds``):

    attention   A = 4 * NH * d * (T*P + T(T+1)/2) / (N * C)        (same for both)
    pass-KV     A + added((N-1)(lat + kv/BW)) + 2(N-1) kv / copy
    pass-Q      A + added((N-1)(lat + q/BW)) + t_call + o/BW + 2((N-1) q + o) / copy

    added(x) = max(0, x - W) + drag * min(x, W),   W = A(N-1)/N (the compute it can hide under)

with kv = 2 (T+P)/N * NKV * d * e bytes per ring step, q = T/N * NH * d * e, and o =
(N-1) T/N * NH * (d+1) * e the partials returned by the Alltoallv (which nothing hides).
e is the K/V element size the attention reads; the returned partials count at it too,
which they are but for the tiled blocks on the GPU path (--attention-kernel tiled, not
the default there), whose partials travel in float32 (block.partial_dtype).
pass-KV is taken only where what it adds to the attention is estimated at least a
quarter below what pass-Q adds (``EXTRA_MARGIN``); at the Yang et al. crossover pass-KV's
addition drops to nothing where transfers cost compute no drag, so the crossover stays
where it was there.
C (attention FLOP/s), BW and lat (ring bandwidth and one ring step's latency, the hand-off
to the communication thread included), t_call (one blocking collective), copy (bytes/s
of a host copy) and drag (the share of attention compute a concurrent transfer costs:
MPI's progress loop and the TCP stack on cores the ranks also compute on) are measured
on the actual ranks (calibrate.py). With no copy
cost the comparison reduces to Yang et al.'s threshold when P is large.

Sliding-window layers (Gemma 3's local layers, ``WindowTraffic``) change pass-KV's
traffic: each sends, in one Alltoallv, just the keys its receivers' windows reach
(attention/window.py), k keys on the busiest rank instead of a ring's N - 1 shards.
Nothing hides that blocking exchange, so per local layer pass-KV adds
t_call + x/BW + 2x/copy with x = 2 k NKV d e, while pass-Q's ring hides under the
local layer's own attention (each query sees at most W keys). The per-layer figures are
averaged over the model's layers, and so are the bytes of the share test: pass-kv
outright where its average bytes per layer are no more than pass-Q's queries, (N-1) q.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


# How much less pass-KV must add (estimated) to be chosen below the share threshold,
# where it moves more bytes than pass-Q (10x in a short follow-up): over TCP on the
# computing cores those bytes cost the hosts more than the calibrated copy rate says. At
# 4 Gbit/s pass-KV's addition was estimated 12% below pass-Q's and measured 1.08-1.12x
# pass-Q's time (both algorithms took about twice their estimates).
EXTRA_MARGIN = 0.25


@dataclass(frozen=True)
class LinkAndCompute:
    attention_flops: float  # attention FLOP/s of the slowest rank
    ring_bytes_per_s: float  # Sendrecv bytes/s per direction of the slowest ring link
    ring_latency_s: float = 0.0  # one ring step of a tiny message, software included
    copy_bytes_per_s: float = float("inf")  # host copy into / out of a wire buffer
    # For --decode-tp auto (engine.py): weight bytes/s a matrix-vector product streams
    # (all ranks at once, as in decode), and one small collective as decode issues it.
    stream_bytes_per_s: float = 0.0
    collective_s: float = 0.0
    # Share of attention compute lost while a ring transfer runs (calibrate.py): a hidden
    # transfer still costs this much of its duration.
    transfer_drag: float = 0.0


@dataclass(frozen=True)
class WindowTraffic:
    """A model's sliding-window layers for one prefill call: ``local`` of its ``layers``
    attend within ``window`` tokens, and under pass-KV the busiest rank sends or receives
    ``keys`` keys in each (attention/window.py's exchange: what ``window_kv_bytes``
    counts)."""

    layers: int
    local: int
    window: int
    keys: int


def estimate_layer_seconds(new_tokens: int, cached_tokens: int, cp_size: int, num_heads: int,
                           num_kv_heads: int, elem_bytes: int, measured: LinkAndCompute,
                           head_dim: int = 64, windowed: WindowTraffic | None = None) -> dict:
    """Estimated seconds per layer of pass-kv and pass-q on the slowest rank (see above):
    ``attention``, what each algorithm adds to it (``extra``), and their sums; with
    ``windowed``, averaged over the global and the local layers."""
    args = (new_tokens, cached_tokens, cp_size, num_heads, num_kv_heads, elem_bytes,
            measured, head_dim)
    full = _layer_seconds(*args)
    if windowed is None or not windowed.local:
        return full
    local, share = _layer_seconds(*args, windowed), windowed.local / windowed.layers
    attention = (1 - share) * full["attention"] + share * local["attention"]
    extra = {algo: (1 - share) * full["extra"][algo] + share * local["extra"][algo]
             for algo in full["extra"]}
    return {"attention": attention, "extra": extra,
            **{algo: attention + added for algo, added in extra.items()}}


def _causal_pairs(new_tokens: int, cached_tokens: int, window: int | None) -> float:
    """(query, key) pairs the new tokens attend: every earlier key, or the last ``window``."""
    if window is None:
        return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2
    seen = np.minimum(np.arange(cached_tokens, cached_tokens + new_tokens) + 1, window)
    return float(seen.sum())


def _layer_seconds(new_tokens: int, cached_tokens: int, cp_size: int, num_heads: int,
                   num_kv_heads: int, elem_bytes: int, measured: LinkAndCompute,
                   head_dim: int, windowed: WindowTraffic | None = None) -> dict:
    """One layer's estimate: a global layer's, or with ``windowed`` a local layer's."""
    n, d, e = cp_size, head_dim, elem_bytes
    t, total = new_tokens, new_tokens + cached_tokens
    pairs = _causal_pairs(t, cached_tokens, windowed.window if windowed else None)
    attention = 4 * num_heads * d * pairs / (n * measured.attention_flops)
    window = attention * (n - 1) / n  # compute the N-1 transfers can hide under
    lat, bw, copy = measured.ring_latency_s, measured.ring_bytes_per_s, measured.copy_bytes_per_s
    # The Alltoallv is a blocking call on the main thread: no hand-off to the ring thread.
    call = measured.collective_s or lat
    kv = 2 * total / n * num_kv_heads * d * e
    q = t / n * num_heads * d * e
    returned = (n - 1) * t / n * num_heads * (d + 1) * e
    drag = measured.transfer_drag
    extra = {
        "pass-kv": _added((n - 1) * (lat + kv / bw), window, drag) + 2 * (n - 1) * kv / copy,
        "pass-q": (_added((n - 1) * (lat + q / bw), window, drag) + call + returned / bw
                   + 2 * ((n - 1) * q + returned) / copy),
    }
    if windowed is not None:  # one blocking Alltoallv of the keys the windows reach
        sent = 2 * windowed.keys * num_kv_heads * d * e
        extra["pass-kv"] = call + sent / bw + 2 * sent / copy
    # The sums for reading; comparisons use ``extra``, which rounding cannot swallow.
    return {"attention": attention, "extra": extra,
            **{algo: attention + added for algo, added in extra.items()}}


def _added(transfer: float, window: float, drag: float) -> float:
    """What a ring transfer adds to the attention: the part the compute window does not
    cover (none when equal up to rounding), plus ``drag`` of the part it does (the
    compute it slows while it runs)."""
    hidden = min(transfer, window)
    unhidden = 0.0 if transfer <= window * (1 + 1e-12) else transfer - window
    return unhidden + drag * hidden


def choose_prefill_algo(new_tokens: int, cached_tokens: int, cp_size: int, num_heads: int,
                        num_kv_heads: int, elem_bytes: int, measured: LinkAndCompute | None,
                        head_dim: int = 64, margin: float = EXTRA_MARGIN,
                        windowed: WindowTraffic | None = None):
    """Return (algorithm, reason) for one prefill call (``windowed``: the model's
    sliding-window layers, None or none local without)."""
    if cp_size == 1:
        return "pass-kv", "one rank: no communication either way"
    share = new_tokens / max(new_tokens + cached_tokens, 1)
    threshold = 2 * num_kv_heads / num_heads
    if share >= threshold:
        return "pass-kv", (f"new-token share T/(T+P) = {new_tokens}/{new_tokens + cached_tokens}"
                           f" = {share:.3f} >= 2*NKV/NH = {threshold:.3f}")
    below = f"T/(T+P) = {share:.3f} < 2*NKV/NH = {threshold:.3f}"
    windows = ""
    if windowed is not None and windowed.local:
        kv, q = _bytes_per_layer(new_tokens, cached_tokens, cp_size, num_heads, num_kv_heads,
                                 elem_bytes, head_dim, windowed)
        windows = (f"; {windowed.local} of {windowed.layers} layers windowed (W = "
                   f"{windowed.window}): pass-kv sends {windowed.keys} keys in each, "
                   f"{kv / 2**20:.2f} MiB a layer on average, pass-q {q / 2**20:.2f} MiB")
        if kv <= q:
            return "pass-kv", f"{below}{windows}: pass-kv sends no more"
    if measured is None:
        return "pass-q", f"{below} (no measurements){windows}"
    times = estimate_layer_seconds(new_tokens, cached_tokens, cp_size, num_heads, num_kv_heads,
                                   elem_bytes, measured, head_dim, windowed)
    extra = times["extra"]  # compared apart from the attention, which rounding would swallow
    algo = "pass-kv" if extra["pass-kv"] <= (1 - margin) * extra["pass-q"] else "pass-q"
    return algo, (f"T/(T+P) = {share:.3f} < {threshold:.3f}; estimated per layer pass-kv "
                  f"{1e3 * times['pass-kv']:.2f} ms, pass-q {1e3 * times['pass-q']:.2f} ms "
                  f"(C = {measured.attention_flops / 1e9:.1f} GFLOP/s, "
                  f"BW = {measured.ring_bytes_per_s / 1e9:.2f} GB/s, "
                  f"latency {1e6 * measured.ring_latency_s:.0f} us, "
                  f"copy {measured.copy_bytes_per_s / 1e9:.1f} GB/s, "
                  f"drag {measured.transfer_drag:.2f}){windows}")


def _bytes_per_layer(new_tokens: int, cached_tokens: int, cp_size: int, num_heads: int,
                     num_kv_heads: int, elem_bytes: int, head_dim: int,
                     windowed: WindowTraffic) -> tuple[float, float]:
    """(pass-kv, pass-q) bytes a rank sends per layer, averaged over the layers: pass-KV's
    ring of K/V shards in a global layer and its window exchange in a local one, against
    pass-Q's ring of queries (the share test's two sides)."""
    n, key = cp_size, 2 * num_kv_heads * head_dim * elem_bytes
    ring = (n - 1) * (new_tokens + cached_tokens) / n * key
    local = windowed.local / windowed.layers
    kv = (1 - local) * ring + local * windowed.keys * key
    return kv, (n - 1) * new_tokens / n * num_heads * head_dim * elem_bytes
