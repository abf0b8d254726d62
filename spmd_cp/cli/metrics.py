"""Per-rank figures every command reports (``--json``), gathered to rank 0."""

from __future__ import annotations

from ..engine.engine import Engine
from ..engine.sharded_model import weight_bytes
from ..models.quantized_shadows import SHADOWS
from ..runtime.comm import Comm
from ..runtime.grid import Grid
from ..runtime.resident import mlx_peak_bytes, resident_peak_bytes


def rank_metrics(comm: Comm, cache, model_bytes: int, grid: Grid | None = None) -> dict:
    """Per-rank lists (world rank order) of memory, KV and communication figures, on rank
    0. ``grid``: the CP x TP grid whose communicators' bytes count too (None: ``comm``
    alone)."""
    grid = grid or Grid(comm, comm, None)
    mine = {"peak_mem_bytes": mlx_peak_bytes(),
            "resident_peak_bytes": resident_peak_bytes(), "kv_cache_bytes": int(cache.nbytes),
            "comm_bytes": int(grid.bytes_sent), "model_bytes": int(model_bytes),
            # of comm_bytes, pass-KV's for sliding-window layers, and a full ring's for them
            "window_kv_bytes": int(grid.cp.window_kv_bytes),
            "window_kv_ring_bytes": int(grid.cp.window_kv_ring_bytes),
            "kv_tokens": int(cache.shard_sizes[grid.cp.rank])}
    gathered = comm.gather_object(mine)
    if comm.rank != 0:
        return {}
    return {name: [g[name] for g in gathered] for name in mine}


def model_bytes(engine: Engine, loaded) -> int:
    """The weights this rank held at its peak (``--json`` model_bytes), the split decode
    step's weight slices included."""
    slices = engine.tp_decoder.nbytes if engine.tp_decoder is not None else 0
    return weight_bytes(engine.model, loaded) + slices


def model_nbytes(model) -> int:
    """Bytes of weights a rank holds for ``model``: its parameters, less the float32
    matrices released for their packed forms, plus the packed forms decode reads
    (models/quantized_shadows.py)."""
    from mlx.utils import tree_flatten

    return SHADOWS.held_bytes(v for _, v in tree_flatten(model.parameters())) + SHADOWS.nbytes
