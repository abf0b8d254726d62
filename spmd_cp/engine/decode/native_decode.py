"""Decode steps outside MLX's graph on the CPU path: a layer in four C calls
(kernels/decode_step.c).

Through MLX a decode step is a graph of about 1,500 nodes (SmolLM2-135M), each built on
the Python thread and run on MLX's compute thread, with its buffers malloc'ed and freed
across the two: with two ranks on two cores each rank's Python thread shares a core with
the step's products, and that overhead does not split with the work. Here a rank's part
of a layer is

    qkv:    residual, RMSNorm, this rank's q/k/v rows  -> Allgatherv (split step)
    attend: q/k norms, RoPE, k/v stored, attention over this rank's cache (a sliding
            window's layer from the first key its window reaches)
                                                        -> Allgather of the partials, merge
    output: this rank's rows of W_o                     -> Allgatherv (split step)
    mlp:    residual, RMSNorm, gate/up rows, SwiGLU or GELU's tanh form, down columns
                                                        -> Allreduce-sum (split step)
    head:   final RMSNorm, this rank's rows of the vocabulary  -> Gatherv to rank 0

on buffers allocated once, with the collectives between them as persistent MPI requests
(mpi4py's, over the job's own MPI). The products are the ``cblas_sgemm`` calls MLX makes,
so gemv_forward.c's matrix-vector forward, quantized shadows and attention kernels read
the weights and the cache as in MLX's step; RMSNorm, the softmax, the activations and the
merge are the same float32 arithmetic in another order, RoPE the same matrices
(one_token.py). Gemma 3's layers norm the attention's and the MLP's outputs before each
residual add (in the split step the MLP's after the ranks' sum) and scale the embedding.
Results equal mlx-lm's forward to float32 rounding (tests/test_native_decode.py,
tests/test_gemma3.py).

Where it runs: the CPU path, a float32, float16 or bfloat16 KV cache (a half-precision
one read in float32, kernels/kv_half.h), float32 weights (a quantized model's are
dequantized there, its shadows kept), every layer a Llama/Qwen/Phi-3/Gemma 3 block (a
fused q|k|v or gate|up read as views of its rows) with RMSNorms, a RoPE with a matrix
form, a dense MLP (not a mixture of experts) and at most 64 query heads per KV head,
the weights not layer-sharded, a C compiler, and every rank able to; not with
``--decode-comm mlx`` or ``--decode-step graph``. Elsewhere decode keeps MLX's step
(engine/model.py, tp_decode.py). The KV cache stays the engine's (cache.LayerKV): a
stored token is written into its evaluated buffer in place.
"""

from __future__ import annotations

import atexit
import ctypes
import functools

import mlx.core as mx
import numpy as np

from ...attention.block import window_start
from ...blas.libraries import rank_threads
from ...kernels import decode_step
from ...kernels.decode_step import KV_KINDS, MAX_PIECES, Layer, Matrix
from ...models.quantized_shadows import SHADOWS
from ...runtime.comm import offsets
from ...runtime.trace import span
from ..layer_parts import LayerParts, head_counts
from ..model import CPModel
from .native_views import Held, activation_code, cache_view, float32_view, norm_weight
from .tp_decode import head_matrix
from ..weights.weight_slices import WeightMatrix, split_ranges

# Decode positions whose RoPE matrices are built at once (64 x 16 KB for d = 64).
ROPE_BLOCK = 64


class _Blocking:
    """A collective run by ``Start`` (``Wait`` has nothing left to do): the stand-in for
    a persistent request where the MPI library has no persistent collectives (they came
    with MPI 4.0; Open MPI 4, for one, lacks them)."""

    def __init__(self, call):
        self.Start = call

    def Wait(self):
        pass

    def Free(self):
        pass


