"""Tensor-parallel decode steps (Helix, as in TensorRT-LLM): the weights' work split too.

Splitting the KV cache only splits attention. A decode step of a small model on a CPU
spends as long again reading the projection, MLP and LM-head weights, and every rank
already holds all of them. So each rank computes a 1/N slice of every matmul:

    qkv:   rows of [Wq; Wk; Wv] (column-parallel)  -> Allgather -> full q, k, v everywhere
    attn:  each rank's KV shard (CP, as before)    -> exact merge across ranks
    o:     rows of Wo (column-parallel)            -> Allgather of the outputs
    mlp:   rows of Wgate, Wup; columns of Wdown    -> Allreduce-sum
           (a mixture of experts: the same cut of every expert, expert_slices.py)
    head:  rows of the vocabulary (vocab-parallel) -> Gatherv of the logits to rank 0

Three small collectives per layer (about (NH + 2 NKV) d + NH (d+1) + 2 D floats) replace
(N-1)/N of the weight reads: it pays when the link latency times 3 L is well below the
time to read (N-1)/N of the weights, which the engine measures (``--decode-tp auto``).
W_o is split by rows, not by columns: every rank holds the whole merged attention output,
so it reads whole rows, which are views of the loaded matrix (no copy); the columns'
half rows took 0.87 ms a step at N = 2 in the native step for half of the 1.12 ms N = 1
spends on all of W_o, and needed a copy of 1/N of W_o on every rank. Both steps (graph
and native) take this one layout. MLX's split step with W_o's columns and an Allreduce
against its rows, N = 2, SmolLM2-135M Q4_1, a 901-token prompt, 64 greedy tokens,
alternating runs on the 2-core AMD EPYC machine while other jobs loaded it (load average
17-26; 2026-11-25): 1.44 / 1.60 against 1.62 / 0.92 tok/s, not told apart; the rows
held 20 MB less a rank (model_bytes 722 against 742 MB). Quantized weights are sliced
packed (weight_slices.py): columns of Wdown only on group boundaries. Results equal the
replicated step up to float summation order. The layer loop itself is
CPModel.forward's, with ``LayerSlice`` as its projections.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.gemma3_text import clip_residual

from ...attention.exp import swiglu
from ...runtime.comm import Comm
from ..weights.expert_slices import expert_bytes, expert_slice, expert_width, experts_obstacle
from ..layer_parts import LayerParts, describe_feed_forward
from ..model import CPModel, vocabulary_projection
from ...models.packed_load import released_columns
from ...models.quantized_shadows import SHADOWS
from ..weights.vocab_parallel import VocabParallelHead
from ..weights.weight_slices import WeightMatrix, apply_all, column_slice, split_ranges, stack_rows

log = logging.getLogger("spmd_cp")

# A rank whose q/k/v outputs span several of the matrices (at N = 2 the second rank's
# span the end of Wq, Wk and Wv) copies its rows into one matrix when they take at most
# this many bytes a layer: one matmul instead of three and a concatenation, so every
# rank builds the same q/k/v nodes before the gather that waits for all (a node costs about
# 5 us on the 2-core test machine, a layer's three matmuls and concatenation 20 us; a
# 4 MiB matmul takes 130 us or more at 30 GB/s). Larger models keep views: the copy
# would cost 1/N of their q/k/v weights in memory for a saving they would not see.
JOIN_QKV_MAX_BYTES = 4 << 20


def _joined_bytes(pieces: list[WeightMatrix]) -> int:
    """Bytes of the one matrix a rank's q/k/v row ``pieces`` are copied into, or 0 where
    they stay views (one piece, or more than ``JOIN_QKV_MAX_BYTES``)."""
    nbytes = sum(t.nbytes for m in pieces for t in m.arrays)
    return nbytes if len(pieces) > 1 and nbytes <= JOIN_QKV_MAX_BYTES else 0


def joined_qkv_bytes(layer, size: int) -> int:
    """The most bytes any of ``size`` ranks copies for ``layer``'s q/k/v rows when the
    weights stay loaded (LayerSlice), 0 where none does or the layer cannot be split."""
    try:
        plan = LayerPlan.of(layer, size)
    except (TypeError, ValueError):
        return 0
    return max(_joined_bytes(column_slice(plan.qkv, a, b, join=False))
               for a, b in plan.qkv_ranges)


def _matrix(module: nn.Module) -> WeightMatrix:
    try:
        return WeightMatrix.of(module)
    except TypeError as error:
        raise TypeError(f"a projection is {error}") from None


def _split(name: str, total: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    try:
        return split_ranges(total, parts, align)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


@dataclass(frozen=True)
class LayerPlan:
    """One layer's matrices and each rank's share of them (no weights copied yet)."""

    qkv: list  # WeightMatrix of q_proj, k_proj, v_proj or a fused q|k|v: column-parallel
    qkv_widths: tuple  # output widths of q, k and v
    o: WeightMatrix
    gate: WeightMatrix | None  # None for a mixture of experts: ``mixture``
    up: WeightMatrix | None
    down: WeightMatrix | None
    qkv_ranges: list  # per rank: outputs of [Wq; Wk; Wv]
    o_ranges: list  # per rank: outputs (rows) of Wo
    hidden_ranges: list  # per rank: rows of Wgate and Wup = inputs of Wdown (whole groups),
    # or of every expert's (expert_slices.py)
    mixture: nn.Module | None = None
    activation: str = "silu"  # the gate's before it multiplies up (LayerParts.activation)

    @classmethod
    def of(cls, layer, size: int) -> LayerPlan:
        """TypeError or ValueError, naming the matrix, where ``size`` ranks cannot share it."""
        parts = LayerParts.of(layer)
        qkv = [_matrix(m) for m in parts.qkv]
        o = _matrix(parts.o)
        shares = (_split("q/k/v outputs", sum(m.out_width for m in qkv), size),
                  _split("o_proj outputs", o.out_width, size))
        if not parts.is_dense:
            mixture = parts.feed_forward
            reason = experts_obstacle(mixture)
            if reason is not None:
                raise TypeError(f"{reason} ({describe_feed_forward(mixture)}), which the "
                                "split step does not divide")
            hidden = _split("expert hidden units", expert_width(mixture), size)
            return cls(qkv, parts.qkv_widths, o, None, None, None, *shares, hidden, mixture)
        down = _matrix(parts.down)
        return cls(qkv, parts.qkv_widths, o, *parts.gate_up_matrices(), down, *shares,
                   _split("down_proj inputs", down.in_width, size, down.in_align),
                   activation=parts.activation)


class LayerSlice:
    """One rank's slices of one layer's matrices, completed by collectives: the
    projections of ``CPModel.forward`` (``qkv``, ``add_output``, ``add_mlp``) split
    across ranks."""

    def __init__(self, layer, comm, copy_rows: bool, sandwich: bool = False):
        """``comm``: the collectives (Comm or runtime.graph_comm.GraphCollectives).
        ``sandwich``: the layer norms its attention's and MLP's outputs before each
        residual add (Gemma 3: layer_form.LayerForm.sandwich), after the ranks' sum.
        ``copy_rows``: copy the row slices too (the layer's weights will not stay: q/k/v
        rows joined into one matrix, gate, up), else they are views into the loaded
        matrices (q/k/v as one matmul per matrix touched, unless the rows are few: see
        ``JOIN_QKV_MAX_BYTES``). The column slice of down is a copy either way (a view
        of columns is not a matrix BLAS streams)."""
        plan, rank = LayerPlan.of(layer, comm.size), comm.rank
        self.comm, self.activation = comm, plan.activation
        # (copies: a layer-sharded store swaps the layer's own arrays out later)
        self.out_norms = (copy.copy(layer.post_attention_layernorm),
                          copy.copy(layer.post_feedforward_layernorm)) if sandwich else None
        self.qkv_sizes = [b - a for a, b in plan.qkv_ranges]
        self.q_width, self.k_width = plan.qkv_widths[:2]
        pieces = column_slice(plan.qkv, *plan.qkv_ranges[rank], join=False)
        join_qkv = copy_rows or _joined_bytes(pieces) > 0
        parts = stack_rows(pieces) if join_qkv else pieces
        # A packed-only matrix's memory holds its values again while rows are copied
        # from it (models/packed_load.py)
        with SHADOWS.filled([m.weight for m in plan.qkv] if join_qkv else []):
            self.qkv_parts = [m.evaluated(copy=join_qkv) for m in parts]
        if join_qkv and len(self.qkv_parts) == 1:
            SHADOWS.register_stacked(self.qkv_parts[0].weight, [m.weight for m in pieces])
        self.o_sizes = [b - a for a, b in plan.o_ranges]
        self.o = plan.o.rows(*plan.o_ranges[rank]).evaluated(copy=copy_rows)
        self.own = list(self.qkv_parts) if join_qkv else []
        if copy_rows:
            self.own.append(self.o)
        a, b = plan.hidden_ranges[rank]
        if plan.mixture is not None:  # this rank's hidden units of every expert
            self.mixture = expert_slice(plan.mixture, a, b)
            self.own_experts = expert_bytes(self.mixture)
            return
        self.mixture, self.own_experts = None, 0
        self.gate = plan.gate.rows(a, b).evaluated(copy=copy_rows)
        self.up = plan.up.rows(a, b).evaluated(copy=copy_rows)
        self.down = self._down_columns(plan.down, a, b, keep_bias=rank == 0)
        self.own.append(self.down)
        if copy_rows:
            self.own += [self.gate, self.up]

    @staticmethod
    def _down_columns(down: WeightMatrix, a: int, b: int, keep_bias: bool) -> WeightMatrix:
        """Inputs [a, b) of down in memory of their own: a packed-only matrix's as a
        released name over its packed columns, any other's copied (and registered with
        the packed columns where it has a packed form)."""
        columns = down.columns(a, b, keep_bias)
        name = released_columns(down.weight, a, b)
        if name is not None:
            bias = None if columns.bias is None else mx.contiguous(columns.bias)
            copy = replace(columns, weight=name, bias=bias)
            mx.eval(copy.arrays)
            return copy
        with SHADOWS.filled([down.weight]):
            copy = columns.materialized()
        SHADOWS.register_columns(copy.weight, down.weight, a, b)
        return copy

    def qkv(self, x: mx.array):
        qkv = apply_all(self.qkv_parts, x)  # this rank's outputs of [Wq; Wk; Wv]
        qkv = self.comm.allgather_rows(qkv, axis=-1, counts=self.qkv_sizes)
        q_end, k_end = self.q_width, self.q_width + self.k_width
        return qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]

    def add_output(self, h: mx.array, out: mx.array) -> mx.array:
        o = self.comm.allgather_rows(self.o(out), axis=-1, counts=self.o_sizes)
        if self.out_norms is not None:
            return clip_residual(h, self.out_norms[0](o))
        return h + o

    def add_mlp(self, h: mx.array, x: mx.array) -> mx.array:
        if self.mixture is not None:  # mlx-lm's module: router whole, experts sliced
            return self.comm.allreduce_onto(h, self.mixture(x))
        if self.activation == "gelu_approx":  # mlx-lm's Gemma 3 MLP's, hidden units sliced
            act = nn.gelu_approx(self.gate(x)) * self.up(x)
        else:
            act = swiglu(self.gate(x), self.up(x))
        if self.out_norms is not None:
            summed = self.comm.allreduce(self.down(act), "sum")
            return clip_residual(h, self.out_norms[1](summed))
        return self.comm.allreduce_onto(h, self.down(act))


def head_matrix(model: CPModel) -> WeightMatrix:
    """The LM head's matrix: its own, or the tied embedding's (vocab, D)."""
    head = model.lm_head
    return WeightMatrix.of(head if isinstance(head, nn.Module) else model.embed_tokens)


def is_layer_sharded(model: CPModel) -> bool:
    """Whether each rank holds only its own layers (engine/weights/weights.py's LayerStore)."""
    return getattr(model.layers, "sharded", False)


def slicing_obstacle(model: CPModel, size: int) -> str | None:
    """Why the weights cannot be split over ``size`` ranks, or None when they can.

    A layer-sharded model's layers are not at hand (reading them means broadcasting
    them): only their MLPs' kind is checked here, the rest while the slices are cut."""
    if is_layer_sharded(model):
        for index, layer in enumerate(model.layers.modules):
            parts = LayerParts.of(layer)
            mlp = parts.feed_forward
            reason = None if parts.is_dense else experts_obstacle(mlp)
            if reason is not None:
                experts = getattr(mlp, "num_experts", None) is not None
                mixture = f" ({describe_feed_forward(mlp)})" if experts else ""
                return f"layer {index}: {reason}{mixture}, which the split step does not divide"
        return None  # the vocabulary is already split (vocab_parallel.py)
    for index, layer in enumerate(model.layers):  # quantization may differ per layer
        try:
            LayerPlan.of(layer, size)
        except (TypeError, ValueError) as error:
            return f"layer {index}: {error}"
    try:
        _split("vocabulary", head_matrix(model).out_width, size)
    except (TypeError, ValueError) as error:
        return f"LM head: {error}"
    return None


class LayerShell:
    """What the layer loop reads of a layer besides its projections (norms, RoPE, head
    counts), kept while a layer-sharded run's store swaps the layer's parameters out.

    Shallow copies: each holds the arrays its module held when copied, whatever the store
    later puts into the original."""

    def __init__(self, layer):
        self.input_layernorm = copy.copy(layer.input_layernorm)
        self.post_attention_layernorm = copy.copy(layer.post_attention_layernorm)
        for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):  # Gemma 3
            if name in layer:
                setattr(self, name, copy.copy(layer[name]))
        attn = copy.copy(layer.self_attn)
        for name in ("q_norm", "k_norm"):  # Qwen3
            if name in attn:
                attn[name] = copy.copy(attn[name])
        self.self_attn = attn


