"""Batched decode steps outside MLX's graph on the CPU path (kernels/batch_step.h).

The same work as batched_decode.BatchedDecoder's MLX step, over the native step's
layers (native_decode.NativeDecoder: its weights' structs, RoPE matrices, divided LM
head and pool), a layer in four C calls and two collectives:

    qkv:    this rank's run of the B rows: residual, RMSNorm, q/k/v (one product of
            its rows a matrix: a packed weight read once for all)  -> Allgatherv
    attend: every row's q/k norms and RoPE at its own position, the new k/v this rank
            stores written to its tail, then all B queries over this rank's share of
            the prefix (its keys read once for every row; a sliding window's layer
            each row from its own first key) and each row over its own tail, merged
                                                                    -> Allgather
    output: this rank's rows: the ranks' partials merged, W_o
    mlp:    this rank's rows: residual, RMSNorm, gate/up, activation, down
    head:   final RMSNorm of this rank's rows  -> Allgatherv; every row times this
            rank's rows of the vocabulary  -> Gatherv to rank 0

That is the replicated layout: each rank reads every weight for its rows. Where the
plan's step is split and dealing would give each rank fewer than SPLIT_BELOW_ROWS rows,
a step runs in the split layout instead (native_batched_split.py: every rank all rows
through its slices of the weights).

Tails (each sequence's own tokens after the prefix that this rank holds) are float32
numpy buffers here, each entry rounded as the prefix's cache would store it; the prefix
stays the engine's cache (any KV dtype: a half-precision one read in float32). Greedy
tokens equal one sequence's native step's (the products of several rows sum in another
order, to float32 rounding): tests/test_native_decode.py, test_batch.py, test_gemma3.py.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ...attention.block import window_start
from ...blas.libraries import rank_threads
from ...kernels import gemv_forward
from ...kernels.decode_step import BatchAttention
from ...models.quantized_shadows import SHADOWS
from ...runtime.comm import offsets
from .batch_rows import RowSplit
from ..cache.cache import ShardedKVCache
from .native_decode import ROPE_BLOCK, NativeDecoder
from .native_batched_split import SplitLayout
from .native_views import float32_view
from .native_tails import NativeTails
from .prefix_batch import PrefixBatch

# A step runs in the split layout (where the plan's step is split) while the replicated
# layout would give each rank fewer rows than this: its products of so few rows read every
# weight on every rank for little work (SmolLM2 at N = 2 after a 2,633-token document, 2-core
# AMD EPYC, 2026-12-07: split 17.2 / 26.8 ms a step of 2 / 4 rows against 19.5 / 33.9;
# 44.2 / 85.5 against 41.6 / 81.3 at 8 / 16 rows).
SPLIT_BELOW_ROWS = 4


def replicated_layers(engine) -> NativeDecoder:
    """The replicated layout's layers (whole matrices: a rank computes its rows): the
    plan's step where it is replicated, else one more over the same weights (views)."""
    if engine.decoder.split is None:
        return engine.decoder
    return NativeDecoder(engine.model, engine.cp, persistent=False)


