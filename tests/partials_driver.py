"""Ring and decode attention over half-precision K/V on real ranks, with the tiled
float32 partials, for tests/test_fused.py: whether the partials keep their precision
on the wire.

    mpiexec -n N python tests/partials_driver.py DTYPE OUT_NPZ

Every rank builds the same random queries, keys and values (rounded to DTYPE, the KV
dtype) and keeps its head-tail shard; pass-KV, pass-Q and the decode merge (both
compute paths, tiled) attend them. Rank 0 writes the inputs and every rank's outputs.
"""

import sys

import mlx.core as mx
import numpy as np
from mpi4py import MPI

from spmd_cp.attention.gather import decode_attention
from spmd_cp.attention.partition import head_tail_positions
from spmd_cp.attention.ring import pass_kv_attention, pass_q_attention
from spmd_cp.runtime.comm import Comm
from spmd_cp.runtime.device import Compute

TOKENS, HEADS, KV_HEADS, HEAD_DIM, SCALE = 96, 4, 2, 16, 0.25


def main(dtype_name: str, out_path: str):
    comm = Comm(MPI.COMM_WORLD)
    dtype = getattr(mx, dtype_name)
    rng = np.random.default_rng(7)
    # Rounded to the KV dtype once: the reference attends these very values.
    q, k, v = (np.array(mx.array(rng.normal(size=(h, TOKENS + 1, HEAD_DIM)) * 2,
                                 mx.float32).astype(dtype).astype(mx.float32))
               for h in (HEADS, KV_HEADS, KV_HEADS))
    positions = head_tail_positions(TOKENS, comm.size)
    mine = positions[comm.rank]

    def shard(x, rows):
        return mx.array(x[:, rows]).astype(dtype)

    outputs = {}
    for name, attend in (("pass-kv", pass_kv_attention(comm, positions, fused=False)),
                         ("pass-q", pass_q_attention(comm, positions, fused=False))):
        out = attend(shard(q, mine), shard(k, mine), shard(v, mine), mine, mine, SCALE)
        outputs[name] = np.array(out.astype(mx.float32))
    newest = np.array([TOKENS])  # the decode query attends every cached key
    for path in ("cpu", "gpu"):
        attend = decode_attention(comm, "allgather", Compute(path, fused=False))
        out = attend(shard(q, newest), shard(k, mine), shard(v, mine), newest, mine, SCALE)
        outputs[f"decode-{path}"] = np.array(out.astype(mx.float32))
    gathered = MPI.COMM_WORLD.gather((mine, outputs), root=0)
    if comm.rank == 0:
        arrays = {"q": q, "k": k, "v": v}
        for rank, (rows, outs) in enumerate(gathered):
            arrays[f"positions_{rank}"] = rows
            arrays.update({f"{name}_{rank}": out for name, out in outs.items()})
        np.savez(out_path, **arrays)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
