"""The forward pass over mlx-lm's own modules, with context-parallel attention.

mlx-lm's layer ``__call__`` assumes the whole sequence is local. Under CP a rank holds
scattered global positions and attention needs the other ranks, so this module re-threads
the same submodules (norms, projections, RoPE, MLP, embedding, head) through one loop in
which attention is a function handed in; the rest runs unchanged on the local rows.

The loop is written once. Who computes the projections and the MLP is a per-layer
strategy: ``ReplicatedLayer`` (mlx-lm's modules on this rank's rows) or tp_decode's
``LayerSlice`` (this rank's slices of the weights plus the collectives that complete
them), so an architecture detail added here holds for both. What differs between layers
beyond their modules (a sliding window, where the norms sit) is each layer's
``LayerForm`` (layer_form.py), read once.
"""

from __future__ import annotations

import copy
import dataclasses
from functools import partial
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten
from mlx_lm.models.gemma3_text import clip_residual

from ..attention.exp import swiglu
from ..models.quantized_shadows import embedding_rows
from ..models.shape import ModelShape
from .activation import gelu_gate
from .cache.cache import ShardedKVCache
from .layer_form import embedding_scale, layer_forms
from .layer_parts import LayerParts, head_counts, in_row_tiles, key_projection_name
from ..runtime.device import Compute
from ..runtime.trace import span
from .decode.one_token import RopeMatrices, lean_graph, rms_norm
from .weights.weight_slices import linear, times_transposed

# attend(q (NH, n, d), keys (NKV, S, d), values, q_pos (n,), k_pos (S,), scale, window)
#   -> (NH, n, d)
AttendFn = Callable[..., mx.array]


def contiguous_runs(positions: np.ndarray) -> list[tuple[int, int, int]]:
    """Split positions into runs of consecutive values: (row_start, row_stop, first_position)."""
    if positions.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [positions.size]])
    return [(int(a), int(b), int(positions[a])) for a, b in zip(starts, stops)]


def rope_at(rope: nn.Module, x: mx.array, runs) -> mx.array:
    """Apply the model's own RoPE module at arbitrary global positions.

    mlx-lm's RoPE variants (plain, Llama-3 scaled, YaRN, ...) take one integer offset;
    head-tail shards are at most a few contiguous runs, so each run gets its offset.
    """
    if len(runs) == 1:
        return rope(x, offset=runs[0][2])
    return mx.concatenate([rope(x[..., a:b, :], offset=p) for a, b, p in runs], axis=-2)


def heads_with_rope(attn, q: mx.array, k: mx.array, v: mx.array, runs, rope_matrix=None,
                    row_matrices=None):
    """(1, n, H*d) projections -> (H, n, d) heads, with Qwen3's q/k norms and RoPE at the
    global positions ``runs`` (see ``contiguous_runs``). ``rope_matrix(head_dim)``, for
    one token in the row form, (1, H*d) projections: the (d, d) matrix of the module's
    RoPE at its position, or None (one_token.py). ``row_matrices(head_dim)``: for rows at
    scattered positions (a batched decode step's), each row's (d, d) RoPE matrix as
    (n, d, d), or None: one product for all rows where the module would run once a run."""
    heads, kv_heads = head_counts(attn)
    head_dim = q.shape[-1] // heads  # explicit: a rank may hold 0 rows
    if rope_matrix is not None:
        return _one_token_heads(attn, q, k, v, runs, rope_matrix(head_dim), head_dim)
    n = q.shape[1]
    q = q.reshape(1, n, heads, head_dim)
    k, v = (t.reshape(1, n, kv_heads, head_dim) for t in (k, v))
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
    rotations = None if row_matrices is None else row_matrices(head_dim)
    if rotations is not None and q.dtype == k.dtype == mx.float32:
        q, k = ((x[..., None, :] @ rotations).squeeze(-2) for x in (q, k))
    elif runs:
        q, k = rope_at(attn.rope, q, runs), rope_at(attn.rope, k, runs)
    # squeeze, not [0]: indexing by an integer is a Gather in MLX's graph (a copy, and a
    # kernel launch a layer on a GPU), removing an axis of one is a view
    return q.squeeze(0), k.squeeze(0), v.squeeze(0)


