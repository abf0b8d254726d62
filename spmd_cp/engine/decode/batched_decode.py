"""Batched decode: one step advances several sequences that share a cached prefix.

The B sequences' new tokens go through every matrix as B rows, dealt to the ranks in
contiguous runs (``RowSplit``): a rank computes its rows' projections, MLP and logits,
each weight read once a step for all of them. Each sequence's keys and values are in
two parts:

    prefix   the part every sequence begins with (a batch group's document), held once
             in the engine's ShardedKVCache, read-only while the sequences decode;
    tail     the sequence's own tokens after it (its question, its answer so far), in
             this rank's slot of ``TailKV``: one padded buffer a layer for every slot.

A layer's attention gathers every rank's rows of q, k and v (one Allgather), stores the
new entries this rank owns, computes the prefix's partial for all B queries at once (the
prefix's keys read once for the B queries: block.block_attention), every tail's partial
in one product over the slots (masked to each slot's own entries), merges the two
exactly as two key blocks merge (block.merge_partials), and gathers the ranks' partials
(one Allgather), each rank merging its own rows'. A sequence's tail is spread over the
ranks like any decode token's K/V: each new token is stored on the rank its own
placement rule names (partition.decode_owner over the prefix's and its tail's sizes).

Pure MLX ops (the Metal and the CUDA backend alike); the collectives are MLX's graph
collectives where the ranks can open them (the step one graph, evaluated once), else
mpi4py's.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ...attention import block_attention, merge_partials
from ...blas.libraries import rank_threads
from ...kernels import gemv_forward
from ..afd.afd_attention import afd_halves, ping_pong
from .batch_rows import RowSplit
from ..cache.cache import ShardedKVCache
from .prefix_batch import PrefixBatch, Sequence, TailSlots


class NewRows(NamedTuple):
    """Where this rank stores a step's new entries: batch rows, their slots and their
    rows in the slots (index arrays, one entry per stored token)."""

    batch: mx.array
    slots: mx.array
    rows: mx.array


class TailKV(TailSlots):
    """MLX's tails: per layer keys and values (S, NKV, C, d) in the cache's dtype, a
    layer's buffers made (or grown to the present S and C) when first used."""

    def __init__(self, dtype: mx.Dtype):
        super().__init__()
        self.dtype = dtype
        self.buffers: dict[int, tuple[mx.array, mx.array]] = {}

    def layer(self, index: int, kv_heads: int, head_dim: int) -> tuple[mx.array, mx.array]:
        """Layer ``index``'s (keys, values), at the reserved size."""
        shape = (*self.positions.shape[:1], kv_heads, self.positions.shape[1], head_dim)
        old = self.buffers.get(index)
        if old is None or old[0].shape != shape:
            grown = []
            for array in old or (None, None):
                new = mx.zeros(shape, self.dtype)
                if array is not None:
                    s, _, c, _ = array.shape
                    new[:s, :, :c] = array
                grown.append(new)
            self.buffers[index] = tuple(grown)
        return self.buffers[index]

    def write(self, index: int, slot: int, row: int, keys: mx.array, values: mx.array):
        """Entries (NKV, n, d) at rows ``row`` on of ``slot``, in layer ``index``."""
        n = keys.shape[1]
        layer_keys, layer_values = self.layer(index, keys.shape[0], keys.shape[2])
        layer_keys[slot, :, row:row + n] = keys.astype(self.dtype)
        layer_values[slot, :, row:row + n] = values.astype(self.dtype)

    def scatter(self, index: int, rows: "NewRows", keys: mx.array, values: mx.array):
        """One new entry for each of ``rows``' slots, from the batch rows it names of
        ``keys``, ``values`` (NKV, B, d): one scatter a buffer (each MLX op costs more
        than these few rows' bytes)."""
        layer_keys, layer_values = self.layer(index, keys.shape[0], keys.shape[2])
        for buffer, new in ((layer_keys, keys), (layer_values, values)):
            buffer[rows.slots, :, rows.rows] = (
                new[:, rows.batch].swapaxes(0, 1).astype(self.dtype))

    def release(self):
        super().release()
        self.buffers = {}

    def take(self, index: int, slot: int, keys: mx.array, values: mx.array, start: int,
             stop: int):
        self.write(index, slot, 0, keys[:, start:stop], values[:, start:stop])

    def settle(self):
        mx.eval(list(self.buffers.values()))  # copied now, not when first read

    @property
    def nbytes(self) -> int:
        """Bytes of every slot's buffers (the most the batch held: they never shrink)."""
        return sum(keys.nbytes + values.nbytes for keys, values in self.buffers.values())


