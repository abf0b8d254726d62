"""Which collectives a decode step runs through: mpi4py's (a Comm), or MLX's graph
collectives (runtime/graph_comm.py) over MLX's MPI or ring backend. Part of the decode
plan (decode_plan.py): chosen once, collectively, before the first decode step."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UserError
from ...runtime.graph_comm import chained_latency, open_graph_collectives


@dataclass(frozen=True)
class Transport:
    """The collectives chosen, their name in the plan ("mpi", "mlx", "none" on one rank),
    why, and mpi4py's chained collective time where choosing measured it."""

    collectives: object
    name: str
    reason: str
    mpi_collective_s: float | None = None


def choose_transport(comm, config, native: bool, sharded: bool,
                     calibrated_collective_s, compute=None, grid=None,
                     tensor_group=None) -> Transport:
    """Collective. ``native``: the native step will run (its collectives are persistent
    MPI requests, never graph nodes). ``sharded``: replicated steps over layer-sharded
    weights, whose collectives stay MPI's under ``auto``: a step built as one MLX graph
    would keep every layer received (and dequantized) for it until the step is evaluated,
    the whole model at once, where MPI's evaluate layer by layer (SmolLM2 Q4_1, N = 2:
    resident peak 354 vs 295 MiB, MLX peak 148 vs 120; decode 3.80 vs 3.79 tok/s).
    ``calibrated_collective_s()``: a bare MPI collective's cost, where one is at hand.
    ``compute``: the model's (runtime/device.Compute; the GPU path keeps MPI). ``grid``
    and ``tensor_group``: ``--tp``'s (runtime/grid.Grid, tensor_groups.TensorGroup), whose
    layers' sums take the TP group's graph collectives where the CP group's open."""
    if tensor_group is not None:  # (a grid of one CP group still sums in its TP group)
        return _grid_transport(comm, config, grid, tensor_group, compute)
    if comm.size == 1:
        return Transport(comm, "none", "one rank")
    mode = config.decode_comm
    if mode == "auto" and native:
        return Transport(comm, "mpi", "the native decode step's, MPI requests")
    if mode == "auto" and sharded:
        return Transport(comm, "mpi", "replicated steps over layer-sharded weights: each "
                         "collective evaluates the layers before it, so the layers "
                         "received for a step are freed one by one")
    graph, reason = open_graph_collectives(comm, mode, config.graph_backend, compute)
    mpi_s = None
    if graph is not None and mode == "auto":
        graph, reason, mpi_s = _faster_of(comm, graph, reason, calibrated_collective_s)
    if graph is None and mode == "mlx":
        raise UserError(f"--decode-comm mlx: {reason}")
    if graph is None:
        return Transport(comm, "mpi", reason, mpi_s)
    return Transport(graph, "mlx", reason)


def _grid_transport(comm, config, grid, tensor_group, compute) -> Transport:
    """Collective over the world: a grid's decode collectives. MLX's graph collectives
    open once a process, over the world's ranks, and split into the CP and TP groups
    (MLX's MPI backend splits as MPI_Comm_split does); the TP group's sums then join the
    step's one graph (``tensor_group.graph``). Else mpi4py's for both."""
    world, reason = open_graph_collectives(grid.world, config.decode_comm,
                                           config.graph_backend, compute)
    if world is None or world.backend != "mpi":
        why = reason if world is None else "MLX's ring backend cannot split into groups"
        if config.decode_comm == "mlx":
            raise UserError(f"--decode-comm mlx: {why}")
        return Transport(comm, "mpi", f"{why}; the TP group's sums are mpi4py's too")
    group, index = divmod(grid.world.rank, grid.tp_size)
    cp_graph = world.split(grid.cp, index, group)
    tensor_group.graph = world.split(grid.tp, group, index)
    return Transport(cp_graph, "mlx", f"{reason}, split into the grid's CP and TP groups")


def _faster_of(comm, graph, reason: str, calibrated_collective_s):
    """``--decode-comm auto``: the graph collectives, unless one costs more than
    mpi4py's does with its host round trip. Through MLX's MPI backend a collective is
    the MPI call mpi4py would make, without the round trip: kept untimed. Over the
    ring on oversubscribed cores one took 7.7-9.2 ms (N = 4 on 2 cores, whose mpi4py
    collectives decoded 3-4x faster), so there the ring's is timed and, where it
    exceeds a bare MPI call (the calibration's, where one is loaded), mpi4py's too (tens
    of ms; the probes' bytes are counted like any others), and the faster kept. Every
    rank decides on the same timings. (graph or None, reason, mpi4py's time or None)."""
    if graph.backend == "mpi":
        return graph, reason, None
    graph_s = graph.latency()
    calibrated = calibrated_collective_s()
    if calibrated is not None and graph_s <= calibrated:
        return graph, reason, None
    mpi_s = chained_latency(comm, comm)
    if graph_s <= mpi_s:
        return graph, reason, mpi_s
    return None, (f"{1e6 * mpi_s:.0f} us per collective through mpi4py against "
                  f"{1e6 * graph_s:.0f} us in MLX's graph ({reason})"), mpi_s