def _one_token_heads(attn, q, k, v, runs, rotation, head_dim: int):
    """``heads_with_rope`` of one token: a (1, H*d) row is (H, 1, d) in memory already,
    so reshapes replace the transposes, and RoPE is a matmul where ``rotation`` is given
    and the heads are float32 (fewer graph nodes: one_token.py), on (H, d) matrices
    (MLX folds a (H, 1, d) operand with two more nodes)."""
    heads, kv_heads = head_counts(attn)
    q, k = q.reshape(heads, head_dim), k.reshape(kv_heads, head_dim)
    v = v.reshape(kv_heads, 1, head_dim)
    if hasattr(attn, "q_norm"):  # over each head's d: the same on this layout
        q, k = attn.q_norm(q), attn.k_norm(k)
    if rotation is not None and q.dtype == k.dtype == mx.float32:
        q, k = q @ rotation, k @ rotation
    else:
        q, k = (rope_at(attn.rope, x[None, :, None], runs)[0, :, 0] for x in (q, k))
    return q[:, None], k[:, None], v


def heads_to_rows(out: mx.array, row_form: bool = False) -> mx.array:
    """Attention output (H, n, d) as (1, n, H*d) rows for the output projection, or as
    (1, H*d) for one token in the row form (one_token.py). For one token (H, 1, d) is
    either in memory already: a reshape, no transpose node."""
    heads, n, d = out.shape
    if n == 1:
        return out.reshape(1, heads * d) if row_form else out.reshape(1, 1, heads * d)
    return out.transpose(1, 0, 2).reshape(1, n, heads * d)


def kv_dtype_for(model: nn.Module, first_layer: nn.Module | None = None,
                 cpu_kv_dtype: str = "float32", compute: Compute | None = None) -> mx.Dtype:
    """The KV cache's dtype: on the CPU path ``cpu_kv_dtype`` (``--kv-dtype``: float32,
    or float16 / bfloat16 stored in half the bytes and read back into float32, where
    every product and the tiled attention compute), else the dtype the model computes
    its keys in (bfloat16 / float16 for half-precision and quantized models), found by
    projecting one token through the first layer (``first_layer``: a stand-in for it).
    ``compute``: the run's path (None: the default's)."""
    if not (compute or Compute.resolve()).gpu:
        return getattr(mx, cpu_kv_dtype)
    inner = model.model
    layer = first_layer or inner.layers[0]
    hidden = inner.embed_tokens(mx.array([[0]], mx.int32))
    keys = layer.self_attn[key_projection_name(layer.self_attn)]
    return keys(layer.input_layernorm(hidden)).dtype


def kv_model_shape(loaded, cpu_kv_dtype: str = "float32",
                   compute: Compute | None = None) -> ModelShape:
    """A LoadedModel's shape with the KV dtype's element size and the activations' (the
    memory forecast's; they differ where a half-precision cache serves float32 work)."""
    compute = compute or Compute.resolve()
    dtype = kv_dtype_for(loaded.model, first_layer_stand_in(loaded), cpu_kv_dtype, compute)
    work = dtype if compute.gpu else mx.float32
    return dataclasses.replace(loaded.shape, elem_bytes=work.size, kv_elem_bytes=dtype.size)


def first_layer_stand_in(loaded) -> nn.Module | None:
    """For a layer-sharded load (models/partial_load.py), whose layers hold empty
    placeholders: the first layer's norm and k projection with lazy zeros of their
    computed form (never evaluated), on shallow copies. None otherwise."""
    share = getattr(loaded, "share", None)
    if share is None:
        return None
    layer = loaded.model.model.layers[0]
    keys = key_projection_name(layer.self_attn)
    wanted = ("input_layernorm.", f"self_attn.{keys}.")
    zeros = {n: mx.zeros(shape, dtype) for n, (shape, dtype) in share.layer_specs[0].items()
             if n.startswith(wanted)}
    stand_in, attn = copy.copy(layer), copy.copy(layer.self_attn)
    stand_in["input_layernorm"] = copy.copy(layer.input_layernorm)
    stand_in["self_attn"], attn[keys] = attn, copy.copy(attn[keys])
    stand_in.update(tree_unflatten(list(share.form.convert(zeros, "model.layers.0.").items())))
    return stand_in


