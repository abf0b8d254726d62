"""Real ranks run runtime.graph_comm's collectives inside MLX's graph.

    mpiexec -n N python tests/graph_comm_driver.py OUT_JSON [auto|mlx|mpi] [BACKEND] [DEVICE]

Every rank contributes arrays of its own rank-dependent values and uneven lengths, runs
each collective lazily and evaluates the results at once; rank 0 writes what every rank
got (as lists) and why the collectives were or were not opened, for the test to compare
against numpy.
"""

import json
import sys

import mlx.core as mx
import numpy as np


RESIDUAL = np.array([[0.5, -3.0, 7.25, 1e6, -2.0]], np.float32)  # a (1, 5) row


def contribution(rank: int) -> dict:
    """Rank r's inputs: ``r + 1`` rows for the uneven gathers, the same shape elsewhere."""
    rows = np.arange((rank + 1) * 4, dtype=np.float32).reshape(1, rank + 1, 4) + 100 * rank
    # "wide": 1 MiB a rank, above GATHER_SUM_MAX_BYTES gathered, so its sum takes the
    # ring's all_sum where "block"'s takes all_gather + sum (exact: halves times 0..6).
    wide = np.full((1, 1 << 18), rank + 0.5, np.float32) * (np.arange(1 << 18) % 7)
    return {"rows": rows, "vector": np.arange(rank + 2, dtype=np.float32) - rank,
            "block": np.full((2, 3), rank + 0.5, np.float32) * np.arange(3, dtype=np.float32),
            "wide": wide.astype(np.float32),
            "row": np.arange(5, dtype=np.float32)[None] * (rank + 1)}  # (1, 5): gathered as is


def main():
    from mpi4py import MPI

    from spmd_cp.runtime.comm import Comm
    from spmd_cp.runtime.device import Compute
    from spmd_cp.runtime.graph_comm import open_graph_collectives

    comm = Comm(MPI.COMM_WORLD)
    mode = sys.argv[2] if len(sys.argv) > 2 else "auto"
    backend = sys.argv[3] if len(sys.argv) > 3 else "auto"
    device = sys.argv[4] if len(sys.argv) > 4 else "auto"  # as --device
    graph, reason = open_graph_collectives(comm, mode, backend, Compute.resolve(device))
    record = {"opened": graph is not None, "reason": reason}
    if graph is not None:
        mine = {name: mx.array(value) for name, value in contribution(comm.rank).items()}
        counts = list(range(1, comm.size + 1))
        results = {
            "allgather_rows": graph.allgather_rows(mx.moveaxis(mine["rows"], 1, 2), -1, counts),
            "gather_rows": graph.gather_rows(mine["vector"], [c + 1 for c in counts]),
            "allgather_stack": graph.allgather_stack(mine["block"]),
            "sum": graph.allreduce(mine["block"], "sum"),
            "wide_sum": graph.allreduce(mine["wide"], "sum"),
            "row_sum": graph.allreduce(mine["row"], "sum"),
            # a residual plus a row-parallel projection's pieces, as a split decode step
            # adds them (one matmul onto the residual), and through Comm's host path
            "row_onto": graph.allreduce_onto(mx.array(RESIDUAL), mine["row"]),
            "row_onto_host": comm.allreduce_onto(mx.array(RESIDUAL), mine["row"]),
            "max": graph.allreduce(mine["block"] - comm.rank, "max"),
        }
        mx.eval(list(results.values()))
        # Point to point (MLX looks these up too; the project does not use them): each
        # rank sends its row to the next and receives the previous rank's. Small
        # messages: every rank's send completes before its receive is posted.
        right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        mx.eval(mx.distributed.send(mine["row"], right, group=graph.group))
        results["received"] = mx.distributed.recv_like(mine["row"], left, group=graph.group)
        mx.eval(results["received"])
        record["results"] = {name: np.array(value).tolist() for name, value in results.items()}
        record["bytes_sent"] = comm.bytes_sent
    records = comm.gather_object(record)
    if comm.rank == 0:
        with open(sys.argv[1], "w") as out:
            json.dump(records, out)


if __name__ == "__main__":
    main()
