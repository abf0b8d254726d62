"""Tensor parallelism inside context parallelism (``--tp T``): each rank of a TP group
holds 1/T of every matrix for good and computes 1/T of every product.

Megatron-LM's layout, over the rows a rank's CP group owns (every rank of a TP group
holds the same rows, runtime/grid.py):

    q, k, v:     rows for this rank's heads (column-parallel): no collective; attention
                 runs on those heads only, across the CP group as without TP
    o:           the columns of those heads (row-parallel)        -> Allreduce
    gate, up:    rows for a share of the hidden units             (column-parallel)
    down:        the columns of that share (row-parallel)         -> Allreduce
                 (a mixture: that share of every expert, the router whole)
    embedding:   rows for a share of the vocabulary: a token's row from the rank
                 holding it, zeros elsewhere                      -> Allreduce
    LM head:     the same vocabulary rows                         -> Allgather of logits

Heads: with T <= KV heads, the KV heads are dealt in contiguous runs (sizes differing by
at most one), each with the query heads that read it (GQA), so no KV head is held twice.
With T > KV heads, T must be a multiple of the KV heads and each KV head's query heads
must divide evenly among the T / KV ranks that share it: each such rank holds a copy of
that one KV head (its cache too) and its share of the query heads. Anything else is
refused before the model is cut, naming the counts.

Exactness: each sum of partial products is the full product's sum in another order (a
float32 Allreduce), an embedding row is copied whole, and every logit is the same dot
product as the replicated head's.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gemma3_text import clip_residual

from ...models.shape import ModelShape
from .expert_slices import expert_slice, expert_width, experts_obstacle
from ..layer_parts import LayerParts, feed_forward, head_counts
from ..model import CPModel, ReplicatedLayer, vocabulary_projection
from .weight_slices import WeightMatrix, linear, split_ranges


@dataclass(frozen=True)
class HeadShare:
    """One rank's query heads [q_start, q_stop) and KV heads [kv_start, kv_stop)."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int


