"""Real ranks divide an LM head by vocabulary rows (engine/decode/graph_step.py DividedHead).

    mpiexec -n N python tests/head_driver.py OUT_JSON

A 1,000-row head (not a multiple of N: the last share is shorter and padded) with a
bias, and a tied embedding's, over a normed hidden row; every rank gets all the logits
through the Allgather. Rank 0 writes every rank's logits and the inputs, for the test's
numpy reference.
"""

import json
import sys
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def main():
    from mpi4py import MPI

    from spmd_cp.engine.decode.graph_step import DividedHead
    from spmd_cp.runtime.comm import Comm

    comm = Comm(MPI.COMM_WORLD)
    mx.random.seed(7)  # the same modules on every rank
    linear, embedding = nn.Linear(16, 1000), nn.Embedding(1000, 16)
    norm = nn.RMSNorm(16)
    norm.weight = mx.random.uniform(0.5, 1.5, (16,))
    hidden = mx.random.normal((1, 16))
    out = {"hidden": np.array(hidden).tolist(), "norm": np.array(norm.weight).tolist()}
    for name, head in (("linear", linear), ("tied", embedding.as_linear)):
        model = SimpleNamespace(lm_head=head, norm=norm, tensor_group=None)
        divided = DividedHead.of(model, comm.rank, comm.size)
        logits = divided.logits(model, hidden, comm)
        out[name] = {"rows": comm.allgather_object(divided.rows),
                     "logits": comm.allgather_object(np.array(logits).tolist())}
    out["weights"] = {"linear": np.array(linear.weight).tolist(),
                      "bias": np.array(linear.bias).tolist(),
                      "tied": np.array(embedding.weight).tolist()}
    if comm.rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
