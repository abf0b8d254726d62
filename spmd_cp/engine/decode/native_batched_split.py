"""The native batched step in the split layout: every rank runs all B rows through its
slices of the weights, the split step's (tp_decode.py: native_decode.NativeDecoder with
``split``), where native_batched.py's replicated layout deals the rows to the ranks and
each rank reads every weight for its rows. A layer:

    qkv:    residual, RMSNorm, this rank's q/k/v columns of every row  -> Allgatherv
    attend: every row over this rank's share of the prefix and its tail (as replicated)
                                                        -> Allgather of the partials
    output: every row's partials merged, this rank's columns of W_o  -> Allgatherv
    mlp:    residual, RMSNorm, gate/up columns, activation, down's partial sums
                                                        -> Allreduce-sum
    head:   final RMSNorm of every row, this rank's rows of the vocabulary  -> Gatherv

Each packed weight is read by one rank a step, for all B rows, where the replicated
layout reads it on every rank for B / N rows: with few rows a rank that is N times fewer
bytes for products of the same rows, with many the replicated layout's fewer collectives
and merges win (native_batched.SPLIT_BELOW_ROWS decides). The sums are the split step's
(its columns gathered, down's partial sums added by the Allreduce, Gemma 3's MLP output
normed after it), so each row follows one sequence's split step to float32 rounding
(tests/test_batch.py).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from ...runtime.comm import offsets
from ..weights.weight_slices import split_ranges


class SplitLayout:
    """A batched step's layers, collectives and head in the split layout, over the
    split step's layers (``native``) and the batch's tails and attention (``batch``: the
    NativeBatchedDecoder)."""

    def __init__(self, batch, native):
        self.batch, self.native = batch, native
        comm, first = batch.comm, native.layers[0]
        self.qkv_widths = list(native.split.layers[0].qkv_sizes)
        self.my_qkv = sum(first.qkv[p].rows for p in range(first.qkv_pieces))
        self.o_widths = [b - a for a, b in split_ranges(native.dim, comm.size)]
        self.my_o = self.o_widths[comm.rank]
        self.hidden = max(layer.gate.rows for layer in native.layers)
        self._by_rows: dict[int, dict] = {}

    def buffers(self, rows: int, logits_rows=None) -> dict:
        """The step's vectors for ``rows`` rows: made once for each batch size, but a
        step with a prompt's rows (``logits_rows`` given) gets its own (the replicated
        layout's rule, native_batched's ``_buffers``)."""
        if logits_rows is not None:
            return self._new_buffers(rows, len(logits_rows))
        if rows not in self._by_rows:
            self._by_rows[rows] = self._new_buffers(rows, rows)
        return self._by_rows[rows]

    def _new_buffers(self, rows: int, logit_rows: int) -> dict:
        native, batch, size = self.native, self.batch, self.batch.comm.size
        f32 = functools.partial(np.zeros, dtype=np.float32)
        dim, width = native.dim, batch.width
        return {
            "h": f32((rows, dim)), "normed": f32((rows, dim)),
            "qkv_local": f32((rows, self.my_qkv)), "qkv_ranks": f32(rows * width),
            "qkv": f32((rows, width)), "partials": f32((rows, batch.partial)),
            "gathered": f32((size, rows, batch.partial)),
            "attention": f32((rows, native.heads * native.head_dim)),
            "o_mine": f32((rows, self.my_o)),
            "o_ranks": f32(rows * dim), "o_part": f32((rows, dim)),
            "mlp_scratch": f32((rows, dim + 2 * self.hidden)),
            "mlp_local": f32((rows, dim)), "mlp_part": f32((rows, dim)),
            "logits": f32((logit_rows, native.head.rows))}

    def layer(self, step, index: int, layer_kv, added) -> int:
        """One layer of the step (see the module doc); the address of its MLP's output."""
        native, batch, b = self.native, self.batch, step.buffers
        lib, comm, rows = batch.library, batch.comm, step.split.total
        layer = native.layer_refs[index]
        if layer_kv.offset:
            native.attach_cache(index, layer_kv)
        lib.spmd_cp_batch_qkv(layer, rows, b["h"].ctypes.data, added, b["normed"].ctypes.data,
                              b["qkv_local"].ctypes.data)
        self._gather_columns(b["qkv_local"], b["qkv_ranks"], b["qkv"], self.qkv_widths)
        batch.attend(step, index, layer, layer_kv)
        comm.mpi.Allgather(b["partials"], b["gathered"])
        lib.spmd_cp_batch_merge(comm.size, rows * native.heads, native.head_dim, native.scale,
                                b["gathered"].ctypes.data, rows * batch.partial,
                                b["attention"].ctypes.data)
        # this rank's columns of W_o, rows my_o apart (the layer's own product writes
        # them dim apart)
        lib.spmd_cp_batch_product(ctypes.byref(native.layers[index].o), rows,
                                  b["attention"].ctypes.data, b["o_mine"].ctypes.data,
                                  self.my_o)
        self._gather_columns(b["o_mine"], b["o_ranks"], b["o_part"], self.o_widths)
        lib.spmd_cp_batch_mlp(layer, rows, b["h"].ctypes.data, b["o_part"].ctypes.data,
                              b["mlp_scratch"].ctypes.data, b["mlp_local"].ctypes.data)
        comm.mpi.Allreduce(b["mlp_local"], b["mlp_part"])
        summed_norm = native.summed_norms[index]
        if summed_norm is not None:  # the MLP's output normed after the ranks' sum
            for row in b["mlp_part"]:
                lib.spmd_cp_decode_norm(*summed_norm, native.dim, row.ctypes.data)
        return b["mlp_part"].ctypes.data

    def _gather_columns(self, local: np.ndarray, ranks: np.ndarray, out: np.ndarray,
                        widths: list[int]):
        """out (rows x sum(widths)) = every rank's ``local`` (rows x its width) side by
        side, through one Allgatherv into ``ranks`` (rank after rank)."""
        rows = local.shape[0]
        counts = [rows * w for w in widths]
        self.batch.comm.mpi.Allgatherv(local, [ranks, (counts, offsets(counts))])
        start = column = 0
        for width, count in zip(widths, counts):
            out[:, column:column + width] = ranks[start:start + count].reshape(rows, width)
            start, column = start + count, column + width

    def layer_bytes(self, rows: int) -> int:
        """What a layer's collectives hand to other ranks (Comm's counting)."""
        size, batch = self.batch.comm.size, self.batch
        own = rows * (self.my_qkv + batch.partial + self.my_o)
        return ((size - 1) * own + 2 * (size - 1) * rows * self.native.dim // size) * 4

    def head(self, b: dict, rows: int, added, logits_rows=None):
        """Every row's logits on rank 0: every rank holds every row's hidden state."""
        native = self.native
        self.batch.library.spmd_cp_batch_final_norm(
            rows, native.dim, b["h"].ctypes.data, added, native.norm.ctypes.data,
            native.norm_eps, b["normed"].ctypes.data)
        return self.batch.vocab_logits(b, rows, logits_rows)