def head_shares(heads: int, kv_heads: int, size: int) -> list[HeadShare]:
    """Each of ``size`` ranks' heads (the rule in the module's docstring); ValueError
    naming the counts where no share keeps a KV head with its query heads."""
    group = heads // kv_heads
    if size <= kv_heads:
        return [HeadShare(a * group, b * group, a, b) for a, b in split_ranges(kv_heads, size)]
    sharing = size // kv_heads
    if size % kv_heads or group % sharing:
        raise ValueError(f"{size} tensor-parallel ranks cannot share {heads} query heads over "
                         f"{kv_heads} KV heads: T must be at most the KV heads, or a multiple "
                         f"of them that divides each KV head's {group} query heads")
    step = group // sharing
    return [HeadShare(r * step, (r + 1) * step, r // sharing, r // sharing + 1)
            for r in range(size)]


def _module_of(module: nn.Module, matrix: WeightMatrix) -> nn.Module:
    """A shallow copy of ``module`` (Linear, QuantizedLinear, Embedding) holding
    ``matrix``'s arrays, copied into their own memory (the whole matrix can go)."""
    own = matrix.materialized()
    piece = copy.copy(module)
    piece["weight"] = own.weight
    for name, array in (("scales", own.scales), ("biases", own.biases), ("bias", own.bias)):
        if array is not None:
            piece[name] = array
        elif name in piece:
            del piece[name]
    return piece


def _joined_rows(matrix: WeightMatrix, ranges: list[tuple[int, int]]) -> WeightMatrix:
    """The rows of every range, in order, as one matrix (a fused q|k|v's or gate|up's)."""
    pieces = [matrix.rows(a, b) for a, b in ranges]
    join = lambda *ts: None if ts[0] is None else mx.concatenate(ts)  # noqa: E731
    return replace(matrix, weight=join(*(p.weight for p in pieces)),
                   scales=join(*(p.scales for p in pieces)),
                   biases=join(*(p.biases for p in pieces)),
                   bias=join(*(p.bias for p in pieces)))


def _cut_attention(attn: nn.Module, parts: LayerParts, share: HeadShare, first: bool):
    """This rank's heads of q, k, v and o, and the module's head counts set to them."""
    heads, kv_heads = head_counts(attn)
    head_dim = parts.qkv_widths[0] // heads
    q = (share.q_start * head_dim, share.q_stop * head_dim)
    kv = (share.kv_start * head_dim, share.kv_stop * head_dim)
    if len(parts.qkv) == 3:
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            attn[name] = _module_of(attn[name], WeightMatrix.of(attn[name]).rows(*rows))
    else:  # Phi-3's q|k|v: this rank's rows of each, one matrix again
        q_width, k_width = heads * head_dim, kv_heads * head_dim
        ranges = [q, (q_width + kv[0], q_width + kv[1]),
                  (q_width + k_width + kv[0], q_width + k_width + kv[1])]
        attn["qkv_proj"] = _module_of(attn.qkv_proj,
                                      _joined_rows(WeightMatrix.of(attn.qkv_proj), ranges))
    attn["o_proj"] = _module_of(attn.o_proj,
                                WeightMatrix.of(attn.o_proj).columns(*q, keep_bias=first))
    local = (share.q_stop - share.q_start, share.kv_stop - share.kv_start)
    names = ("n_heads", "n_kv_heads") if hasattr(attn, "n_heads") else \
        ("num_heads", "num_key_value_heads")
    for name, count in zip(names, local):
        setattr(attn, name, count)


def cut_feed_forward(layer, parts: LayerParts, rank: int, size: int):
    """This rank's share of the MLP's hidden units (of every expert's, for a mixture)."""
    mlp = feed_forward(layer)
    name = next(n for n in ("mlp", "block_sparse_moe") if n in layer)
    if hasattr(mlp, "switch_mlp"):  # a mixture: the router whole, every expert cut
        why = experts_obstacle(mlp)
        if why:
            raise ValueError(why)
        a, b = split_ranges(expert_width(mlp), size)[rank]
        layer[name] = expert_slice(mlp, a, b)
        return
    down = WeightMatrix.of(mlp.down_proj)
    a, b = split_ranges(down.in_width, size, down.in_align)[rank]
    piece = copy.copy(mlp)
    if parts.gate_up is not None and len(parts.gate_up) == 1:  # Phi-3's gate|up
        fused = WeightMatrix.of(mlp.gate_up_proj)
        half = fused.out_width // 2
        piece["gate_up_proj"] = _module_of(mlp.gate_up_proj,
                                           _joined_rows(fused, [(a, b), (half + a, half + b)]))
    else:  # Llama's, Qwen's, Gemma's gate and up
        for proj in ("gate_proj", "up_proj"):
            piece[proj] = _module_of(mlp[proj], WeightMatrix.of(mlp[proj]).rows(a, b))
    piece["down_proj"] = _module_of(mlp.down_proj, down.columns(a, b, keep_bias=rank == 0))
    layer[name] = piece


def cut_layer(layer, share: HeadShare, rank: int, size: int):
    """Replace ``layer``'s projections (mlx-lm's modules) by this rank's slices, in place:
    the whole matrices are no longer referenced from the model."""
    parts = LayerParts.of(layer)
    _cut_attention(layer.self_attn, parts, share, first=rank == 0)
    cut_feed_forward(layer, parts, rank, size)


class TensorGroup:
    """The TP group's collectives as the layers use them now: mpi4py's (``comm``: prefill,
    each sum evaluated where it stands), or, inside ``in_graph``, MLX's graph collectives
    over the same ranks (``graph``, where the decode plan opened them: a decode step's
    sums are nodes of its one graph)."""

    def __init__(self, comm):
        self.comm, self.graph = comm, None
        self.active = comm

    @contextmanager
    def in_graph(self):
        if self.graph is not None:
            self.active = self.graph
        try:
            yield
        finally:
            self.active = self.comm

    def summed(self, x: mx.array) -> mx.array:
        """The sum of every TP rank's ``x`` (bfloat16 summed as float32: MPI has no
        bfloat16 sum, and its bit patterns travel as integers)."""
        if x.dtype == mx.bfloat16:
            return self.active.allreduce(x.astype(mx.float32), "sum").astype(x.dtype)
        return self.active.allreduce(x, "sum")

    def gathered(self, x: mx.array, counts: list[int]) -> mx.array:
        """Every TP rank's ``x`` (n, counts[r]) side by side along the last axis."""
        return self.active.allgather_rows(x, axis=-1, counts=counts)


class GroupLayer(ReplicatedLayer):
    """A layer's projections over this rank's slices: q/k/v of its heads, o and the MLP
    completed by an Allreduce in the TP group (``group``), norms after the sum where the
    family norms a sublayer's output (Gemma 3's sandwich)."""

    def __init__(self, layer, sandwich: bool, group: TensorGroup):
        super().__init__(layer)
        self.layer, self.sandwich, self.group = layer, sandwich, group

    def add_output(self, h: mx.array, out: mx.array) -> mx.array:
        o = self.group.summed(linear(self.parts.o, out))
        if self.sandwich:
            return clip_residual(h, self.layer.post_attention_layernorm(o))
        return h + o

    def add_mlp(self, h: mx.array, x: mx.array) -> mx.array:
        if x.size == 0:  # the whole group holds no rows: nothing to add, nobody to wait
            return h
        y = self.group.summed(self.mlp(x))
        if self.sandwich:
            return clip_residual(h, self.layer.post_feedforward_layernorm(y))
        return h + y


class GroupEmbedding:
    """``embed(ids)`` from this rank's vocabulary rows [start, stop): its rows where it
    holds the token, zeros elsewhere, summed over the TP group."""

    def __init__(self, piece: nn.Module, rows: tuple[int, int], group: TensorGroup):
        self.piece, self.group = piece, group
        self.start, self.width = rows[0], rows[1] - rows[0]

    def __call__(self, ids: mx.array) -> mx.array:
        local = ids - self.start
        inside = (local >= 0) & (local < self.width)
        rows = self.piece(mx.where(inside, local, 0))
        return self.group.summed(mx.where(inside[..., None], rows, mx.zeros_like(rows)))


class GroupHead:
    """``head(x (n, D)) -> (n, V)``: this rank's vocabulary rows' logits, gathered from
    the TP group along the vocabulary (every rank of the group gets them all)."""

    def __init__(self, project, widths: list[int], group: TensorGroup):
        self.project, self.widths, self.group = project, widths, group

    def __call__(self, x: mx.array) -> mx.array:
        return self.group.gathered(vocabulary_projection(self.project, x), self.widths)


def tensor_share(shape: ModelShape, size: int) -> ModelShape:
    """The busiest TP rank's share of a model's shape (the memory forecast's): its query
    and KV heads, its hidden units; the vocabulary stays whole (the logits are gathered)."""
    if size == 1:
        return shape
    share = max(head_shares(shape.num_heads, shape.num_kv_heads, size),
                key=lambda s: s.kv_stop - s.kv_start)
    return replace(shape, num_heads=share.q_stop - share.q_start,
                   num_kv_heads=share.kv_stop - share.kv_start,
                   intermediate=-(-shape.intermediate // size))


def tensor_parallel(model: CPModel, loaded, comm, rows: tuple[int, int]) -> CPModel:
    """``model`` (a CPModel of the cut mlx-lm model) with the TP group's collectives:
    each layer a ``GroupLayer``, the embedding and head vocabulary-parallel."""
    inner, group = loaded.model.model, TensorGroup(comm)
    model.replicated = [GroupLayer(layer, form.sandwich, group)
                        for layer, form in zip(model.layers, model.forms)]
    model.embed_tokens = GroupEmbedding(inner.embed_tokens, rows, group)
    head = getattr(loaded.model, "lm_head", None)
    project = head if head is not None else inner.embed_tokens.as_linear
    widths = [b - a for a, b in comm.allgather_object(rows)]
    model.lm_head = GroupHead(project, widths, group)
    model.tensor_group = group
    return model
