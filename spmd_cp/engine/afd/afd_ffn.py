"""An FFN rank under ``--afd``: it holds feed-forward weights only (its experts, or its
share of a dense MLP's hidden units), never KV, and answers the attention ranks'
exchanges (runtime/afd.py), one per layer of every forward pass they run.

An FFN rank runs the same command as every rank (the SPMD program): where an attention
rank's ``Engine`` prefills a chunk or takes a decode step, ``FfnEngine`` serves the
forward pass that goes with it, so both sides stay in lockstep through the command's
own broadcasts and gathers, and no control message of its own is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ...runtime.afd import Bipartite
from ...runtime.comm import to_wire
from ...runtime.device import Compute
from ...runtime.grid import Grid
from ...runtime.trace import span
from .afd_attention import HEADER, WIRE_DTYPES, afd_halves
from ..cache.cache import ShardedKVCache


class FfnLayer:
    """One layer's feed-forward share: ``module`` computes the cut MLP (a dense share of
    the hidden units), or is the mixture's experts [start, stop) as a SwitchGLU
    (``experts``) of which a row's k chosen ones run here."""

    def __init__(self, module, hidden: int, experts: tuple[int, int] | None = None,
                 top_k: int = 0):
        self.module, self.hidden, self.experts, self.top_k = module, hidden, experts, top_k

    @property
    def width(self) -> int:
        """Floats a row carries here: the hidden state, then a mixture's scores and ids."""
        return self.hidden + (2 * self.top_k if self.experts else 0)

    def __call__(self, rows: np.ndarray, dtype: mx.Dtype) -> np.ndarray:
        """(m, width) float32 -> this rank's partial sums (m, hidden) float32, computed
        in ``dtype`` (the attention rank's hidden states')."""
        x = mx.array(rows[:, :self.hidden]).astype(dtype)
        if rows.shape[0] == 0:
            return np.zeros((0, self.hidden), np.float32)
        if self.experts is None:
            y = self.module(x)
        else:
            y = self._experts(x, rows[:, self.hidden:])
        return to_wire(y.astype(mx.float32))

    def _experts(self, x: mx.array, routing: np.ndarray) -> mx.array:
        """Sum over each row's chosen experts held here of score x expert(row): the
        (row, slot) pairs gathered, each expert's product once, added back per row in
        slot order (mlx-lm's sum over the k slots)."""
        k, (start, stop) = self.top_k, self.experts
        scores, ids = routing[:, :k], routing[:, k:].astype(np.int64)
        rows, slots = np.nonzero((ids >= start) & (ids < stop))
        out = mx.zeros(x.shape, x.dtype)
        if rows.size == 0:
            return out
        local = mx.array(ids[rows, slots] - start).astype(mx.uint32)[:, None]
        y = self.module(x[mx.array(rows)], local)[:, 0]  # (pairs, D)
        weighted = y * mx.array(scores[rows, slots]).astype(y.dtype)[:, None]
        return out.at[mx.array(rows)].add(weighted)


class FfnServer:
    """Serves the attention ranks' exchanges of whole forward passes."""

    def __init__(self, layers: list[FfnLayer], link: Bipartite, tracer=None):
        self.layers, self.link, self.tracer = layers, link, tracer

    def serve_forward(self, streams: int = 1):
        """One forward pass's exchanges, layer by layer; ``streams`` passes interleaved
        (afd_attention.ping_pong: each layer's exchanges of pass 0, then pass 1)."""
        self.link.times.begin()
        for index, layer in enumerate(self.layers):
            with span(self.tracer, f"ffn layer {index}", "layer"):
                for _ in range(streams):
                    self._serve(layer)

    def _serve(self, layer: FfnLayer):
        link, batches = self.link, self.link.micro_batches
        peers = len(link.peers)
        headers = link.counts(np.zeros((peers, HEADER + batches), np.int64))
        link.times.exchanges += 1
        replicated, dtype = bool(headers[0, 0]), WIRE_DTYPES[headers[0, 1]]
        counts = headers[:, HEADER:]
        batches = 1 if replicated else batches  # the attention ranks' rule
        empty = np.zeros((0, layer.width), np.float32)
        outs = [link.post([empty] * peers, list(counts[:, m]), layer.width, np.float32)
                for m in range(batches)]
        backs = []
        for m, (request, received, _) in enumerate(outs):
            link.wait(request, "AFD rows in")
            result = layer(np.concatenate(received) if received else empty, dtype)
            if replicated:  # the first attention rank's rows, back to every one
                sends = [result] * peers
            else:
                sends = np.split(result, np.cumsum(counts[:, m])[:-1])
            backs.append(link.post(sends, [0] * peers, layer.hidden, np.float32))
        for request, _, _ in backs:
            link.wait(request, "AFD results back")