class NativeBatchedDecoder(PrefixBatch):
    """Batched steps (PrefixBatch's admit, step, retire) over the native step's layers."""

    kind = "native"
    takes_prompts = True  # a key's prompt may take rows of a step (step, write_back)

    def __init__(self, engine, prefix: ShardedKVCache, prefix_tokens: int):
        native = replicated_layers(engine)
        super().__init__(engine, prefix, prefix_tokens,
                         NativeTails(len(native.layers), native.kv_heads, native.head_dim))
        self.native, self.library = native, native.library
        self._step_buffers: dict = {}  # per (rows, this rank's rows): _buffers'
        self.width = (native.heads + 2 * native.kv_heads) * native.head_dim
        self.partial = native.heads * (native.head_dim + 2)
        self._rope_start, self._rope_count, self._rope_bases = 0, 0, []
        self._scratch = np.zeros(0, np.float32)
        gemv_forward.lend_pool(rank_threads())  # the packed products of several rows
        # Where the plan's step is split, its layers run the steps of few rows
        self.split_layout = SplitLayout(self, engine.decoder) \
            if engine.decoder.split is not None else None

    # -- one step ----------------------------------------------------------------------
    def step(self, keys: list, tokens: list[int], on_layer=None, logits_rows=None):
        """Feed ``tokens[b]`` to sequence ``keys[b]``; the logits (R, V) of rows
        ``logits_rows`` (all rows where None) on rank 0, None elsewhere. A key may
        take several rows, in order: its prompt's tokens, each row seeing the rows
        before it (a prompt's rows: engine/scheduler.py)."""
        sequences = [self.sequences[key] for key in keys]
        positions, owners = self._place_rows(sequences)
        rows = len(keys)
        split = RowSplit.of(rows, self.comm.size)
        layout = self.split_layout if self.split_layout is not None and \
            max(split.counts) < SPLIT_BELOW_ROWS else None
        mine = slice(0, rows) if layout is not None else split.rows(self.comm.rank)
        with self.comm.bounded("decode step"):
            return self._forward(sequences, owners, np.array(tokens, np.int64)[mine],
                                 positions, split, on_layer, layout, logits_rows)

    def _place_rows(self, sequences) -> tuple[np.ndarray, list[int]]:
        """Each row's position and the rank that stores its entry, the sequences moved
        on past them (a sequence's rows in order, as one row a step would be)."""
        positions, owners = np.zeros(len(sequences), np.int64), []
        for b, sequence in enumerate(sequences):
            owner = self._place(sequence)
            positions[b] = sequence.position
            owners.append(owner)
            sequence.position += 1
            sequence.tail_sizes[owner] += 1
            if sequence.placed is not None:
                sequence.placed.append(owner)
        return positions, owners

    def write_back(self, key, cache: ShardedKVCache, token_ids: np.ndarray):
        """The rows ``key`` took since it was admitted to record them (or since the last
        write_back): their tokens ``token_ids`` (its prompt's, its answer's) appended to
        ``cache``, its source (the server's resident entry): its next request continues
        from there."""
        sequence = self.sequences[key]
        owners, sequence.placed = np.array(sequence.placed, np.int64), []
        if owners.size != len(token_ids) or cache.num_tokens + owners.size != sequence.position:
            raise ValueError("a write-back of rows the sequence did not take")
        keys, values = self.tails.last_entries(
            sequence.slot, int(np.count_nonzero(owners == self.comm.rank)))
        cache.append_placed(owners, token_ids, keys, values,
                            (sequence.decode_steps, sequence.decode_owner))

    def _store_rows(self, sequences, owners, positions) -> tuple[np.ndarray, np.ndarray]:
        """Per row the tail row its new entry takes here (-1: another rank's), recorded,
        and the entries of its slot here that it sees (its own and those before it)."""
        tails, counts = self.tails, Counter(s.slot for s in sequences)
        tails.reserve(len(tails.lengths), max(tails.lengths[slot] + count
                                              for slot, count in counts.items()))
        stores = np.full(len(sequences), -1, np.int32)
        seen = np.zeros(len(sequences), np.int32)
        for b, (sequence, owner) in enumerate(zip(sequences, owners)):
            if owner == self.comm.rank:
                row = tails.lengths[sequence.slot]
                stores[b] = row
                tails.positions[sequence.slot, row] = positions[b]
                tails.lengths[sequence.slot] += 1
            seen[b] = tails.lengths[sequence.slot]
        return stores, seen

    def _rotations(self, positions: np.ndarray) -> list:
        """Per layer a ctypes array of each row's RoPE matrix address, from one block of
        matrices that spans the rows' positions (rebuilt every ROPE_BLOCK steps)."""
        low, high = int(positions.min()), int(positions.max())
        if low < self._rope_start or high >= self._rope_start + self._rope_count:
            count = high - low + ROPE_BLOCK
            native = self.native
            blocks = self.model.rope_matrices.block(native.ropes, native.head_dim, low, count)
            if any(b is None for b in blocks):
                raise TypeError("a RoPE without a matrix form")
            views = {id(b): float32_view(b) for b in blocks}
            self._rope_views = list(views.values())
            self._rope_bases = [views[id(b)].ctypes.data for b in blocks]
            self._rope_start, self._rope_count = low, count
        step = self.native.head_dim ** 2 * 4
        offsets_ = (positions - self._rope_start) * step
        kind = ctypes.c_void_p * len(positions)
        return [kind(*(base + int(o) for o in offsets_)) for base in self._rope_bases]

    def _firsts(self, sequences, positions, seen) -> tuple[dict, dict]:
        """Per sliding window: each row's first prefix key here and first tail entry here
        that its query sees (int32 arrays)."""
        prefix, tail = {}, {}
        for window in set(self.native.windows) - {None}:
            prefix[window] = np.array([window_start(self.prefix.positions, int(p), window)
                                       for p in positions], np.int32)
            tail[window] = np.array([
                window_start(self.tails.positions[s.slot, :n], int(p), window)
                for s, p, n in zip(sequences, positions, seen)], np.int32)
        return prefix, tail

    def _buffers(self, rows: int, mine: int, logits_rows=None) -> dict:
        """The step's vectors for ``rows`` rows, ``mine`` of them this rank's: a decode
        step's made once for each batch size (a step overwrites all it reads); a step with
        a prompt's rows (``logits_rows`` given) gets its own, dropped after it (their
        counts vary without bound, and each would keep a vocabulary of logits a row)."""
        if logits_rows is not None:
            return self._new_buffers(rows, mine, len(logits_rows))
        if (rows, mine) not in self._step_buffers:
            self._step_buffers[rows, mine] = self._new_buffers(rows, mine, rows)
        return self._step_buffers[rows, mine]

    def _new_buffers(self, rows: int, mine: int, logit_rows: int) -> dict:
        native, f32 = self.native, (lambda *shape: np.zeros(shape, np.float32))
        dim, hidden = native.dim, max(layer.gate.rows for layer in native.layers)
        return {"h": f32(mine, dim), "normed": f32(max(rows, 1), dim),
                "qkv_local": f32(mine, self.width), "qkv": f32(rows, self.width),
                "partials": f32(rows, self.partial),
                "gathered": f32(self.comm.size, rows, self.partial),
                "attention": f32(mine, native.heads * native.head_dim),
                "o_part": f32(mine, dim), "mlp_part": f32(mine, dim),
                "mlp_scratch": f32(mine, dim + 2 * hidden),
                "logits": f32(logit_rows, native.head.rows)}

    def _scratch_for(self, rows: int) -> int:
        """The attention's scratch (spmd_cp_batch_scratch), grown by doubling."""
        native, lengths = self.native, [layer.offset for layer in self.prefix.layers]
        need = self.library.spmd_cp_batch_scratch(native.heads, native.kv_heads,
                                                  native.head_dim, rows, max(lengths),
                                                  self.tails.positions.shape[1])
        if self._scratch.size < need:
            self._scratch = np.zeros(max(need, 2 * self._scratch.size), np.float32)
        return self._scratch.ctypes.data

    def _forward(self, sequences, owners, my_tokens, positions, split: RowSplit, on_layer,
                 layout=None, logits_rows=None):
        """The step's layers and head (see the module doc; ``layout``: the split layout's,
        native_batched_split.py): the logits of ``logits_rows`` on rank 0."""
        native, comm = self.native, self.comm
        rows, mine = split.total, my_tokens.size
        buffers = self._buffers(rows, mine, logits_rows) if layout is None else \
            layout.buffers(rows, logits_rows)
        step = self._step_for(sequences, owners, positions, split, buffers)
        self._embed(my_tokens, step.buffers["h"])
        added = None
        for index, layer_kv in enumerate(self.prefix.layers):
            if on_layer is not None:
                on_layer(index)
            if layout is None:
                added = self._layer(step, index, native.layer_refs[index], layer_kv, added)
            else:
                added = layout.layer(step, index, layer_kv, added)
        if layout is not None:
            comm.bytes_sent += len(native.layers) * layout.layer_bytes(rows)
            return layout.head(step.buffers, rows, added, logits_rows)
        comm.bytes_sent += len(native.layers) * self._layer_bytes(rows, mine)
        return self._head(step.buffers, rows, mine, split, added, logits_rows)

    def _layer_bytes(self, rows: int, mine: int) -> int:
        """What a layer's collectives hand to other ranks (Comm's counting)."""
        return (self.comm.size - 1) * (mine * self.width + rows * self.partial) * 4

    def _step_for(self, sequences, owners, positions, split: RowSplit, buffers: dict
                  ) -> "_Step":
        """What every layer of the step reads, the new entries' tail rows reserved."""
        stores, tail_lengths = self._store_rows(sequences, owners, positions)
        prefix_firsts, tail_firsts = self._firsts(sequences, positions, tail_lengths)
        return _Step(split, self.comm.rank, buffers, self._scratch_for(split.total),
                     self._rotations(positions), stores,
                     np.array([s.slot for s in sequences], np.int32), tail_lengths,
                     prefix_firsts, tail_firsts)

    def _layer(self, step: "_Step", index: int, layer, layer_kv, added):
        """One layer of the step (see the module doc); the address of its MLP's output."""
        native, lib, comm, b = self.native, self.library, self.comm, step.buffers
        rows, mine = step.split.total, step.mine
        if layer_kv.offset:
            native.attach_cache(index, layer_kv)
        lib.spmd_cp_batch_qkv(layer, mine, b["h"].ctypes.data, added, b["normed"].ctypes.data,
                              b["qkv_local"].ctypes.data)
        if comm.size > 1:
            counts = [n * self.width for n in step.split.counts]
            comm.mpi.Allgatherv(b["qkv_local"], [b["qkv"], (counts, offsets(counts))])
        else:
            b["qkv"] = b["qkv_local"]
        self.attend(step, index, layer, layer_kv)
        parts, source = 1, b["partials"][step.first_row:]
        if comm.size > 1:  # every rank's partials of every row; this rank merges its own
            comm.mpi.Allgather(b["partials"], b["gathered"])
            parts, source = comm.size, b["gathered"][0, step.first_row:]
        if mine:
            lib.spmd_cp_batch_merge(parts, mine * native.heads, native.head_dim, native.scale,
                                    source.ctypes.data, rows * self.partial,
                                    b["attention"].ctypes.data)
        lib.spmd_cp_batch_output(layer, mine, b["attention"].ctypes.data, b["o_part"].ctypes.data)
        lib.spmd_cp_batch_mlp(layer, mine, b["h"].ctypes.data, b["o_part"].ctypes.data,
                              b["mlp_scratch"].ctypes.data, b["mlp_part"].ctypes.data)
        return b["mlp_part"].ctypes.data

    def attend(self, step: "_Step", index: int, layer, layer_kv):
        """Every row's query over this rank's share of the prefix and its own tail: the
        partials (rows x heads x (d + 2)) into the step's buffer."""
        window, b = self.native.windows[index], step.buffers
        firsts = None
        if window is not None:  # the layer's first kept key: what it dropped is not there
            firsts = np.maximum(step.prefix_firsts[window] - layer_kv.dropped, 0).astype(
                np.int32)
        attention = BatchAttention(
            step.split.total, ctypes.cast(step.rotations[index], ctypes.c_void_p),
            step.stores.ctypes.data, step.slots.ctypes.data,
            None if firsts is None else firsts.ctypes.data,
            layer_kv.offset, self.tails.keys[index].ctypes.data,
            self.tails.values[index].ctypes.data, self.tails.positions.shape[1],
            step.tail_firsts.get(window, step.no_tail_firsts).ctypes.data,
            step.tail_lengths.ctypes.data)
        self.library.spmd_cp_batch_attend(layer, ctypes.byref(attention), b["qkv"].ctypes.data,
                                          step.scratch, b["partials"].ctypes.data)

    def _embed(self, tokens: np.ndarray, h: np.ndarray):
        native = self.native
        if tokens.size:
            if native.embedding_released:
                SHADOWS.lookup(native.embedding_table, tokens, h)
            else:
                np.copyto(h, native.embedding[tokens])
            if native.embed_scale is not None:
                np.multiply(h, native.embed_scale, out=h)

    def _head(self, b: dict, rows: int, mine: int, split: RowSplit, added, logits_rows=None):
        """Every row's logits on rank 0: the final norm of this rank's rows, every rank's
        normed rows gathered, times this rank's rows of the vocabulary, gathered."""
        native, lib, comm = self.native, self.library, self.comm
        normed = b["normed"][:rows]
        local = np.zeros((mine, native.dim), np.float32)
        lib.spmd_cp_batch_final_norm(mine, native.dim, b["h"].ctypes.data, added,
                                     native.norm.ctypes.data,
                                     native.norm_eps, local.ctypes.data)
        if comm.size > 1:
            counts = [n * native.dim for n in split.counts]
            comm.mpi.Allgatherv(local, [normed, (counts, offsets(counts))])
            comm.bytes_sent += (comm.size - 1) * local.nbytes
        else:
            normed[...] = local
        return self.vocab_logits(b, rows, logits_rows)

    def vocab_logits(self, b: dict, rows: int, logits_rows=None):
        """Rows ``logits_rows`` (all where None) of the normed rows (b["normed"]) times
        this rank's rows of the vocabulary, gathered: the logits on rank 0, None
        elsewhere."""
        native, lib, comm = self.native, self.library, self.comm
        normed = b["normed"][:rows]
        if logits_rows is not None:  # a prompt's rows but its last: no logits wanted
            if not logits_rows:
                return None
            rows = len(logits_rows)
            normed = np.ascontiguousarray(normed[logits_rows])
        logits = b["logits"][:rows]
        lib.spmd_cp_batch_product(ctypes.byref(native.head), rows, normed.ctypes.data,
                                  logits.ctypes.data, native.head.rows)
        if comm.size == 1:
            return mx.array(logits)
        vocab = native.vocab_sizes
        counts = [rows * v for v in vocab]
        gathered = np.empty(sum(counts), np.float32) if comm.rank == 0 else None
        comm.mpi.Gatherv(logits, [gathered, (counts, offsets(counts))] if gathered is not None
                         else None, root=0)
        if comm.rank != 0:
            comm.bytes_sent += logits.nbytes
            return None
        pieces = np.split(gathered, np.cumsum(counts)[:-1])
        return mx.array(np.concatenate([p.reshape(rows, v) for p, v in zip(pieces, vocab)],
                                       axis=1))


@dataclass
class _Step:
    """What every layer of one step reads: the rows' split, buffers and per-row arrays."""

    split: RowSplit
    rank: int
    buffers: dict
    scratch: int  # the attention's scratch (its address)
    rotations: list  # per layer, each row's RoPE matrix address
    stores: np.ndarray  # per row the tail row its new entry takes here, or -1
    slots: np.ndarray
    tail_lengths: np.ndarray
    prefix_firsts: dict  # per window, each row's first prefix key here
    tail_firsts: dict  # per window, each row's first tail entry here

    @property
    def mine(self) -> int:
        return self.split.counts[self.rank]

    @property
    def first_row(self) -> int:
        return sum(self.split.counts[:self.rank])

    no_tail_firsts: np.ndarray = None  # zeros: every tail entry seen (no window)

    def __post_init__(self):
        self.no_tail_firsts = np.zeros(self.split.total, np.int32)
