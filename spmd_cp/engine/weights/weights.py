"""The layer store of layer-sharded weights: broadcast prefetch (Sharded CP's "Shard Linear").

Layer i lives on rank i mod N (models/partial_load.py). Before layer i runs, its owner
broadcasts the layer's packed parameters (quantized ones as packed weights, scales and
biases) to every rank; the broadcast of layer i + K runs on a communication thread
while layer i computes, and a layer's parameters are dropped once the loop moves past
it. So a rank holds 1/N of the layers plus a window of K + 1 (the running layer and
those in flight), while the KV cache stays sequence-sharded as before.

The layer loop needs no change: ``LayerStore`` is the sequence of layer modules it
iterates. Iterating fills each module right before yielding it and empties it after.

Why K = 1: prefetching further ahead cannot make the loop faster than the slower of
compute and broadcast (the broadcasts run one after another on one thread); it only
absorbs jitter, and every extra layer costs memory. Measured: K = 2 and 4 prefilled and
decoded no faster than K = 1 (docs/SHARDED_WEIGHTS.md). The last layers of one forward
pass prefetch the first of the next (decode steps run back to back), so only the very
first layer's broadcast is ever exposed.

The broadcasts use their own duplicate of the communicator: MPI orders collectives per
communicator, and attention's collectives run on the main thread at the same time.
"""

from __future__ import annotations

import atexit
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ...runtime.comm import from_wire, to_wire

PREFETCH_LAYERS = 1  # K


def _wire_dtype(dtype: mx.Dtype) -> np.dtype:
    """The numpy dtype a parameter travels as (bfloat16 as its 16-bit pattern)."""
    probe = to_wire(mx.zeros((1,), dtype))
    return probe.dtype


class LayerStore:
    """The model's layers for one rank of a layer-sharded run (see the module docstring)."""

    sharded = True

    def __init__(self, modules: list, share, comm, prefetch: int = PREFETCH_LAYERS):
        self.modules, self.share, self.comm = modules, share, comm
        self.prefetch = max(1, min(prefetch, len(modules)))
        self.mpi = comm.mpi.Dup()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="spmd-cp-weights")
        self._pending = {}  # layer index -> (future, {name: numpy buffer})
        # What this rank sends for its own layers: evaluated, contiguous views, made once.
        self._own_wire = {i: {n: to_wire(a) for n, a in params.items()}
                          for i, params in share.layers.items()}
        self._wire_dtypes = [{n: _wire_dtype(dtype) for n, (_, dtype) in spec.items()}
                             for spec in share.layer_specs]
        self._held = {}  # non-owned layer index -> bytes of its received parameters
        self.peak_held_bytes = 0
        self.bytes_sent = 0
        self._converted = 0  # bytes of the running layer's converted (e.g. dequantized) copy
        for module in modules:
            self._empty(module)
        atexit.register(self.close)  # before MPI_Finalize (registered earlier, runs later)

    def __len__(self) -> int:
        return len(self.modules)

    def __getitem__(self, index: int):
        """The module (its parameters are placeholders unless the loop is running it)."""
        return self.modules[index]

    def __iter__(self):
        """Yield each layer's module filled with its parameters, then empty it again."""
        count = len(self.modules)
        for index in range(min(self.prefetch, count)):
            self._start(index)
        for index in range(count):
            if index + self.prefetch < count:
                self._start(index + self.prefetch)
            else:  # the next forward pass starts with these layers
                self._start((index + self.prefetch) % count)
            module = self.modules[index]
            self._fill(module, self._finish(index), index)
            yield module
            self._empty(module)
            self._held.pop(index, None)
            self._converted = 0

    # -- broadcasts ------------------------------------------------------------------
    def _start(self, index: int):
        """Post layer ``index``'s broadcast on the communication thread (once)."""
        if index in self._pending:
            return
        root = self.share.owner(index)
        if self.comm.rank == root:
            buffers = self._own_wire[index]
        else:
            buffers = {n: np.empty(shape, self._wire_dtypes[index][n])
                       for n, (shape, _) in self.share.layer_specs[index].items()}
        future = self._thread.submit(self._broadcast, index, buffers, root)
        self._pending[index] = (future, buffers)

    def _broadcast(self, index: int, buffers: dict, root: int):
        """Runs on the communication thread: every parameter of one layer, in name order."""
        start = time.perf_counter()
        for name in sorted(buffers):
            self.mpi.Bcast(buffers[name], root=root)
        tracer = self.comm.tracer
        if tracer is not None:
            tracer.complete(f"prefetch layer {index}", "transfer", start, time.perf_counter(),
                            thread=2, root=root,
                            bytes=int(sum(b.nbytes for b in buffers.values())))

    def _finish(self, index: int) -> dict:
        """Layer ``index``'s packed parameters once its broadcast has completed."""
        future, buffers = self._pending.pop(index)
        root = self.share.owner(index)
        with self.comm._waiting(f"weights of layer {index}", None if self.comm.rank == root
                                else root):
            future.result()
        if self.comm.rank == root:
            self.bytes_sent += (self.comm.size - 1) * sum(b.nbytes for b in buffers.values())
            self.comm.bytes_sent += (self.comm.size - 1) * sum(b.nbytes for b in buffers.values())
            return self.share.layers[index]
        dtypes = self.share.layer_specs[index]
        params = {n: from_wire(b, dtypes[n][1]) for n, b in buffers.items()}
        self._held[index] = sum(a.nbytes for a in params.values())
        self.peak_held_bytes = max(self.peak_held_bytes, self._held_bytes_now())
        return params

    def _held_bytes_now(self) -> int:
        """Received layers held now plus the buffers of broadcasts in flight."""
        in_flight = sum(b.nbytes for i, (_, buffers) in self._pending.items()
                        if self.share.owner(i) != self.comm.rank for b in buffers.values())
        return sum(self._held.values()) + in_flight + self._converted

    # -- modules ---------------------------------------------------------------------
    def _fill(self, module, packed: dict, index: int):
        params = self.share.form.convert(packed, f"model.layers.{index}.")
        same = {id(a) for a in packed.values()}
        self._converted = sum(a.nbytes for a in params.values() if id(a) not in same)
        self.peak_held_bytes = max(self.peak_held_bytes, self._held_bytes_now())
        module.update(tree_unflatten(list(params.items())))

    def _empty(self, module):
        """Swap the parameters for empty placeholders of the same dtypes: the arrays
        are freed once the lazy graph that still uses them has been evaluated."""
        placeholders = [(n, mx.zeros((0,), a.dtype)) for n, a in tree_flatten(module.parameters())]
        module.update(tree_unflatten(placeholders))

    def close(self):
        """Wait for the broadcasts still in flight (every rank posted the same ones)."""
        for future, _ in self._pending.values():
            future.result()
        self._pending.clear()
        self._thread.shutdown()
