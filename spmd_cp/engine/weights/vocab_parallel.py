"""Vocabulary-parallel embedding and LM head for layer-sharded weights.

Each rank holds rows [a, b) of the embedding (and of an untied head). Both are exact:
an embedding row is copied from the rank that holds it, and each logit is the same dot
product as in the full matmul, computed on the rank that holds its row of the head.

    embedding: allgather every rank's token ids -> each rank looks up the ids in its
               slice -> Alltoallv returns them to the ranks that asked
    head:      allgather the (normed) hidden rows -> each rank computes its slice of
               the vocabulary for every row -> Alltoallv returns every row's slices to
               the rank that owns the row, which concatenates them

Both are collective: every rank calls them, with its own rows (possibly none).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ...runtime.comm import Comm


class VocabParallelEmbedding:
    """``embed(ids) -> ids.shape + (D,)`` from a vocabulary-sliced embedding module."""

    def __init__(self, module, rows: tuple[int, int], comm: Comm):
        self.module, self.comm = module, comm
        self.bounds = np.array([r[0] for r in comm.allgather_object(rows)] + [2**62])
        self.first = rows[0]

    def _owners(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.bounds, ids, side="right") - 1

    def __call__(self, ids: mx.array) -> mx.array:
        mine = np.asarray(ids, np.int64).reshape(-1)
        every = self.comm.allgather_object(mine)
        me = self.comm.rank
        pieces = [self._look_up(wanted[self._owners(wanted) == me] - self.first)
                  for wanted in every]
        owners = self._owners(mine)
        width = pieces[0].shape[-1]
        shapes = [(int(np.sum(owners == r)), width) for r in range(self.comm.size)]
        received = self.comm.alltoallv_arrays(pieces, shapes)
        # Rows arrived grouped by the rank that holds them; put them back in order.
        order = np.argsort(owners, kind="stable")
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size)
        rows = mx.concatenate(received, axis=0)[mx.array(inverse)]
        return rows.reshape(*ids.shape, width)  # as nn.Embedding: the ids' shape + (D,)

    def _look_up(self, local_ids: np.ndarray) -> mx.array:
        """Rows of this rank's slice; none asked: an empty (0, D) of the rows' dtype
        (MLX's quantized embedding cannot reshape an empty lookup)."""
        if local_ids.size:
            return self.module(mx.array(local_ids, mx.int32))
        probe = self.module(mx.array([0], mx.int32))  # lazy: only its shape and dtype
        return mx.zeros((0, probe.shape[-1]), probe.dtype)


class VocabParallelHead:
    """``head(x (n, D)) -> (n, V)`` from ``project``, this rank's slice of the head."""

    collective = True  # every rank calls it, with or without rows (CPModel.logits)

    def __init__(self, project, rows: tuple[int, int], comm: Comm):
        self.project, self.comm = project, comm
        self.widths = [b - a for a, b in comm.allgather_object(rows)]

    def __call__(self, x: mx.array) -> mx.array:
        counts = self.comm.allgather_object(int(x.shape[0]))
        every = self.comm.allgather_rows(x, axis=0, counts=counts)
        local = self.project(every)  # (sum of counts, V_r)
        starts = np.concatenate([[0], np.cumsum(counts)])
        pieces = [local[int(a):int(b)] for a, b in zip(starts[:-1], starts[1:])]
        shapes = [(int(x.shape[0]), w) for w in self.widths]
        return mx.concatenate(self.comm.alltoallv_arrays(pieces, shapes), axis=1)
