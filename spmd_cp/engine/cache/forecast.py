"""Memory forecast per rank, checked before prefill so a job that cannot fit is refused
in seconds instead of being killed by the OOM killer an hour in. Pure arithmetic.

Per rank: the weights (every rank holds all of them, or with --shard-weights its share
and a window of other ranks' layers: models/partial_load.py WeightLayout), the KV shard
(every cached token once, split N ways), and the activations of one prefill chunk: this
rank's rows of the hidden state and MLP (``mlp_arrays``), one attention tile of scores
(block.SCORE_TILE_ELEMENTS), and the K/V the algorithm holds besides the local shard (one
travelling shard for the rings, the whole layer for allgather-kv; for a sliding-window
layer's exchange, its keys and the windows it receives). Where sliding-window layers
drop the keys behind their windows (engine/cache/cache.py: generate, score) each holds its
window and the answer's tokens, but one at a time holds its whole shard (it drops right
after its attention); elsewhere (serve, batch, --save-cache) every key counts. Those are MLX's
arrays; ``process`` is what the rank process holds besides them (interpreter, libraries,
tokenizer), measured in the running process by the caller (runtime/resident.py), so the
total is resident memory. A server adds two parts: the KV its other resident conversations
hold (and the room its caches grew by: engine/cache/cache.py grows them in steps), and MLX's
buffer cache (freed buffers MLX keeps for reuse), which it bounds (server/resident.py).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Callable

from ...attention.block import SCORE_TILE_ELEMENTS
from ...errors import UserError
from ...models.shape import ModelShape

# Measured activation peaks exceed this model by up to ~35% (allocator rounding, MLX
# temporaries: SmolLM2 at 4,188 tokens on one rank peaked at 358 MiB of activations
# against 259 MiB modelled); the forecast is a refusal threshold, so it errs on the
# large side.
SAFETY = 1.4


@dataclass
class Forecast:
    weights: int
    kv: int
    activations: int
    process: int = 0  # resident bytes outside MLX's arrays
    buffer_cache: int = 0  # MLX's buffer cache, where bounded (0: not counted)

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations + self.process + self.buffer_cache

    def as_dict(self) -> dict:
        """``--json``'s ``memory_forecast``: bytes per rank, by part."""
        parts = {"weights_bytes": self.weights, "kv_bytes": self.kv,
                 "activations_bytes": self.activations, "process_bytes": self.process}
        if self.buffer_cache:
            parts["buffer_cache_bytes"] = self.buffer_cache
        return {**parts, "total_bytes": self.total}


def kv_tokens_per_rank(total_tokens: int, cp_size: int) -> int:
    """The most of ``total_tokens`` one of ``cp_size`` ranks caches."""
    return math.ceil(total_tokens / cp_size) + 1


def mlp_arrays(elem_bytes: int) -> int:
    """MLP-wide arrays alive at once per row: gate, up and their product; on the CPU path
    (float32) also the polynomial exp's two parts inside the SiLU (attention/exp.py)."""
    return 5 if elem_bytes == 4 else 3


