"""Decode steps as one MLX graph each: the layer loop of engine/model.py over every rank's
whole weights (replicated) or over its slices (tp_decode.py's split step), attention
merged across ranks through ``collectives`` (a Comm, or runtime/graph_comm.py's graph
collectives). The step the decode plan names where the native one (native_decode.py)
cannot run: the GPU path, quantized or unusual layers, layer-sharded weights."""

from __future__ import annotations

from contextlib import nullcontext

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...attention import decode_attention
from ..model import CPModel
from ..weights.weight_slices import times_transposed


class GraphStep:
    """Decode steps of ``model`` over ``comm``, each one MLX graph."""

    def __init__(self, model: CPModel, comm, collectives, merge: str, split=None):
        """``split``: tp_decode.TensorParallelDecoder (the split layout), or None (every
        rank computes the whole step). ``merge``: attention's merge across ranks."""
        self.model, self.comm, self.split = model, comm, split
        self.collectives = collectives
        self.attend = decode_attention(collectives, merge, model.compute)
        self.head = None if split is not None else DividedHead.of(model, comm.rank, comm.size)

    def step(self, token, position: np.ndarray, cache, store: bool, on_layer=None,
             tracer=None, wait: bool = True):
        """The next logits (V,) on rank 0 (None elsewhere) after ``token`` at
        ``position``. ``token``: an int, or on one rank an unevaluated mx.array scalar,
        whose logits ``wait=False`` leaves unevaluated too (the overlapped loop)."""
        # a grid's TP sums join this graph where its collectives opened (tensor_groups.py)
        group = self.model.tensor_group
        with group.in_graph() if group is not None else nullcontext():
            logits = self._logits(token, position, cache, store, on_layer, tracer)
        if wait:
            with self.comm.bounded("decode step"):  # may run graph collectives
                mx.eval(logits)
        return logits.squeeze(0) if self.comm.rank == 0 else None  # a view, not a Gather

    def _logits(self, token, position, cache, store, on_layer, tracer):
        """The step's graph: the logits on rank 0, (its logits, hidden) elsewhere (each
        must evaluate its collectives)."""
        lazy = isinstance(token, mx.array)
        if self.split is not None:
            hidden = self.split.forward(token, position, cache, self.attend, store, on_layer,
                                        tracer)
            logits = self.split.logits(hidden)
        else:
            ids = token.reshape(1) if lazy else np.array([token])
            hidden = self.model.forward(ids, position, cache, self.attend, store=store,
                                        on_layer=on_layer, tracer=tracer)
            if self.head is not None:  # every rank its share of the vocabulary
                logits = self.head.logits(self.model, hidden, self.collectives)
            else:
                # Ranks > 0 need no logits (they join a vocabulary-parallel head with no
                # rows); evaluating finishes the layers' collectives.
                logits = self.model.logits(hidden if self.comm.rank == 0 else hidden[:0])
            if self.comm.rank != 0:
                logits = (logits, hidden)
        return logits

    def free(self):
        """Nothing held outside MLX (the native step's persistent requests have this)."""


class DividedHead:
    """The replicated step's LM head divided over the ranks by vocabulary rows: every
    rank holds the step's hidden state, so each computes the logits of its rows and one
    Allgather gives rank 0 all of them, where rank 0 alone would compute the whole head
    while the others wait. Each logit is the same dot product as in the whole product
    (a row view of the matrix: a packed head's kernel reads those rows' blocks only).
    Gemma 3's 262,144 x 640 head is a large share of its decode step."""

    def __init__(self, weight: mx.array, bias: mx.array | None, rows: tuple[int, int],
                 width: int, vocab: int):
        self.weight, self.bias = weight, bias
        self.rows, self.width, self.vocab = rows, width, vocab

    @classmethod
    def of(cls, model: CPModel, rank: int, size: int) -> "DividedHead | None":
        """Rank ``rank``'s share of ``size``, or None where the head stays whole: one
        rank, a head divided already (a grid's, a layer-sharded one), or a quantized
        module (its product is MLX's own)."""
        head = model.lm_head
        tied = getattr(head, "__self__", None)  # embed_tokens.as_linear
        if size == 1 or model.tensor_group is not None or getattr(head, "collective", False):
            return None
        if type(tied) is nn.Embedding:
            weight, bias = tied["weight"], None
        elif type(head) is nn.Linear:
            weight, bias = head["weight"], head.get("bias")
        else:
            return None
        vocab = weight.shape[0]
        width = -(-vocab // size)
        first = min(rank * width, vocab)
        return cls(weight, bias, (first, min(first + width, vocab)), width, vocab)

    def logits(self, model: CPModel, hidden: mx.array, collectives) -> mx.array:
        """Every rank's logits (1, V) in float32 (collective)."""
        first, end = self.rows
        x = model.norm(hidden)
        piece = times_transposed(x, self.weight[first:end])
        if self.bias is not None:
            piece = piece + self.bias[first:end]
        piece = piece.astype(mx.float32).reshape(-1)
        if end - first < self.width:  # the last rows' share is shorter: padded to size
            piece = mx.concatenate([piece, mx.zeros((self.width - (end - first),))])
        return collectives.allgather_stack(piece).reshape(1, -1)[:, :self.vocab]
