"""Tensor-parallel decode steps (Helix, as in TensorRT-LLM): the weights' work split too.

Splitting the KV cache only splits attention. A decode step of a small model on a CPU
spends as long again reading the projection, MLP and LM-head weights, and every rank
already holds all of them. So each rank computes a 1/N slice of every matmul:

    qkv:   rows of [Wq; Wk; Wv] (column-parallel)  -> Allgather -> full q, k, v everywhere
    attn:  each rank's KV shard (CP, as before)    -> exact merge across ranks
    o:     columns of Wo (row-parallel)            -> Allreduce-sum
    mlp:   rows of Wgate, Wup; columns of Wdown    -> Allreduce-sum
    head:  rows of the vocabulary (vocab-parallel) -> Gatherv of the logits to rank 0

Four small collectives per layer (about (NH + 2 NKV) d + NH (d+1) + 2 D floats) replace
(N-1)/N of the weight reads: it pays when the link latency times 4 L is well below the
time to read (N-1)/N of the weights, which the engine measures (``--decode-tp auto``).
Results equal the replicated step up to float summation order.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import swiglu

from ..runtime.comm import Comm
from .model import CPModel, heads_with_rope, local_shard
from ..runtime.trace import span


def split_ranges(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering [0, total), sizes differing by at most one."""
    bounds = np.linspace(0, total, parts + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def supports_tensor_parallel(model: CPModel) -> bool:
    """Slicing needs plain (dequantized) Linear layers; quantized ones run replicated."""
    layer = model.layers[0]
    modules = [layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj]
    return all(type(m) is nn.Linear for m in modules)


class LayerSlice:
    """One rank's slices of one transformer layer's matrices (made contiguous once)."""

    def __init__(self, layer, rank: int, size: int):
        attn, mlp = layer.self_attn, layer.mlp
        qkv_w = mx.concatenate([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        self.qkv_sizes = [b - a for a, b in split_ranges(qkv_w.shape[0], size)]
        a, b = split_ranges(qkv_w.shape[0], size)[rank]
        self.qkv_w = mx.contiguous(qkv_w[a:b])
        self.qkv_b = None
        if "bias" in attn.q_proj:
            qkv_b = mx.concatenate([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
            self.qkv_b = qkv_b[a:b]
        self.q_width, self.k_width = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        a, b = split_ranges(attn.o_proj.weight.shape[1], size)[rank]
        self.o_cols = (a, b)
        self.o_w = mx.contiguous(attn.o_proj.weight[:, a:b])
        self.o_b = attn.o_proj.bias if "bias" in attn.o_proj and rank == 0 else None
        a, b = split_ranges(mlp.gate_proj.weight.shape[0], size)[rank]
        self.gate_w = mx.contiguous(mlp.gate_proj.weight[a:b])
        self.up_w = mx.contiguous(mlp.up_proj.weight[a:b])
        self.down_w = mx.contiguous(mlp.down_proj.weight[:, a:b])
        mx.eval(self.qkv_w, self.o_w, self.gate_w, self.up_w, self.down_w)


class TensorParallelDecoder:
    """Decode steps with every matmul split across the ranks of ``comm``."""

    def __init__(self, model: CPModel, comm: Comm):
        self.model, self.comm = model, comm
        self.slices = [LayerSlice(layer, comm.rank, comm.size) for layer in model.layers]
        head = model.lm_head
        head_w = head.weight if isinstance(head, nn.Module) else model.embed_tokens.weight
        ranges = split_ranges(head_w.shape[0], comm.size)
        self.vocab_sizes = [b - a for a, b in ranges]
        a, b = ranges[comm.rank]
        self.head_w = mx.contiguous(head_w[a:b])
        mx.eval(self.head_w)

    def forward(self, token: int, position: np.ndarray, cache, attend, store: bool,
                on_layer=None, tracer=None) -> mx.array:
        """Hidden state (1, D) of ``token`` at ``position`` (every rank, replicated)."""
        comm = self.comm
        runs = [(0, 1, int(position[0]))]
        h = self.model.embed_tokens(mx.array([[token]], mx.int32))  # (1, 1, D)
        for index, (layer, part, layer_kv) in enumerate(zip(self.model.layers, self.slices,
                                                            cache.layers)):
            if on_layer is not None:
                on_layer(index)
            with span(tracer, f"layer {index}", "layer"):
                attn = layer.self_attn
                x = layer.input_layernorm(h)
                qkv = x @ part.qkv_w.T
                if part.qkv_b is not None:
                    qkv = qkv + part.qkv_b
                qkv = comm.allgather_rows(qkv, axis=-1, counts=part.qkv_sizes)
                q_end, k_end = part.q_width, part.q_width + part.k_width
                q, k, v = heads_with_rope(attn, qkv[..., :q_end], qkv[..., q_end:k_end],
                                          qkv[..., k_end:], runs)
                keys, values = local_shard(layer_kv, k, v, store)
                out = attend(q, keys, values, position, cache.positions, attn.scale)
                out = out.transpose(1, 0, 2).reshape(1, 1, -1)
                a, b = part.o_cols
                o = out[..., a:b] @ part.o_w.T
                if part.o_b is not None:
                    o = o + part.o_b
                h = h + comm.allreduce(o, "sum")
                x = layer.post_attention_layernorm(h)
                act = swiglu(x @ part.gate_w.T, x @ part.up_w.T)
                h = h + comm.allreduce(act @ part.down_w.T, "sum")
                if tracer is not None:
                    mx.eval(h)
        return h[0]

    def logits(self, hidden: mx.array) -> mx.array | None:
        """Full-vocabulary logits (1, V) on rank 0 from each rank's vocabulary slice."""
        local = (self.model.norm(hidden) @ self.head_w.T).astype(mx.float32)  # (1, V/N)
        gathered = self.comm.gather_rows(local[0], self.vocab_sizes, root=0)
        return gathered[None] if gathered is not None else None
