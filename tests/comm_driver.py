"""Two or more real ranks exercise Comm's point-to-point arrays and ring neighbours.

    mpiexec -n N python tests/comm_driver.py OUT_JSON

Each rank sends arrays of several dtypes to ring_next and receives from ring_prev with
send_array/recv_array; rank 0 writes what every rank received, as exact values
(bfloat16/float16 bit patterns as uint16) and dtype names, plus the neighbours.
"""

import json
import sys

import mlx.core as mx
import numpy as np


def payload(rank: int) -> dict:
    """Values that bfloat16 and float16 hold exactly, distinct per rank."""
    base = np.arange(6, dtype=np.float32).reshape(2, 3) * 0.5 + rank
    return {"bfloat16": mx.array(base).astype(mx.bfloat16),
            "float16": mx.array(base).astype(mx.float16),
            "float32": mx.array(base) / 3, "int32": mx.array(base).astype(mx.int32)}


def as_record(array: mx.array) -> dict:
    values = array.view(mx.uint16) if array.dtype in (mx.bfloat16, mx.float16) else array
    return {"dtype": str(array.dtype), "shape": list(array.shape),
            "values": np.array(values).tolist()}


def main():
    from mpi4py import MPI

    from spmd_cp.runtime.comm import Comm

    comm = Comm(MPI.COMM_WORLD)
    received = {}
    for name, array in payload(comm.rank).items():
        # Even ranks send first: a ring of blocking sends needs someone to receive.
        if comm.rank % 2 == 0:
            comm.send_array(array, comm.ring_next)
            got = comm.recv_array(comm.ring_prev)
        else:
            got = comm.recv_array(comm.ring_prev)
            comm.send_array(array, comm.ring_next)
        received[name] = as_record(got)
    gathered = comm.gather_object({"rank": comm.rank, "next": comm.ring_next,
                                   "prev": comm.ring_prev, "received": received})
    if comm.rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"thread_level": MPI.Query_thread(), "ranks": gathered}, f)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        from mpi4py import MPI

        traceback.print_exc()
        MPI.COMM_WORLD.Abort(1)