class BatchedDecoder(PrefixBatch):
    """MLX's decode steps of several sequences after one shared prefix (see the module
    doc)."""

    kind = "mlx"  # the step's body, as --json's batched_step names it

    def __init__(self, engine, prefix: ShardedKVCache, prefix_tokens: int):
        # the CP group's ranks deal the rows (all of them without --tp); a TP group's
        # ranks hold the same rows and sum their slices' products in the layers
        super().__init__(engine, prefix, prefix_tokens, TailKV(engine.model.kv_dtype))
        # The step's collectives: MLX's graph collectives where the ranks can open them
        # (the step is then one graph, evaluated once), else mpi4py's.
        self.collectives = engine.batched_collectives()
        width = self.model.norm.weight.shape[-1]
        # its shape (a grid's head does gather its group's pieces: every rank builds
        # this decoder at the same point)
        self.vocab = self.model.logits(mx.zeros((1, width))).shape[-1]
        gemv_forward.lend_pool(rank_threads())  # the packed products of B rows

    # -- one step ----------------------------------------------------------------------
    def step(self, keys: list, tokens: list[int], on_layer=None):
        """Feed ``tokens[b]`` to sequence ``keys[b]``; the next logits (B, V) on rank 0
        (None elsewhere). Under ``--afd`` with ``--afd-micro-batches`` above 1 a step of
        two or more sequences runs as two halves, one's attention while the FFN ranks
        compute the other's MLP (afd_attention.ping_pong)."""
        sequences = [self.sequences[key] for key in keys]
        owners = [self._place(sequence) for sequence in sequences]
        client = self.model.ffn_client
        parts = [slice(0, len(keys))] if client is None else \
            afd_halves(len(keys), client.link.micro_batches)
        # every half's new rows placed before any half's attention reads the tails
        views = [_BatchView(self, self._rows(sequences[p], owners[p])) for p in parts]
        passes, splits = [], []
        for part, view in zip(parts, views):
            positions = np.array([s.position for s in sequences[part]], np.int64)
            split = RowSplit.of(len(positions), self.comm.size)
            mine = split.rows(self.comm.rank)
            passes.append((np.array(tokens[part], np.int64)[mine], positions[mine], view,
                           self._attention(sequences[part], positions, split)))
            splits.append(split)
        with self.engine.crossing(replicated=False):  # --afd: each rank's own rows
            if len(passes) == 2:
                hidden = ping_pong(self.model, passes, on_layer)
            else:
                hidden = [self.model.forward(*passes[0], store=True, on_layer=on_layer,
                                             tracer=self.comm.tracer)]
        logits = [self._logits(h, split) for h, split in zip(hidden, splits)]
        for sequence, owner in zip(sequences, owners):
            sequence.position += 1
            sequence.tail_sizes[owner] += 1
        return mx.concatenate(logits) if self.comm.rank == 0 else None

    def _logits(self, hidden: mx.array, split: "RowSplit"):
        """Every rank's rows' logits, gathered to rank 0."""
        logits = self.model.logits(hidden)  # this rank's rows
        graph = self.collectives is not self.comm
        if graph:  # gathered inside the step's one graph
            logits = self._gathered(logits, split)
        with self.comm.bounded("decode step"):
            mx.eval(logits, hidden)
        if not graph:
            logits = self._gathered(logits, split)
        return logits

    def _gathered(self, logits: mx.array, split: "RowSplit"):
        """Every rank's rows of logits, (B, V) on rank 0 (graph collectives: on every
        rank, as they must all evaluate it)."""
        if self.comm.size == 1:
            return logits
        gathered = self.collectives.gather_rows(logits.reshape(-1),
                                                [n * self.vocab for n in split.counts])
        return None if gathered is None else gathered.reshape(split.total, self.vocab)

    def _rows(self, sequences: list[Sequence], owners: list[int]) -> NewRows | None:
        """Where this rank stores the step's new tokens (None: none here), recorded."""
        rows, tails = [], self.tails
        needed = max(tails.lengths[s.slot] + 1 for s in sequences)
        tails.reserve(len(tails.lengths), needed)
        for b, (sequence, owner) in enumerate(zip(sequences, owners)):
            if owner == self.comm.rank:
                row = tails.lengths[sequence.slot]
                rows.append((b, sequence.slot, row))
                tails.positions[sequence.slot, row] = sequence.position
                tails.lengths[sequence.slot] += 1
        if not rows:
            return None
        return NewRows(*(mx.array(list(column), mx.int32) for column in zip(*rows)))

    def _attention(self, sequences: list[Sequence], positions: np.ndarray, split: "RowSplit"):
        """The layers' attend for this step: this rank's rows' queries and new keys and
        values gathered from every rank, the new entries this rank stores written, the
        B queries' partials over this rank's prefix and tails, every rank's partials
        gathered and this rank's rows merged."""
        slots = [s.slot for s in sequences]
        whole = slots == list(range(len(self.tails.lengths)))
        taken = None if whole else mx.array(slots)
        tail_positions = self.tails.positions[slots]  # (B, C)
        masks = {}

        def mask(window):
            if window not in masks:
                seen = tail_positions <= positions[:, None]
                if window is not None:
                    seen &= tail_positions > positions[:, None] - window
                masks[window] = mx.array(np.where(seen, 0.0, -np.inf).astype(np.float32))
            return masks[window]

        prefix_positions, collectives = self.prefix.positions, self.collectives
        scales = {}  # each layer's scale as an array, made once a step

        def attend(q, inputs: "_LayerInputs", _, __, ___, scale, window=None):
            q, k, v = split.gather(collectives, q, inputs.keys, inputs.values)
            if inputs.new_rows is not None:
                self.tails.scatter(inputs.index, inputs.new_rows, k, v)
            tail_keys, tail_values = self.tails.layer(inputs.index, k.shape[0], k.shape[2])
            out, lse = prefix_attention(q, inputs.prefix_keys, inputs.prefix_values, positions,
                                        prefix_positions[inputs.dropped:], scale, window)
            if taken is not None:
                tail_keys, tail_values = tail_keys[taken], tail_values[taken]
            if scale not in scales:
                scales[scale] = mx.array(scale, mx.float32)
            out, lse = _tail_merged(q, tail_keys, tail_values, mask(window), out, lse,
                                    scales[scale])
            if collectives.size == 1:
                return out
            return split.merge_mine(collectives, out, lse)

        return attend