class ReplicatedLayer:
    """Every projection of one layer computed in full, on this rank's rows (the family's
    names read once: layer_parts.py)."""

    def __init__(self, layer):
        self.parts = LayerParts.of(layer)

    def qkv(self, x: mx.array):
        """(1, n, D) -> q (1, n, NH*d), k, v (1, n, NKV*d)."""
        parts = self.parts
        if len(parts.qkv) == 3:
            return tuple(linear(m, x) for m in parts.qkv)
        q_width, k_width, _ = parts.qkv_widths
        return tuple(mx.split(linear(parts.qkv[0], x), [q_width, q_width + k_width], axis=-1))

    def add_output(self, h: mx.array, out: mx.array) -> mx.array:
        """The residual ``h`` plus the attention output (1, n, NH*d) projected to (1, n, D)."""
        return h + linear(self.parts.o, out)

    def add_mlp(self, h: mx.array, x: mx.array) -> mx.array:
        """The residual ``h`` plus the MLP of ``x`` (its normed copy)."""
        # a mixture on no rows would gather from no rows: nothing to add
        return h if x.size == 0 and not self.parts.is_swiglu else h + self.mlp(x)

    def mlp(self, x: mx.array) -> mx.array:
        """The feed-forward output of ``x`` (no residual); a long prefill's in row tiles."""
        return in_row_tiles(self._mlp, x)

    def _mlp(self, x: mx.array) -> mx.array:
        parts = self.parts
        if parts.gate_up is None:  # a mixture of experts: mlx-lm's module
            return parts.feed_forward(x)
        if len(parts.gate_up) == 2:
            gate, up = (linear(m, x) for m in parts.gate_up)
        else:
            gate, up = mx.split(linear(parts.gate_up[0], x), 2, axis=-1)
        gated = gelu_gate if parts.activation == "gelu_approx" else swiglu
        return linear(parts.down, gated(gate, up))


class SandwichLayer(ReplicatedLayer):
    """Gemma 3's block: each sublayer's output normed before the residual add (mlx-lm's
    ``clip_residual``: a float16 sum clipped to its range, any other dtype plainly added)."""

    def __init__(self, layer):
        super().__init__(layer)
        self.layer = layer

    def add_output(self, h: mx.array, out: mx.array) -> mx.array:
        attended = self.layer.post_attention_layernorm(linear(self.parts.o, out))
        return clip_residual(h, attended)

    def add_mlp(self, h: mx.array, x: mx.array) -> mx.array:
        return clip_residual(h, self.layer.post_feedforward_layernorm(self.mlp(x)))


@dataclasses.dataclass(frozen=True)
class PassRows:
    """What every layer of one forward pass reads: this rank's rows, their positions and
    runs, the cache and attention of the pass, and the norm and RoPE forms chosen for
    them (CPModel._norm_and_rope)."""

    runs: list
    positions: np.ndarray
    cache: object
    attend: AttendFn
    store: bool
    norm: Callable
    rope_matrix: Callable | None
    row_matrices: Callable | None

    @property
    def row_form(self) -> bool:
        """One token on the CPU path: (1, D) rows (one_token.py)."""
        return self.rope_matrix is not None

    def finish(self, h: mx.array) -> mx.array:
        """The pass's hidden states as (n, D)."""
        return h if self.row_form else h.squeeze(0)


