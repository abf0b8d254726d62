"""Decode steps outside MLX's graph on the CPU path: a layer in four C calls (kernels/decode_step.c).

Through MLX a decode step is a graph of about 1,500 nodes (SmolLM2-135M), each built on
the Python thread and run on MLX's compute thread, with its buffers malloc'ed and freed
across the two: with two ranks on two cores each rank's Python thread shares a core with
the step's products, and that overhead does not split with the work. Here a rank's part
of a layer is

    qkv:    residual, RMSNorm, this rank's q/k/v rows  -> Allgatherv (split step)
    attend: q/k norms, RoPE, k/v stored, attention over this rank's cache
                                                        -> Allgather of the partials, merge
    output: this rank's rows of W_o                     -> Allgatherv (split step)
    mlp:    residual, RMSNorm, gate/up rows, SwiGLU, down columns
                                                        -> Allreduce-sum (split step)

on buffers allocated once, with the collectives between them as persistent MPI requests
(mpi4py's, over the job's own MPI). The products are the ``cblas_sgemm`` calls MLX makes,
so gemv_forward.c's matrix-vector forward, quantized shadows and attention kernels read
the weights and the cache as in MLX's step; RMSNorm, the softmax, SwiGLU and the merge are
the same float32 arithmetic in another order, RoPE the same matrices (one_token.py).
Results equal mlx-lm's forward to float32 rounding (tests/test_native_decode.py).

Where it runs: the CPU path, a float32, float16 or bfloat16 KV cache (a half-precision
one read in float32, kernels/kv_half.h), float32 weights (a quantized model's are
dequantized there, its shadows kept), every layer a Llama/Qwen/Phi-3 block (a fused
q|k|v or gate|up read as views of its rows) with plain RMSNorms, a RoPE with a matrix
form, a SwiGLU MLP (not a mixture of experts) and at most 64 query heads per KV head,
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
import mlx.nn as nn
import numpy as np

from ..blas.libraries import rank_threads
from ..kernels import decode_step
from ..kernels.decode_step import KV_KINDS, MAX_PIECES, Layer, Matrix
from ..models.quantized_shadows import SHADOWS
from ..runtime.comm import offsets
from ..runtime.trace import span
from .layer_parts import LayerParts, head_counts
from .model import CPModel
from .tp_decode import head_matrix
from .weight_slices import WeightMatrix, split_ranges

# Decode positions whose RoPE matrices are built at once (64 x 16 KB for d = 64).
ROPE_BLOCK = 64


def _address(array: np.ndarray | None) -> int | None:
    return None if array is None else array.ctypes.data


def _view(a: mx.array) -> np.ndarray:
    """A zero-copy float32 numpy view of an evaluated MLX array (rows may lie apart)."""
    mx.eval(a)
    view = np.asarray(a)
    if view.dtype != np.float32 or view.strides[-1] != 4:
        raise TypeError("not float32 with contiguous rows")
    return view


def _cache_view(a: mx.array) -> np.ndarray:
    """A zero-copy numpy view of an evaluated cache buffer: float32 as is, a float16 or
    bfloat16 one as its uint16 bits (numpy has no bfloat16; MLX's view shares the
    buffer, so the C step's stores land in the cache itself)."""
    if a.dtype == mx.float32:
        return _view(a)
    mx.eval(a)
    view = np.asarray(a.view(mx.uint16))
    if not view.flags["C_CONTIGUOUS"]:
        raise TypeError("a cache buffer that is not contiguous")
    return view


def _vector(a: mx.array) -> np.ndarray:
    view = _view(a)
    if view.ndim != 1:
        raise TypeError("not a vector")
    return view


def _norm_weight(module) -> tuple[np.ndarray, float]:
    if type(module) is not nn.RMSNorm:
        raise TypeError(f"a {type(module).__name__}, not an RMSNorm")
    return _vector(module["weight"]), float(module.eps)


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


class _Held:
    """The numpy views a layer's C struct points into, kept alive with it."""

    def __init__(self):
        self.arrays = []

    def matrix(self, m: WeightMatrix) -> Matrix:
        if m.quant is not None:
            raise TypeError("quantized (not dequantized to float32)")
        weight = _view(m.weight)
        if weight.ndim != 2 or weight.strides[0] % 4 or weight.strides[0] < 0:
            raise TypeError("not a row-major matrix")
        bias = None if m.bias is None else _vector(m.bias)
        self.arrays += [weight, bias]
        return Matrix(weight.ctypes.data, _address(bias), weight.shape[0], weight.shape[1],
                      weight.strides[0] // 4)

    def vector(self, view: np.ndarray) -> int:
        self.arrays.append(view)
        return view.ctypes.data


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
        self.held = _Held()
        self.layers = [self._layer(i, layer) for i, layer in enumerate(model.layers)]
        self.embedding_table = model.embed_tokens["weight"]
        self.embedding = _view(self.embedding_table)
        self.embedding_released = SHADOWS.is_released(self.embedding_table)
        self.norm, self.norm_eps = _norm_weight(model.norm)
        if split is not None:
            head, self.vocab_sizes = split.head, split.vocab_sizes
        else:
            head, self.vocab_sizes = head_matrix(model), None
        self.head = self.held.matrix(head)
        self.scale = self.layers[0].scale
        if any(layer.scale != self.scale for layer in self.layers):
            raise ValueError("the layers' attention scales differ")
        self._buffers()
        self._addresses = _Addresses(self)
        self._layer_refs = [ctypes.byref(layer) for layer in self.layers]
        self._cache_versions = [None] * len(self.layers)
        self._ropes = [layer.self_attn.rope for layer in model.layers]
        self._rope_start = -ROPE_BLOCK  # no block built yet

    def _layer(self, index: int, layer) -> Layer:
        attn, parts = layer.self_attn, LayerParts.of(layer)
        self.head_dim = self.head_dim or parts.qkv_widths[0] // self.heads
        if head_counts(attn) != (self.heads, self.kv_heads):
            raise ValueError(f"layer {index}: head counts differ from the first layer's")
        input_norm, input_eps = _norm_weight(layer.input_layernorm)
        post_norm, post_eps = _norm_weight(layer.post_attention_layernorm)
        q_norm = k_norm = None
        qk_eps = 0.0
        if hasattr(attn, "q_norm"):  # Qwen3
            q_norm, qk_eps = _norm_weight(attn.q_norm)
            k_norm, _ = _norm_weight(attn.k_norm)
        held = self.held
        if self.split is not None:
            piece = self.split.layers[index]  # W_o by rows, an Allgatherv: tp_decode.py
            qkv, o = piece.qkv_parts, piece.o
            gate, up, down = piece.gate, piece.up, piece.down
        else:
            qkv, o = parts.qkv_matrices(), WeightMatrix.of(parts.o)
            (gate, up), down = parts.gate_up_matrices(), WeightMatrix.of(parts.down)
        if len(qkv) > MAX_PIECES:
            raise ValueError(f"layer {index}: q/k/v rows in {len(qkv)} pieces")
        pieces = (Matrix * MAX_PIECES)(*[held.matrix(m) for m in qkv])
        return Layer(self.dim, self.heads, self.kv_heads, self.head_dim,
                     held.vector(input_norm), held.vector(post_norm), input_eps, post_eps,
                     _address(q_norm), _address(k_norm), qk_eps, len(qkv), pieces,
                     held.matrix(o), held.matrix(gate), held.matrix(up),
                     held.matrix(down), None, None, 0, float(attn.scale),
                     KV_KINDS["float32"])

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

    def _attach_cache(self, index: int, layer_kv) -> None:
        """Point layer ``index``'s struct at its cache's buffers where they may have
        moved since (``LayerKV.buffers_version``)."""
        if self._cache_versions[index] == layer_kv.buffers_version:
            return
        layer = self.layers[index]
        keys, values = _cache_view(layer_kv.keys), _cache_view(layer_kv.values)
        layer.keys, layer.values = keys.ctypes.data, values.ctypes.data
        layer.capacity = keys.shape[1]
        layer.kv_kind = KV_KINDS[str(layer_kv.keys.dtype).removeprefix("mlx.core.")]
        self._cache_versions[index] = layer_kv.buffers_version

    def _rotations(self, position: int) -> list:
        """Per layer: the address of its (d, d) RoPE matrix at ``position``, from blocks
        of ``ROPE_BLOCK`` positions built ahead (one_token.RopeMatrices.block)."""
        if not 0 <= position - self._rope_start < ROPE_BLOCK:
            blocks = self.model.rope_matrices.block(self._ropes, self.head_dim, position,
                                                    ROPE_BLOCK)
            if any(b is None for b in blocks):
                raise TypeError("a RoPE without a matrix form")
            views = {id(b): _view(b) for b in blocks}
            self._rope_views = list(views.values())  # alive while their addresses are used
            self._rope_bases = [views[id(b)].ctypes.data for b in blocks]
            self._rope_start = position
        offset = (position - self._rope_start) * self.head_dim * self.head_dim * 4
        return [base + offset for base in self._rope_bases]

    def step(self, token: int, position: int, cache, store: bool, on_layer=None,
             tracer=None) -> mx.array | None:
        """Feed ``token`` at ``position`` (cached here where ``store``): the next logits
        (V,) on rank 0, None on the other ranks."""
        lib, comm, size = self.library, self.comm, self.comm.size
        split = self.split is not None
        if self.embedding_released:  # its rows live in the packed form only
            SHADOWS.lookup(self.embedding_table, [token], self.h[None])
        else:
            np.copyto(self.h, self.embedding[token])
        rotations = self._rotations(position)
        scores = self._scores(cache.layers[0].offset + 1)
        a = self._addresses
        attend_into = a.partial if size > 1 else a.attention
        gather, *split_requests = self.requests or [None]
        added = None
        for index, (layer, layer_kv) in enumerate(zip(self._layer_refs, cache.layers)):
            if on_layer is not None:
                on_layer(index)
            with span(tracer, f"layer {index}", "layer"):
                row = layer_kv.reserve_row(self.kv_heads, self.head_dim) if store else -1
                length = layer_kv.offset
                if length:
                    self._attach_cache(index, layer_kv)
                lib.spmd_cp_decode_qkv(layer, a.h, added, a.normed, a.qkv_local)
                if split:
                    gather_qkv, sum_o, sum_mlp = split_requests
                    gather_qkv.Start()
                    gather_qkv.Wait()
                lib.spmd_cp_decode_attend(layer, a.qkv, rotations[index], row, length,
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
                added = a.mlp_sum if split else a.mlp_part
        comm.bytes_sent += len(self.layers) * self.sent
        if not split and comm.rank != 0:
            return None  # the replicated step's logits are rank 0's alone
        lib.spmd_cp_decode_head(ctypes.byref(self.head), self.dim, a.h, added, a.norm,
                                self.norm_eps, a.normed, a.logits)
        if split:
            comm.mpi.Gatherv(self.logits, [self.all_logits, self.vocab_counts]
                             if comm.rank == 0 else None, root=0)
            if comm.rank != 0:
                comm.bytes_sent += self.logits.nbytes
                return None
        return mx.array(self.all_logits)
