"""Which prefill algorithm: Algorithm 1 of Yang et al. 2024 (arXiv 2411.01783). Pure.

pass-KV moves (T + P) tokens' K/V around the ring, pass-Q moves the T new queries (and
returns their partials). pass-KV wins when

    T / (T + P) >= 2 * NKV / NH            (the new tokens are a large share of the
                                            context: K/V of all is no bigger than Q of new)
 or T >= N * C * NKV * e / (2 * NH * BW)   (enough new tokens that the attention compute
                                            hides the K/V transfer entirely)

and pass-Q wins otherwise: a short follow-up on a long cached document. C is the
attention FLOP rate and BW the ring bandwidth, both measured on the actual ranks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkAndCompute:
    attention_flops: float  # attention FLOP/s of the slowest rank
    ring_bytes_per_s: float  # Sendrecv bytes/s per direction of the slowest ring link
    ring_latency_s: float = 0.0


def choose_prefill_algo(new_tokens: int, cached_tokens: int, cp_size: int, num_heads: int,
                        num_kv_heads: int, elem_bytes: int, measured: LinkAndCompute | None):
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
    hide_at = (cp_size * measured.attention_flops * num_kv_heads * elem_bytes
               / (2 * num_heads * measured.ring_bytes_per_s))
    if new_tokens >= hide_at:
        return "pass-kv", (f"T = {new_tokens} >= N*C*NKV*e/(2*NH*BW) = {hide_at:.0f}: the K/V "
                           "transfer hides under attention compute")
    return "pass-q", (f"T/(T+P) = {share:.3f} < {threshold:.3f} and T = {new_tokens} < "
                      f"{hide_at:.0f} (C = {measured.attention_flops / 1e9:.1f} GFLOP/s, "
                      f"BW = {measured.ring_bytes_per_s / 1e9:.2f} GB/s)")
