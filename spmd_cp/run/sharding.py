"""``--shard-weights on|off|auto``: whether each rank loads only its share of the layers
(models/partial_load.py, engine/weights/weights.py), and the weight bytes the forecast counts."""

from __future__ import annotations

from functools import lru_cache

from ..engine.cache.forecast import WeightPlan, default_memory_limit, parse_bytes
from ..engine.weights.weights import PREFETCH_LAYERS
from ..config import RunConfig
from ..models.partial_load import weight_layout
from ..runtime.resident import outside_mlx_bytes


def wants_sharding(run: RunConfig, path: str, ranks: int, decode: bool = True) -> bool:
    """Rank 0's decision, before the model loads. ``auto`` shards when the replicated
    weights and what the process already holds outside MLX (interpreter, libraries)
    exceed the per-rank memory limit, which counts resident memory; one rank has nothing
    to shard with. (The tokenizer, loaded with the model, adds more: a case close to
    the limit is refused later by the forecast, which names --shard-weights on.)"""
    if run.shard_weights == "off" or ranks == 1 or run.tp > 1:  # --tp cuts them already
        return False
    if run.shard_weights == "auto":
        limit = parse_bytes(run.memory_limit) if run.memory_limit else default_memory_limit()
        return auto_shards(layout_of(path, run.keep_quantized, decode).replicated, limit)
    return True


def auto_shards(replicated_bytes: int, limit: int) -> bool:
    """``--shard-weights auto``'s rule (the CLI's and doctor's): the replicated weights and
    what this process holds outside MLX now exceed the per-rank limit."""
    return replicated_bytes + outside_mlx_bytes() > limit


@lru_cache(maxsize=4)
def layout_of(path: str, keep_quantized: bool, decode: bool = True):
    """``decode``: a decode step follows (a replicated load then holds the packed forms
    decode reads, models/quantized_shadows.py)."""
    return weight_layout(path, keep_quantized, decode)


def weight_plan(loaded, replicated_bytes: int, keep_quantized: bool) -> WeightPlan:
    """What the memory forecast counts for this run's weights per rank."""
    share = getattr(loaded, "share", None)
    try:
        layout = layout_of(loaded.path, keep_quantized)
    except (OSError, ValueError, KeyError):  # the forecast then offers no sharding
        return WeightPlan(replicated_bytes)
    return WeightPlan(layout.replicated if share is not None else replicated_bytes,
                      lambda ranks: layout.per_rank(ranks, PREFETCH_LAYERS),
                      sharded=share is not None)
