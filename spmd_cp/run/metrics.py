"""Per-rank figures every command reports (``--json``), gathered to rank 0."""

from __future__ import annotations

from ..engine.engine import Engine
from ..engine.weights.sharded_model import weight_bytes
from ..models.quantized_shadows import SHADOWS
from ..runtime.afd import straggler_summary
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
    if grid.afd is not None:
        times = grid.afd.times
        mine["afd"] = {**times.as_dict(), "rows": times.rows, "row_layers": times.row_layers,
                       "bytes": int(grid.afd.comm.bytes_sent)}
    gathered = comm.gather_object(mine)
    if comm.rank != 0:
        return {}
    out = {name: [g[name] for g in gathered] for name in mine if name != "afd"}
    if grid.afd is not None:
        out["afd"] = afd_summary([g["afd"] for g in gathered], grid.afd)
    return out


def afd_summary(per_rank: list[dict], link) -> dict:
    """``--json``'s ``afd``: the roles, the micro-batches, the bytes that crossed the
    bipartite link (both ways, every rank) per token the attention ranks sent through the
    layers and per token and layer, each rank's waits and the slowest rank of each side
    (runtime/afd.py)."""
    crossed = sum(r["bytes"] for r in per_rank)
    rows = sum(r["rows"] for r in per_rank)
    row_layers = sum(r["row_layers"] for r in per_rank)
    return {**link.roles.as_dict(), "micro_batches": link.micro_batches,
            "bytes_crossed": crossed,
            "bytes_per_token": round(crossed / rows, 1) if rows else 0.0,
            "bytes_per_token_layer": round(crossed / row_layers, 1) if row_layers else 0.0,
            "wait_s": [r["wait_s"] for r in per_rank],
            "work_s": [r["work_s"] for r in per_rank],
            "straggler": straggler_summary(per_rank, link.roles)}


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