class _LayerInputs(NamedTuple):
    """What a batched step's layer hands its attention (``_BatchLayer.shard``)."""

    index: int
    keys: mx.array  # this rank's rows' new keys (NKV, n, d)
    values: mx.array
    new_rows: NewRows | None  # the entries this rank stores
    prefix_keys: mx.array  # this rank's shard of the prefix
    prefix_values: mx.array
    dropped: int  # the prefix positions before the shard's first (a window's dropped keys)


class _BatchView:
    """What ``CPModel.forward`` reads as its cache during a batched step: each layer's
    ``shard`` hands attention this rank's new keys and values and its prefix shard
    (attention stores the new entries, once every rank's rows are in)."""

    def __init__(self, decoder: BatchedDecoder, new_rows: NewRows | None):
        self.layers = [_BatchLayer(decoder, index, new_rows)
                       for index in range(decoder.model.num_layers)]
        self.positions = None  # attention reads the decoder's positions


class _BatchLayer:
    def __init__(self, decoder: BatchedDecoder, index: int, new_rows: NewRows | None):
        self.decoder, self.index, self.new_rows = decoder, index, new_rows

    dropped = 0  # (what CPModel.attention_half asks a cache layer: none here)

    def shard(self, k: mx.array, v: mx.array, store: bool):
        prefix = self.decoder.prefix.layers[self.index]
        prefix_keys, prefix_values = prefix.fetch()
        if prefix_keys is None:  # nothing of the prefix here
            prefix_keys, prefix_values = k[:, :0], v[:, :0]
        # (block_attention and tail_attention read a half-precision cache in float32)
        return _LayerInputs(self.index, k, v, self.new_rows, prefix_keys, prefix_values,
                            prefix.dropped), None


def prefix_attention(q, keys, values, q_pos: np.ndarray, k_pos: np.ndarray, scale: float,
                     window: int | None):
    """The B queries' (out, lse) over this rank's share of the prefix: its keys read once
    for all of them, in MLX's tiles (block_attention), inside the step's graph. (The
    prefill's C kernel would evaluate the graph at every layer to hand it its inputs:
    measured, that doubled a step, P = 3,000, B = 8, one rank.)"""
    return block_attention(q, keys, values, q_pos, k_pos, scale, window, native=False)


@mx.compile
def _tail_merged(q, keys, values, mask, out, lse, scale):
    """The tails' partial (tail_attention) merged into the prefix's (out, lse): one
    compiled graph, where its few dozen small ops a layer would each cost more than
    their work."""
    tail_out, tail_lse = tail_attention(q, keys, values, mask, scale)
    return merge_partials(out, lse, tail_out, tail_lse)


def tail_attention(q: mx.array, keys: mx.array, values: mx.array, mask: mx.array, scale):
    """Each query row b (q: (NH, B, d)) over its own slot's keys (B, NKV, C, d), with
    ``mask`` (B, C) adding 0 where row b sees an entry and -inf elsewhere: (out (NH, B,
    d), lse (NH, B)) in float32; a row that sees nothing gets out 0 and lse -inf."""
    num_heads, batch, head_dim = q.shape
    num_kv = keys.shape[1]
    q = q.astype(mx.float32).transpose(1, 0, 2).reshape(batch, num_kv, num_heads // num_kv,
                                                        head_dim)
    keys, values = keys.astype(mx.float32), values.astype(mx.float32)
    scores = (q * scale) @ keys.swapaxes(-1, -2) + mask[:, None, None, :]  # (B, NKV, G, C)
    top = scores.max(axis=-1, keepdims=True)
    top = mx.where(top == -np.inf, 0.0, top)
    probs = mx.exp(scores - top)
    total = probs.sum(axis=-1, keepdims=True)
    out = (probs @ values) / mx.where(total > 0, total, 1.0)
    lse = (mx.log(total) + top)[..., 0]  # (B, NKV, G)
    return (out.reshape(batch, num_heads, head_dim).transpose(1, 0, 2),
            lse.reshape(batch, num_heads).transpose(1, 0))