def _collective(mpi, name: str, persistent: bool, *args, **kwargs):
    """mpi4py's persistent ``<name>_init`` request over ``mpi`` (collective: every rank
    calls it), or, where ``persistent`` is off or the library lacks it (mpi4py raises
    NotImplementedError), the blocking ``name`` behind the same Start/Wait."""
    if persistent:
        try:
            return getattr(mpi, name + "_init")(*args, **kwargs)
        except NotImplementedError:
            pass
    call = getattr(mpi, name)
    return _Blocking(lambda: call(*args, **kwargs))


class _Addresses:
    """The addresses of a decoder's buffers, read once (``ndarray.ctypes`` builds an
    object each time it is read)."""

    def __init__(self, decoder):
        for name in ("h", "normed", "qkv_local", "qkv", "partial", "partials", "attention",
                     "o_part", "o_sum", "mlp_part", "mlp_sum", "mlp_scratch", "logits",
                     "norm"):
            setattr(self, name, getattr(decoder, name).ctypes.data)


def _divided_head(model: CPModel, comm) -> tuple[WeightMatrix, list[int] | None]:
    """The replicated step's LM head: on N ranks each rank's rows of the vocabulary (a
    view: a packed head's kernel reads those rows' blocks only) and every rank's count,
    gathered to rank 0 after the step; on one rank the whole head and None. Each logit
    is the same dot product as in the whole product. Gemma 3's 262,144 x 640 head costs
    more than its 18 layers' matrices together."""
    head = head_matrix(model)
    if comm.size == 1:
        return head, None
    ranges = split_ranges(head.out_width, comm.size)
    return (head.rows(*ranges[comm.rank]).evaluated(copy=False),
            [b - a for a, b in ranges])


