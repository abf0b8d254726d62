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
"""

from __future__ import annotations

from dataclasses import dataclass


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


def estimate_layer_seconds(new_tokens: int, cached_tokens: int, cp_size: int, num_heads: int,
                           num_kv_heads: int, elem_bytes: int, measured: LinkAndCompute,
                           head_dim: int = 64) -> dict:
    """Estimated seconds per layer of pass-kv and pass-q on the slowest rank (see above):
    ``attention``, what each algorithm adds to it (``extra``), and their sums."""
    n, d, e = cp_size, head_dim, elem_bytes
    t, total = new_tokens, new_tokens + cached_tokens
    pairs = t * cached_tokens + t * (t + 1) / 2  # causal (query, key) pairs
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
                        head_dim: int = 64, margin: float = EXTRA_MARGIN):
    """Return (algorithm, reason) for one prefill call."""
    if cp_size == 1:
        return "pass-kv", "one rank: no communication either way"
    share = new_tokens / max(new_tokens + cached_tokens, 1)
    threshold = 2 * num_kv_heads / num_heads
    if share >= threshold:
        return "pass-kv", (f"new-token share T/(T+P) = {new_tokens}/{new_tokens + cached_tokens}"
                           f" = {share:.3f} >= 2*NKV/NH = {threshold:.3f}")
    if measured is None:
        return "pass-q", f"T/(T+P) = {share:.3f} < 2*NKV/NH = {threshold:.3f} (no measurements)"
    times = estimate_layer_seconds(new_tokens, cached_tokens, cp_size, num_heads, num_kv_heads,
                                   elem_bytes, measured, head_dim)
    extra = times["extra"]  # compared apart from the attention, which rounding would swallow
    algo = "pass-kv" if extra["pass-kv"] <= (1 - margin) * extra["pass-q"] else "pass-q"
    return algo, (f"T/(T+P) = {share:.3f} < {threshold:.3f}; estimated per layer pass-kv "
                  f"{1e3 * times['pass-kv']:.2f} ms, pass-q {1e3 * times['pass-q']:.2f} ms "
                  f"(C = {measured.attention_flops / 1e9:.1f} GFLOP/s, "
                  f"BW = {measured.ring_bytes_per_s / 1e9:.2f} GB/s, "
                  f"latency {1e6 * measured.ring_latency_s:.0f} us, "
                  f"copy {measured.copy_bytes_per_s / 1e9:.1f} GB/s, "
                  f"drag {measured.transfer_drag:.2f})")