class CPModel:
    """An mlx-lm causal LM evaluated one rank's positions at a time."""

    def __init__(self, model: nn.Module, first_layer: nn.Module | None = None,
                 cpu_kv_dtype: str = "float32", compute: Compute | None = None):
        """``first_layer``: a stand-in for the first layer where the model's hold
        placeholders (``first_layer_stand_in``), for the KV dtype; ``cpu_kv_dtype``: the
        cache's on the CPU path (see kv_dtype_for); ``compute``: the run's path and
        attention kernel (runtime/device.py; None: the default's), which everything
        computing on this model follows."""
        self.compute = compute or Compute.resolve()
        inner = model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.forms = layer_forms(inner)
        self.replicated = [(SandwichLayer if form.sandwich else ReplicatedLayer)(layer)
                           for layer, form in zip(self.layers, self.forms)]
        self.embed_scale = embedding_scale(inner)
        self.norm = inner.norm
        head = getattr(model, "lm_head", None)
        self.lm_head = head if head is not None else inner.embed_tokens.as_linear
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads = head_counts(attn)
        self.num_layers = len(self.layers)
        self.rope_matrices = RopeMatrices()
        # The KV cache's dtype (see kv_dtype_for); ring messages and decode partials
        # carry the dtype attention computes in (LayerKV.shard reads a half-precision
        # cache into float32 on the CPU path), whose size is elem_bytes.
        self.kv_dtype = kv_dtype_for(model, first_layer, cpu_kv_dtype, self.compute)
        self.elem_bytes = (self.kv_dtype if self.compute.gpu else mx.float32).size
        # The TP group's collectives (tensor_groups.TensorGroup, --tp) and the FFN ranks'
        # end of every MLP (afd_attention.FeedForwardClient, --afd's attention ranks).
        self.tensor_group = self.ffn_client = None

    def forward(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        cache: ShardedKVCache,
        attend: AttendFn,
        store: bool = True,
        on_layer=None,
        tracer=None,
        projections=None,
        modules=None,
        trim_windows: bool = False,
    ) -> mx.array:
        """Hidden states (n, D) of ``token_ids`` at global ``positions``, before the final norm.

        Args:
            token_ids, positions: this rank's rows (n may be 0: the rank still joins
                every collective inside ``attend``); the ids may be an mx.array.
            cache: this rank's shard; the new K/V are appended to it when ``store``
                (decode computes a token on every rank but stores it on one).
            attend: the CP attention for this call (see ``attention/``).
            on_layer: optional callback(layer_index) for the watchdog and fault injection.
            tracer: a trace.Tracer to time each layer (evaluated before its span closes).
            projections: per layer, who computes q/k/v, o and the MLP (``qkv``,
                ``add_output``, ``add_mlp``: the residual plus o or the MLP); default
                ``self.replicated``, tensor-parallel decode passes slices.
            modules: per layer, the module whose norms, RoPE and head counts the loop
                reads (default ``self.layers``; a layer-sharded split step passes copies
                of the small parts, tp_decode.LayerShell, so no layer is fetched).
            trim_windows: (a prefill's, every rank's) each sliding-window layer then drops
                the keys no later query sees (cache.py)."""
        modules = modules or self.layers
        rows, h = self.begin_pass(token_ids, positions, cache, attend, store, modules)
        layers = zip(modules, projections or self.replicated, cache.layers, self.forms)
        for index, (layer, project, layer_kv, form) in enumerate(layers):
            if on_layer is not None:
                on_layer(index)
            with span(tracer, f"layer {index}", "layer"):
                h, x = self.attention_half(rows, index, layer, project, layer_kv, form, h)
                h = project.add_mlp(h, x)
                if tracer is not None or (trim_windows and form.window is not None):
                    mx.eval(h)  # (a trimmed layer's old keys are free once evaluated)
                    if trim_windows and form.window is not None:
                        cache.drop_behind_window(index, form.window)
        return rows.finish(h)

    def begin_pass(self, token_ids, positions: np.ndarray, cache: ShardedKVCache,
                   attend: AttendFn, store: bool = True, modules=None):
        """(what every layer of one pass reads, the embedded rows): ``forward``'s start,
        which an interleaved pair of passes (afd_attention.ping_pong) shares."""
        runs = contiguous_runs(positions)
        if isinstance(token_ids, mx.array):
            ids = token_ids.astype(mx.int32)
        else:
            ids = mx.array(token_ids, mx.int32)
        norm, rope_matrix, row_matrices = self._norm_and_rope(modules or self.layers,
                                                              positions, runs)
        rows = PassRows(runs, positions, cache, attend, store, norm, rope_matrix,
                        row_matrices)
        # (1, D) or (1, n, D); a packed-only embedding's rows come from its packed form
        h = embedding_rows(self.embed_tokens, ids if rows.row_form else ids[None])
        if self.embed_scale is not None:
            h = h * self.embed_scale.astype(h.dtype)
        return rows, h

    @staticmethod
    def attention_half(rows: "PassRows", index: int, layer, project, layer_kv, form,
                       h: mx.array) -> tuple[mx.array, mx.array]:
        """Layer ``index`` up to its MLP: (the residual with attention added, the MLP's
        normed input); ``project.add_mlp(h, x)`` completes the layer."""
        attn, norm = layer.self_attn, rows.norm
        ropes = [None if f is None else partial(f, index)
                 for f in (rows.rope_matrix, rows.row_matrices)]
        q, k, v = heads_with_rope(
            attn, *project.qkv(norm(layer.input_layernorm, h)), rows.runs, *ropes)
        keys, values = layer_kv.shard(k, v, rows.store)
        held = rows.cache.positions  # (None in a batched step: its attention knows them)
        held = held[layer_kv.dropped:] if layer_kv.dropped else held
        out = rows.attend(q, keys, values, rows.positions, held, attn.scale, form.window)
        # float32 partials must not widen the residual
        h = project.add_output(h, heads_to_rows(out.astype(q.dtype), rows.row_form))
        return h, norm(getattr(layer, form.mlp_norm), h)

    def _norm_and_rope(self, modules, positions: np.ndarray, runs):
        """``norm(module, x)``, ``rope_matrix(layer_index, head_dim)`` and
        ``row_matrices(layer_index, head_dim)`` (each None where not taken) for a pass
        over this rank's rows at ``positions``: one token on the CPU path takes
        one_token.py's forms (the row form, fewer graph nodes, the same arithmetic); rows
        at scattered positions on the CPU path (more runs than a head-tail shard's two: a
        batched decode step's) take RoPE as one product of per-row matrices, not one
        module call per run; anything else the modules."""
        # Indexed, not iterated: a layer-sharded store fetches the layers it iterates.
        ropes = lambda: [modules[i].self_attn.rope for i in range(len(modules))]  # noqa: E731
        if lean_graph(positions.size, self.compute) and len(runs) == 1:
            return rms_norm, self.rope_matrices.at(ropes(), runs[0][2]), None
        plain = lambda module, x: module(x)  # noqa: E731
        if len(runs) <= 2 or self.compute.gpu:
            return plain, None, None
        return plain, None, self.rope_matrices.rows(ropes(), positions)

    def logits(self, hidden: mx.array) -> mx.array:
        """Vocabulary logits (n, V) in float32 for hidden states (n, D)."""
        if hidden.shape[0] == 0 and not getattr(self.lm_head, "collective", False):
            # A rank with no rows computes nothing (MLX's CPU quantized matmul dies of
            # SIGFPE on 0 rows); a collective head (vocab_parallel) must still be joined.
            return mx.zeros((0, 0), mx.float32)
        return self._head(self.norm(hidden)).astype(mx.float32)

    def _head(self, x: mx.array) -> mx.array:
        return vocabulary_projection(self.lm_head, x)


def vocabulary_projection(head, x: mx.array) -> mx.array:
    """``head(x)``; a plain head or a tied plain embedding through times_transposed."""
    tied = getattr(head, "__self__", None)  # embed_tokens.as_linear
    if type(tied) is nn.Embedding:
        return times_transposed(x, tied["weight"])
    return linear(head, x)