class NativeDecoder:
    """Decode steps of ``model`` through decode_step.c, over ``comm``: each rank
    computes its slices of the weights' work (``split``: tp_decode.TensorParallelDecoder)
    or all of it (``split`` None: the replicated step, one collective a layer)."""

    def __init__(self, model: CPModel, comm, split=None, persistent: bool = True):
        """TypeError or ValueError, in words, where a layer's weights do not qualify.
        ``persistent``: the collectives as persistent MPI requests where the library has
        them (off: blocking calls, as on a library without them)."""
        self.model, self.comm, self.split = model, comm, split
        self.persistent = persistent
        self.library, _ = decode_step.library()
        # the library's one pool, started once (a later decoder asking as many reuses it)
        self.threads = self.library.spmd_cp_decode_set_threads(rank_threads())
        self.heads, self.kv_heads = head_counts(model.layers[0].self_attn)
        self.dim = model.embed_tokens["weight"].shape[1]
        self.head_dim = None
        self.held = Held()
        self.summed_norms = []  # per layer: (weight, eps) of its MLP output's norm in C
        # after the split step's sum, or None (normed in spmd_cp_decode_mlp, or not at all)
        self.layers = [self._layer(i, layer) for i, layer in enumerate(model.layers)]
        self.embedding_table = model.embed_tokens["weight"]
        self.embedding = float32_view(self.embedding_table)
        self.embedding_released = SHADOWS.is_released(self.embedding_table)
        # Gemma 3's factor on the embedded row, as the layer loop applies it (float32)
        self.embed_scale = None if model.embed_scale is None else \
            np.float32(model.embed_scale.astype(mx.float32).item())
        self.windows = [form.window for form in model.forms]
        self.norm, self.norm_eps = norm_weight(model.norm)
        if split is not None:
            head, self.vocab_sizes = split.head, split.vocab_sizes
        else:
            head, self.vocab_sizes = _divided_head(model, comm)
        self.head = self.held.matrix(head)
        self.scale = self.layers[0].scale
        if any(layer.scale != self.scale for layer in self.layers):
            raise ValueError("the layers' attention scales differ")
        self._buffers()
        self._addresses = _Addresses(self)
        self.layer_refs = [ctypes.byref(layer) for layer in self.layers]
        self._cache_versions = [None] * len(self.layers)
        self.ropes = [layer.self_attn.rope for layer in model.layers]
        self._rope_start = -ROPE_BLOCK  # no block built yet

    def _layer(self, index: int, layer) -> Layer:
        attn, parts, form = layer.self_attn, LayerParts.of(layer), self.model.forms[index]
        self.head_dim = self.head_dim or parts.qkv_widths[0] // self.heads
        if head_counts(attn) != (self.heads, self.kv_heads):
            raise ValueError(f"layer {index}: head counts differ from the first layer's")
        try:
            activation = activation_code(parts)
        except TypeError as error:
            raise TypeError(f"layer {index}: {error}") from None
        input_norm, input_eps = norm_weight(layer.input_layernorm)
        post_norm, post_eps = norm_weight(getattr(layer, form.mlp_norm))
        out_norms, summed_norm = (None, 0.0, None, 0.0), None
        if form.sandwich:
            out_norms = (*norm_weight(layer.post_attention_layernorm),
                         *norm_weight(layer.post_feedforward_layernorm))
            if self.split is not None:  # the MLP's output is normed after the ranks' sum
                summed_norm = (self.held.vector(out_norms[2]), ctypes.c_float(out_norms[3]))
                out_norms = (*out_norms[:2], None, 0.0)
        self.summed_norms.append(summed_norm)
        q_norm = k_norm = None
        qk_eps = 0.0
        if hasattr(attn, "q_norm"):  # Qwen3, Gemma 3
            q_norm, qk_eps = norm_weight(attn.q_norm)
            k_norm, _ = norm_weight(attn.k_norm)
        held = self.held
        if self.split is not None:
            piece = self.split.layers[index]  # W_o by rows, an Allgatherv: tp_decode.py
            qkv, o = piece.qkv_parts, piece.o
            gate, up, down = piece.gate, piece.up, piece.down
        else:
            qkv, o = parts.qkv_matrices(), WeightMatrix.of(parts.o)
            gate, up, down = parts.dense_mlp_matrices()
        if len(qkv) > MAX_PIECES:
            raise ValueError(f"layer {index}: q/k/v rows in {len(qkv)} pieces")
        pieces = (Matrix * MAX_PIECES)(*[held.matrix(m) for m in qkv])
        attention_out, attention_out_eps, mlp_out, mlp_out_eps = out_norms
        return Layer(self.dim, self.heads, self.kv_heads, self.head_dim,
                     held.vector(input_norm), held.vector(post_norm), input_eps, post_eps,
                     held.vector(q_norm), held.vector(k_norm), qk_eps, len(qkv), pieces,
                     held.matrix(o), held.matrix(gate), held.matrix(up),
                     held.matrix(down), None, None, 0, float(attn.scale),
                     KV_KINDS["float32"], activation, held.vector(attention_out),
                     held.vector(mlp_out), attention_out_eps, mlp_out_eps)

    def _buffers(self):
        """Every vector a step writes, allocated once, their addresses taken once, and
        the collectives between them as persistent MPI requests (MPI 4: the arguments
        are checked once, not at each of a step's 120 calls)."""
        layer = self.layers[0]
        qkv_width = (self.heads + 2 * self.kv_heads) * self.head_dim
        partial = self.kv_heads * (self.heads // self.kv_heads) * (self.head_dim + 2)
        f32 = functools.partial(np.zeros, dtype=np.float32)
        split, size = self.split is not None, self.comm.size
        self.h, self.normed = f32(self.dim), f32(self.dim)
        self.qkv_local = f32(sum(layer.qkv[p].rows for p in range(layer.qkv_pieces)))
        self.qkv = f32(qkv_width) if split else self.qkv_local
        self.partial = f32(partial)
        self.partials = f32(size * partial)
        self.attention = f32(self.heads * self.head_dim)
        self.o_part, self.o_sum = f32(self.dim), f32(self.dim)
        self.mlp_part, self.mlp_sum = f32(self.dim), f32(self.dim)
        self.mlp_scratch = f32(self.dim + 2 * max(piece.gate.rows for piece in self.layers))
        self.logits = f32(self.head.rows)
        self.scores = f32(0)
        self.all_logits = self.logits
        self.requests = []
        if size > 1:
            from mpi4py import MPI

            def collective(name: str, *args, **kwargs):
                return _collective(self.comm.mpi, name, self.persistent, *args, **kwargs)

            self.requests = [collective("Allgather", self.partial, self.partials)]
            if split:
                counts = self.split.layers[0].qkv_sizes
                gather_qkv = collective("Allgatherv", self.qkv_local,
                                        [self.qkv, (counts, offsets(counts))])
                rows = [b - a for a, b in split_ranges(self.dim, size)]
                self.o_part = f32(rows[self.comm.rank])
                sum_o = collective("Allgatherv", self.o_part,
                                   [self.o_sum, (rows, offsets(rows))])
                sum_mlp = collective("Allreduce", self.mlp_part, self.mlp_sum, op=MPI.SUM)
                self.requests += [gather_qkv, sum_o, sum_mlp]
            vocab = list(self.vocab_sizes)
            self.all_logits = f32(sum(vocab)) if self.comm.rank == 0 else None
            self.vocab_counts = (vocab, offsets(vocab))
            # freed before mpi4py finalizes MPI (its own atexit handler, registered
            # earlier, runs later): MPICH warns of requests left
            atexit.register(self.free)
        self.sent = self._bytes_per_layer(split, size)

    def _bytes_per_layer(self, split: bool, size: int) -> int:
        """What a layer's collectives hand to other ranks (Comm's counting)."""
        if size == 1:
            return 0
        sent = (size - 1) * self.partial.nbytes
        if split:
            sent += (size - 1) * self.qkv_local.nbytes
            sent += (size - 1) * self.o_part.nbytes  # o's rows
            sent += 2 * (size - 1) * self.mlp_part.nbytes // size  # down's partial sums
        return sent

    @property
    def requests_kind(self) -> str:
        """The plan's word for this step's collectives: "persistent" MPI requests,
        "blocking" calls (asked for, or the library lacks persistent ones), "none"."""
        if not self.requests:
            return "none"
        return "blocking" if any(isinstance(r, _Blocking) for r in self.requests) \
            else "persistent"

    def free(self):
        """Release the persistent requests (idempotent)."""
        for request in self.requests:
            request.Free()
        self.requests = []

    def _scores(self, length: int) -> int:
        """Attention's scratch for ``length`` keys (spmd_cp_decode_scratch: every head's
        scores, or RoPE's, and each thread's partials), grown by doubling."""
        need = self.library.spmd_cp_decode_scratch(self.heads, self.head_dim, length)
        if self.scores.size < need:
            self.scores = np.zeros(max(need, 2 * self.scores.size), np.float32)
        return self.scores.ctypes.data

    def attach_cache(self, index: int, layer_kv) -> None:
        """Point layer ``index``'s struct at its cache's buffers where they may have
        moved since (``LayerKV.buffers_version``)."""
        if self._cache_versions[index] == layer_kv.buffers_version:
            return
        layer = self.layers[index]
        keys, values = cache_view(layer_kv.keys), cache_view(layer_kv.values)
        layer.keys, layer.values = keys.ctypes.data, values.ctypes.data
        layer.capacity = keys.shape[1]
        layer.kv_kind = KV_KINDS[str(layer_kv.keys.dtype).removeprefix("mlx.core.")]
        self._cache_versions[index] = layer_kv.buffers_version

    def _rotations(self, position: int) -> list:
        """Per layer: the address of its (d, d) RoPE matrix at ``position``, from blocks
        of ``ROPE_BLOCK`` positions built ahead (one_token.RopeMatrices.block)."""
        if not 0 <= position - self._rope_start < ROPE_BLOCK:
            blocks = self.model.rope_matrices.block(self.ropes, self.head_dim, position,
                                                    ROPE_BLOCK)
            if any(b is None for b in blocks):
                raise TypeError("a RoPE without a matrix form")
            views = {id(b): float32_view(b) for b in blocks}
            self._rope_views = list(views.values())  # alive while their addresses are used
            self._rope_bases = [views[id(b)].ctypes.data for b in blocks]
            self._rope_start = position
        offset = (position - self._rope_start) * self.head_dim * self.head_dim * 4
        return [base + offset for base in self._rope_bases]

    def _window_firsts(self, cache, position: int) -> dict:
        """Per sliding window: the index in this rank's positions of the first key a query
        at ``position`` sees (each layer's first row is that less what it dropped)."""
        return {window: window_start(cache.positions, position, window)
                for window in set(self.windows) if window is not None}

    def step(self, token: int, position: int, cache, store: bool, on_layer=None,
             tracer=None) -> mx.array | None:
        """Feed ``token`` at ``position`` (cached here where ``store``): the next logits
        (V,) on rank 0, None on the other ranks."""
        lib, comm, size = self.library, self.comm, self.comm.size
        split = self.split is not None
        self._embed(token)
        rotations = self._rotations(position)
        firsts = self._window_firsts(cache, position)
        # (sliding-window layers may hold fewer keys than the others: the longest counts)
        scores = self._scores(max(layer_kv.offset for layer_kv in cache.layers) + 1)
        a = self._addresses
        attend_into = a.partial if size > 1 else a.attention
        gather, *split_requests = self.requests or [None]
        added = None
        for index, (layer, layer_kv) in enumerate(zip(self.layer_refs, cache.layers)):
            if on_layer is not None:
                on_layer(index)
            with span(tracer, f"layer {index}", "layer"):
                row = layer_kv.reserve_row(self.kv_heads, self.head_dim) if store else -1
                length = layer_kv.offset
                if length:
                    self.attach_cache(index, layer_kv)
                lib.spmd_cp_decode_qkv(layer, a.h, added, a.normed, a.qkv_local)
                if split:
                    gather_qkv, sum_o, sum_mlp = split_requests
                    gather_qkv.Start()
                    gather_qkv.Wait()
                first = firsts.get(self.windows[index], 0)
                first = max(first - layer_kv.dropped, 0) if first else 0
                lib.spmd_cp_decode_attend(layer, a.qkv, rotations[index], row, first, length,
                                          size == 1, scores, attend_into)
                if size > 1:
                    gather.Start()
                    gather.Wait()
                    lib.spmd_cp_decode_merge(size, self.heads, self.head_dim, self.scale,
                                             a.partials, a.attention)
                lib.spmd_cp_decode_output(layer, a.attention, a.o_part)
                if split:
                    sum_o.Start()
                    sum_o.Wait()
                lib.spmd_cp_decode_mlp(layer, a.h, a.o_sum if split else a.o_part,
                                       a.mlp_scratch, a.mlp_part)
                if split:
                    sum_mlp.Start()
                    sum_mlp.Wait()
                    if self.summed_norms[index] is not None:
                        lib.spmd_cp_decode_norm(*self.summed_norms[index], self.dim, a.mlp_sum)
                added = a.mlp_sum if split else a.mlp_part
        comm.bytes_sent += len(self.layers) * self.sent
        return self._head(added)

    def _embed(self, token: int):
        """h = the token's embedded row (scaled where the model scales it)."""
        if self.embedding_released:  # its rows live in the packed form only
            SHADOWS.lookup(self.embedding_table, [token], self.h[None])
        else:
            np.copyto(self.h, self.embedding[token])
        if self.embed_scale is not None:
            np.multiply(self.h, self.embed_scale, out=self.h)

    def _head(self, added) -> mx.array | None:
        """Each rank its rows of the vocabulary (every rank holds the step's hidden
        state), gathered: the logits on rank 0, None elsewhere."""
        comm, a = self.comm, self._addresses
        self.library.spmd_cp_decode_head(ctypes.byref(self.head), self.dim, a.h, added, a.norm,
                                         self.norm_eps, a.normed, a.logits)
        if comm.size > 1:
            comm.mpi.Gatherv(self.logits, [self.all_logits, self.vocab_counts]
                             if comm.rank == 0 else None, root=0)
            if comm.rank != 0:
                comm.bytes_sent += self.logits.nbytes
                return None
        return mx.array(self.all_logits)