@dataclass(frozen=True)
class FfnModel:
    """What an FFN rank's engine reports of its model: the compute path (every rank takes
    the same, the GPU path's warm-up included), the layers, and a KV dtype for its empty
    cache (it holds no embedding to find one from, and no KV)."""

    compute: Compute
    num_layers: int
    layers: list
    kv_dtype: mx.Dtype = mx.float32


class FfnEngine:
    """The ``Engine`` of an FFN rank: the same calls, each serving the forward passes
    the attention ranks run for it; no KV, no logits."""

    def __init__(self, model: FfnModel, server: FfnServer, comm, grid: Grid,
                 prefill_chunk: int = 0, algo: str = "auto", decode=None):
        self.model, self.server, self.comm, self.grid = model, server, comm, grid
        self.cp = grid.cp
        self.prefill_chunk, self.algo, self.decode = prefill_chunk, algo, decode
        self.algos_used: list[str] = []
        self.plan = self.decoder = self.tp_decoder = None

    def layer_hook(self, phase: str):
        return None  # (an FFN rank runs no layer loop of its own)

    def twin(self, algo: str) -> FfnEngine:
        return FfnEngine(self.model, self.server, self.comm, self.grid, 0, algo, self.decode)

    def new_cache(self) -> ShardedKVCache:
        """An empty cache: an FFN rank stores no keys or values."""
        return ShardedKVCache(self.model.num_layers, self.cp.rank, self.cp.size,
                              self.model.kv_dtype)

    def prefill(self, cache, token_ids, score: bool = False, progress=None):
        """Serve the attention ranks' prefill of ``token_ids`` chunk by chunk (their
        chunks: the same ``prefill_chunk``), joining the score rows' gather."""
        total = len(token_ids)
        chunk = self.prefill_chunk if self.prefill_chunk > 0 else max(total, 1)
        for begin in range(0, total, chunk):
            self.server.serve_forward()
            if score:
                self.comm.gather_object(None)
            if progress is not None:
                progress(min(begin + chunk, total), total)
        return None, None

    def decode_step(self, cache, token, wait: bool = True):
        self.server.serve_forward()
        return None

    def batched_decoder(self, cache, prefix_tokens: int) -> "FfnBatchedDecoder":
        return FfnBatchedDecoder(self.server)

    def prepare_decode(self):
        return None

    def adopt_plan(self, other):
        pass

    @property
    def decode_modes(self) -> dict:
        return {"decode_tp": "off", "decode_comm": "mpi", "decode_step": "mlx",
                "decode_plan": None}


class FfnBatchedDecoder:
    """An FFN rank's side of batched decode steps (batched_decode.BatchedDecoder's calls):
    each step one forward pass served; no sequences held."""

    tail_tokens = tail_bytes = 0  # no keys or values held

    def __init__(self, server: FfnServer):
        self.server = server

    def admit(self, key, room: int, source=None, record: bool = False):
        pass

    def retire(self, key):
        pass

    def step(self, keys: list, tokens: list[int], on_layer=None):
        halves = afd_halves(len(keys), self.server.link.micro_batches)
        self.server.serve_forward(streams=len(halves))
        return None
