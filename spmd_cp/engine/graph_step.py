"""Decode steps as one MLX graph each: the layer loop of engine/model.py over every rank's
whole weights (replicated) or over its slices (tp_decode.py's split step), attention
merged across ranks through ``collectives`` (a Comm, or runtime/graph_comm.py's graph
collectives). The step the decode plan names where the native one (native_decode.py)
cannot run: the GPU path, quantized or unusual layers, layer-sharded weights."""

from __future__ import annotations

from contextlib import nullcontext

import mlx.core as mx
import numpy as np

from ..attention import decode_attention
from .model import CPModel


class GraphStep:
    """Decode steps of ``model`` over ``comm``, each one MLX graph."""

    def __init__(self, model: CPModel, comm, collectives, merge: str, split=None):
        """``split``: tp_decode.TensorParallelDecoder (the split layout), or None (every
        rank computes the whole step). ``merge``: attention's merge across ranks."""
        self.model, self.comm, self.split = model, comm, split
        self.attend = decode_attention(collectives, merge, model.compute)

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
            # Ranks > 0 need no logits (they join a vocabulary-parallel head with no
            # rows); evaluating finishes the layers' collectives.
            logits = self.model.logits(hidden if self.comm.rank == 0 else hidden[:0])
            if self.comm.rank != 0:
                logits = (logits, hidden)
        return logits

    def free(self):
        """Nothing held outside MLX (the native step's persistent requests have this)."""