def describe_weights(layer, model: CPModel) -> str:
    """'float32', '4-bit quantized' or '4/8-bit quantized': what the slices are cut from
    (``layer``: one layer's modules as they were when cut)."""
    parts = LayerParts.of(layer)
    modules = [*parts.qkv, parts.down, model.embed_tokens, model.lm_head]
    bits = sorted({m.bits for m in modules if hasattr(m, "bits")})
    if bits:
        return "/".join(str(b) for b in bits) + "-bit quantized"
    return str(parts.qkv[0].weight.dtype).replace("mlx.core.", "")


class TensorParallelDecoder:
    """Decode steps with every matmul split across the ranks of ``comm``."""

    def __init__(self, model: CPModel, comm: Comm, collectives=None):
        """``collectives``: Comm's data-plane collectives or runtime.graph_comm's (the
        default: ``comm``'s own)."""
        self.model, self.comm = model, comm
        self.collectives = collectives or comm
        sharded = is_layer_sharded(model)
        # A layer-sharded store broadcasts each layer as this loop reaches it (one forward
        # pass's worth, once); each rank keeps its slices and the layer's small parts.
        self.layers, self.modules = [], []
        for layer, form in zip(model.layers, model.forms):
            if not self.layers:
                cut_from = describe_weights(layer, model)
            self.layers.append(LayerSlice(layer, self.collectives, copy_rows=sharded,
                                          sandwich=form.sandwich))
            self.modules.append(LayerShell(layer) if sharded else layer)
        if isinstance(model.lm_head, VocabParallelHead):  # already split by vocabulary rows
            self.head, self.vocab_sizes = model.lm_head.project, model.lm_head.widths
        else:  # rows of the replicated head: a view
            head = head_matrix(model)
            ranges = split_ranges(head.out_width, comm.size)
            self.vocab_sizes = [b - a for a, b in ranges]
            self.head = head.rows(*ranges[comm.rank]).evaluated(copy=False)
        if comm.rank == 0:
            packed = f"; {SHADOWS.describe()}" if SHADOWS.active else ""
            log.info("decode: tensor-parallel slices of the %s weights over %d ranks ready%s%s",
                     cut_from, comm.size,
                     " (from the layer-sharded store)" if sharded else "", packed)

    @property
    def nbytes(self) -> int:
        """Bytes of the weight slices this rank holds for the split step beyond the
        loaded weights (views into those are not counted twice)."""
        return SHADOWS.held_bytes(t for piece in self.layers for m in piece.own
                                  for t in m.arrays) + \
            sum(piece.own_experts for piece in self.layers)

    def forward(self, token: int, position: np.ndarray, cache, attend, store: bool,
                on_layer=None, tracer=None) -> mx.array:
        """Hidden state (1, D) of ``token`` at ``position`` (every rank, replicated)."""
        return self.model.forward(np.array([token]), position, cache, attend, store,
                                  on_layer, tracer, projections=self.layers,
                                  modules=self.modules)

    def logits(self, hidden: mx.array) -> mx.array | None:
        """Full-vocabulary logits (1, V) on rank 0 from each rank's vocabulary slice (on
        every rank with graph collectives: each must evaluate them)."""
        local = vocabulary_projection(self.head, self.model.norm(hidden)).astype(mx.float32)
        gathered = self.collectives.gather_rows(local[0], self.vocab_sizes, root=0)
        return gathered[None] if gathered is not None else None