def forecast_rank_bytes(shape: ModelShape, weights_bytes: int, total_tokens: int,
                        chunk_tokens: int, cp_size: int, algo: str = "pass-kv",
                        score: bool = False, process_bytes: int = 0, held_kv_tokens: int = 0,
                        buffer_cache_bytes: int = 0, window_tail: int | None = None) -> Forecast:
    """Peak bytes on the busiest rank for a context of ``total_tokens`` prefilled in
    chunks of ``chunk_tokens`` on ``cp_size`` ranks. ``shape.kv_bytes_per_token`` counts
    the KV dtype's size (engine.model.kv_dtype_for: ``--kv-dtype`` on the CPU path, the
    model's on a GPU); ``shape.elem_bytes`` is the activations' and the shards attention
    reads (4 on the CPU path, where a half-precision cache is read into float32; the
    model's 2 on a GPU). ``process_bytes``: the rank's resident bytes besides
    MLX's arrays, as measured. ``held_kv_tokens``: tokens' room in K/V the rank holds
    besides this context's (a server's other conversations); ``buffer_cache_bytes``:
    the bound on MLX's buffer cache, where one is set. ``window_tail``: where the
    sliding-window layers drop keys, the tokens after the prompt (None: they keep all)."""
    e = shape.elem_bytes
    kv_tokens = kv_tokens_per_rank(total_tokens, cp_size)
    kv = (kv_tokens + held_kv_tokens) * shape.kv_bytes_per_token
    if window_tail is not None and shape.local_layers > 1:
        per_layer = shape.kv_bytes_per_token // shape.layers
        kept = min(kv_tokens, shape.window + window_tail)
        kv -= (shape.local_layers - 1) * (kv_tokens - kept) * per_layer
    rows = math.ceil(chunk_tokens / cp_size) + 1
    per_row = e * (4 * shape.hidden + mlp_arrays(e) * shape.intermediate
                   + (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim * 2)
    tile = min(SCORE_TILE_ELEMENTS, shape.num_heads * rows * kv_tokens * cp_size)
    attention = 3 * tile * 4
    layer_kv = 2 * shape.num_kv_heads * shape.head_dim * e
    if algo == "allgather-kv":
        extra_kv = 2 * layer_kv * total_tokens
    else:
        extra_kv = 3 * layer_kv * kv_tokens  # local shard stacked + one shard in flight
    if algo != "allgather-kv" and shape.window:
        # a windowed layer's pass-KV (attention/window.py): its shard stacked, the keys it
        # sends, those it receives (at most a window behind each of a head-tail shard's
        # two runs) and its shard joined with them
        seen = 2 * min(shape.window, total_tokens)
        extra_kv = max(extra_kv, layer_kv * (3 * kv_tokens + 2 * seen))
    logits = (256 if score else 1) * shape.vocab * 4 * 3
    activations = int(SAFETY * (rows * per_row + attention + extra_kv + logits))
    return Forecast(weights_bytes, kv, activations, process_bytes, buffer_cache_bytes)


def default_memory_limit() -> int:
    """Physical memory of this host divided among the ranks running on it."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPICH_LOCAL_SIZE"):
        if os.environ.get(name, "").isdigit():
            return total // max(int(os.environ[name]), 1)
    return total


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9]+\.?[0-9]*|\.[0-9]+)\s*([kmgt]?i?b?)?\s*", text.lower())
    if not match:
        raise UserError(f"cannot read a memory size from {text!r} (e.g. 2GB, 512MB)")
    unit = (match.group(2) or "b").rstrip("b").rstrip("i")
    return int(float(match.group(1)) * 1024 ** " kmgt".index(unit or " "))


def describe_bytes(size: float) -> str:
    """``size`` in the largest of bytes, KB, MB, GB (powers of 1024, as parse_bytes reads
    them) that keeps it at least 1: "1,024 bytes" is "1.00 KB", 0.3 GiB "307.20 MB"."""
    if size < 1024:
        return f"{size:,.0f} bytes"
    for unit in ("KB", "MB", "GB"):
        size /= 1024
        if size < 1024 or unit == "GB":
            return f"{size:,.2f} {unit}"


@dataclass
class WeightPlan:
    """Weight bytes per rank: ``replicated`` on every rank, or with ``--shard-weights``
    (``sharded``) what the busiest of N ranks holds at peak (``sharded_at(N)``)."""

    replicated: int
    sharded_at: Callable[[int], int] | None = None
    sharded: bool = False

    def at(self, ranks: int) -> int:
        return self.sharded_at(ranks) if self.sharded else self.replicated

    def sharding_fits(self, shape: ModelShape, total_tokens: int, chunk_tokens: int,
                      cp_size: int, limit: int, algo: str, score: bool,
                      **parts) -> int | None:
        """The fewest ranks (>= cp_size, >= 2) at which sharding the weights would fit
        (``parts``: forecast_rank_bytes's ``process_bytes`` and the server's parts)."""
        if self.sharded or self.sharded_at is None:
            return None
        return next((n for n in range(max(cp_size, 2), 4097) if forecast_rank_bytes(
            shape, self.sharded_at(n), total_tokens, chunk_tokens, n, algo, score,
            **parts).total <= limit), None)


def check_fits(shape: ModelShape, weights_bytes: int | WeightPlan, total_tokens: int,
               chunk_tokens: int, cp_size: int, limit: int, algo: str, score: bool = False,
               process_bytes: int = 0, held_kv_tokens: int = 0, buffer_cache_bytes: int = 0,
               window_tail: int | None = None):
    """Refuse, naming the smallest N or chunk (or --shard-weights) that would fit, if the
    forecast exceeds ``limit`` bytes per rank (the other parts: forecast_rank_bytes)."""
    plan = weights_bytes if isinstance(weights_bytes, WeightPlan) else WeightPlan(weights_bytes)
    parts = {"process_bytes": process_bytes, "held_kv_tokens": held_kv_tokens,
             "buffer_cache_bytes": buffer_cache_bytes, "window_tail": window_tail}

    def forecast(ranks: int, chunk: int) -> Forecast:
        return forecast_rank_bytes(shape, plan.at(ranks), total_tokens, chunk, ranks, algo,
                                   score, **parts)

    need = forecast(cp_size, chunk_tokens)
    if need.total <= limit:
        return need
    fits_n = next((n for n in range(cp_size + 1, 4097)
                   if forecast(n, chunk_tokens).total <= limit), None)
    fits_chunk = None
    chunk = chunk_tokens
    while chunk > 64:
        chunk //= 2
        if forecast(cp_size, chunk).total <= limit:
            fits_chunk = chunk
            break
    options = []
    if fits_chunk:
        options.append(f"--prefill-chunk {fits_chunk}")
    if fits_n:
        options.append(f"at least {fits_n} ranks")
    shard_n = plan.sharding_fits(shape, total_tokens, chunk_tokens, cp_size, limit, algo, score,
                                 **parts)
    if shard_n:
        options.append("--shard-weights on" + (f" at {shard_n} ranks" if shard_n > cp_size
                                               else ""))
    gb = 2**30
    raise UserError(
        f"{total_tokens} tokens need about {need.total / gb:.2f} GB per rank on {cp_size} "
        f"rank(s) (weights {need.weights / gb:.2f} + KV {need.kv / gb:.2f} + activations "
        f"{need.activations / gb:.2f} + process {need.process / gb:.2f}"
        + (f" + MLX's buffer cache {need.buffer_cache / gb:.2f}" if need.buffer_cache else "")
        + f"), over the limit of {describe_bytes(limit)} per rank; "
        + ("it fits with " + " or ".join(options) if options else "no rank count fits"))
