"""An attention rank's feed-forward under ``--afd``: the MLP runs on the FFN ranks.

The layer loop (model.py) is unchanged: each layer's ``add_mlp`` is ``RemoteFeedForward``'s,
which sends the normed hidden states across the bipartite communicator
(runtime/afd.py) and adds what comes back. For a mixture of experts the router runs
here, once, where the rows are (mlx-lm's own arithmetic for each family, ``route``):
a row travels with its k scores and expert ids, and only to the FFN ranks holding one
of its experts; each such rank returns the sum over its experts of score x expert(x),
and this rank adds those partial sums. A dense MLP's rows go to every FFN rank, each of
which holds a share of the hidden units and returns its partial sum.

Exactness: every expert's output and every hidden unit's product is the same arithmetic
as one rank's; only the order of the final sums differs (float32).
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import numpy as np
from mlx_lm.models.gemma3_text import clip_residual
from mlx_lm.models.mixtral import MixtralSparseMoeBlock
from mlx_lm.models.qwen3_moe import Qwen3MoeSparseMoeBlock

from ...runtime.afd import Bipartite
from ...runtime.comm import to_wire
from ..weights.expert_slices import experts_per_token
from ..layer_parts import feed_forward
from ..weights.weight_slices import split_ranges

ROUTED_MIXTURES = (Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock)

# A layer's header to each FFN rank: whether the rows are a decode step's (replicated),
# the rows' dtype (an index into WIRE_DTYPES), then the rows of each micro-batch.
HEADER = 2
WIRE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def is_mixture(mlp) -> bool:
    return hasattr(mlp, "switch_mlp")


def routing_obstacle(mlp, ffn_ranks: int) -> str | None:
    """Why ``--afd`` cannot route ``mlp``'s rows to ``ffn_ranks`` FFN ranks, or None."""
    if not is_mixture(mlp):
        return None
    if not isinstance(mlp, ROUTED_MIXTURES):
        return f"its mixture ({type(mlp).__name__}) has a router --afd does not run"
    if mlp.num_experts < ffn_ranks:
        return f"{mlp.num_experts} experts cannot be divided over {ffn_ranks} FFN ranks"
    return None


def expert_ranges(experts: int, ffn_ranks: int) -> list[tuple[int, int]]:
    """The experts [start, stop) each FFN rank holds (expert parallelism)."""
    return split_ranges(experts, ffn_ranks)


def route(mlp, x: mx.array) -> tuple[mx.array, mx.array]:
    """(expert ids (n, k), scores (n, k)) of rows ``x`` (n, D): mlx-lm's router of the
    family, step for step."""
    gates = mlp.gate(x)
    k = experts_per_token(mlp)
    if isinstance(mlp, Qwen3MoeSparseMoeBlock):
        gates = mx.softmax(gates, axis=-1, precise=True)
        inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if mlp.norm_topk_prob:
            scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        return inds, scores
    inds = mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k]  # Mixtral's
    scores = mx.softmax(mx.take_along_axis(gates, inds, axis=-1), axis=-1, precise=True)
    return inds, scores


class FeedForwardClient:
    """An attention rank's end of the exchanges: one per layer of every forward."""

    def __init__(self, link: Bipartite, side_rank: int):
        self.link, self.side_rank = link, side_rank
        self.replicated, self.first_layer = False, True

    @contextmanager
    def forward(self, replicated: bool):
        """Around one forward pass; ``replicated``: every attention rank computes the same
        rows (a decode step's token), which the first alone sends."""
        self.replicated = replicated
        self.first_layer = True  # the forward's tokens are counted once, at layer 0
        self.link.times.begin()
        try:
            yield
        finally:
            self.replicated = False

    def start(self, x: mx.array, experts: list | None, routing=None) -> "Crossing":
        """Rows ``x`` (n, D) sent to the FFN ranks (the counts exchanged, the transfers
        posted); the returned Crossing's ``finish`` waits for their sums. ``experts``:
        each FFN rank's expert range (a mixture) or None (a dense MLP's hidden units);
        ``routing``: (ids, scores) of a mixture's rows."""
        wide = x.astype(mx.float32)
        if experts is not None:
            ids, scores = routing[0], routing[1].astype(mx.float32)
            mx.eval(wide, ids, scores)  # the rows and their routing: one evaluation
        rows = to_wire(wide)
        n, width = rows.shape
        if experts is None:
            payload, targets = rows, [np.arange(n)] * len(self.link.peers)
        else:
            ids, scores = np.asarray(ids), np.asarray(scores)
            payload = np.concatenate([rows, scores, ids.astype(np.float32)], axis=1)
            targets = [np.flatnonzero(((ids >= a) & (ids < b)).any(axis=1)) for a, b in experts]
        sending = not self.replicated or self.side_rank == 0
        if sending:
            self.link.times.rows += n * self.first_layer
            self.link.times.row_layers += n
        self.first_layer = False
        return Crossing(self.link, payload, targets, sending, width, x.dtype,
                        self.replicated)


class Crossing:
    """One layer's rows on their way to the FFN ranks and back: each FFN rank's rows in
    micro-batches, its partial sums for ``targets[p]`` (in that order) added up."""

    def __init__(self, link: Bipartite, payload: np.ndarray, targets: list, sending: bool,
                 width: int, dtype, replicated: bool):
        self.link, self.targets, self.width, self.dtype = link, targets, width, dtype
        self.rows = payload.shape[0]
        # a decode step's one row is one micro-batch (the FFN ranks apply the same rule)
        batches = 1 if replicated else link.micro_batches
        parts = [np.array_split(t, batches) for t in targets]  # [peer][mb]
        headers = np.zeros((len(parts), HEADER + link.micro_batches), np.int64)
        headers[:, 0] = int(replicated)
        headers[:, 1] = WIRE_DTYPES.index(dtype)  # the FFN ranks compute in the rows' dtype
        if sending:
            headers[:, HEADER:HEADER + batches] = [[len(mb) for mb in p] for p in parts]
        link.counts(headers)
        link.times.exchanges += 1
        empty = np.zeros((0, payload.shape[1]), np.float32)
        self.outs = [link.post([payload[p[m]] if sending else empty for p in parts],
                               [0] * len(parts), payload.shape[1], np.float32)
                     for m in range(batches)]
        self.backs = [link.post([np.zeros((0, width), np.float32)] * len(parts),
                                [len(p[m]) for p in parts], width, np.float32)
                      for m in range(batches)]

    def finish(self) -> mx.array:
        """The rows' feed-forward (n, D), in their dtype."""
        link = self.link
        for request, _, _ in self.outs:
            link.wait(request, "AFD rows out")
        for request, _, _ in self.backs:
            link.wait(request, "AFD rows back")
        out = np.zeros((self.rows, self.width), np.float32)
        for p, peer_rows in enumerate(self.targets):
            back = np.concatenate([b[1][p] for b in self.backs])
            out[peer_rows] += back  # each row at most once per FFN rank
        return mx.array(out).astype(self.dtype)


class RemoteFeedForward:
    """A layer's projections on an attention rank: q/k/v and o from ``local`` (a
    ReplicatedLayer or SandwichLayer of the same layer), the MLP across the link."""

    def __init__(self, local, layer, sandwich: bool, client: FeedForwardClient,
                 ffn_ranks: int):
        self.local, self.layer, self.sandwich, self.client = local, layer, sandwich, client
        self.parts = local.parts
        mlp = feed_forward(layer)
        self.router = mlp if is_mixture(mlp) else None
        self.experts = (expert_ranges(mlp.num_experts, ffn_ranks) if self.router is not None
                        else None)

    def qkv(self, x: mx.array):
        return self.local.qkv(x)

    def add_output(self, h: mx.array, out: mx.array) -> mx.array:
        return self.local.add_output(h, out)

    def add_mlp(self, h: mx.array, x: mx.array) -> mx.array:
        return self.finish_mlp(h, x.shape, self.start_mlp(x))

    def start_mlp(self, x: mx.array) -> Crossing:
        """The MLP's input rows sent (a mixture's routed here first)."""
        rows = x.reshape(-1, x.shape[-1])
        routing = None
        if self.router is not None and rows.shape[0]:
            routing = route(self.router, rows)
        elif self.router is not None:  # no rows here: no router call (MLX's quantized
            k = experts_per_token(self.router)  # product dies on 0 rows)
            routing = (mx.zeros((0, k), mx.int32), mx.zeros((0, k), mx.float32))
        return self.client.start(rows, self.experts, routing)

    def finish_mlp(self, h: mx.array, shape, crossing: Crossing) -> mx.array:
        """The residual ``h`` plus the MLP's output, once it is back."""
        y = crossing.finish().reshape(shape)
        if self.sandwich:
            return clip_residual(h, self.layer.post_feedforward_layernorm(y))
        return h + y


def afd_halves(rows: int, micro_batches: int) -> list[slice]:
    """A batched step's rows as the passes ``ping_pong`` interleaves: with micro-batches
    (``--afd-micro-batches`` above 1) and two rows or more, two halves (the first the
    larger), else one pass."""
    if rows < 2 or micro_batches < 2:
        return [slice(0, rows)]
    middle = -(-rows // 2)
    return [slice(0, middle), slice(middle, rows)]


def ping_pong(model, passes: list, on_layer=None) -> list[mx.array]:
    """Two forward passes over independent rows (two halves of a batched decode step),
    interleaved so that one's attention runs while the FFN ranks compute the other's
    MLP: ``passes`` holds each pass's (token_ids, positions, cache, attend) and the
    hidden states (n, D) of each are returned. The FFN ranks serve the exchanges in the
    order they are started: layer by layer, pass 0 then pass 1
    (afd_ffn.FfnServer.serve_forward's ``streams``).

        attention:  a0(0) a1(0) | a0(1)      a1(1)      | ...
        FFN ranks:        f0(0)   f1(0)      f0(1)      | ...
    """
    started = [model.begin_pass(ids, positions, cache, attend)
               for ids, positions, cache, attend in passes]
    rows = [r for r, _ in started]
    h = [h0 for _, h0 in started]
    caches = [cache for _, _, cache, _ in passes]
    layers = list(zip(model.layers, model.replicated, model.forms))
    crossings, shapes = [None, None], [None, None]

    def attend_and_send(s: int, index: int):
        layer, project, form = layers[index]
        h[s], x = model.attention_half(rows[s], index, layer, project,
                                       caches[s].layers[index], form, h[s])
        crossings[s], shapes[s] = project.start_mlp(x), x.shape

    for s in (0, 1):
        attend_and_send(s, 0)
    for index in range(len(layers)):
        if on_layer is not None:
            on_layer(index)
        for s in (0, 1):
            h[s] = layers[index][1].finish_mlp(h[s], shapes[s], crossings[s])
            if index + 1 < len(layers):
                attend_and_send(s, index + 1)
    return [r.finish(x) for r, x in zip(rows, h)]


def remote_feed_forward(model, link: Bipartite, side_rank: int, ffn_ranks: int):
    """``model`` (an attention rank's CPModel) with every layer's MLP across ``link``."""
    client = FeedForwardClient(link, side_rank)
    model.replicated = [RemoteFeedForward(local, layer, form.sandwich, client, ffn_ranks)
                        for local, layer, form in zip(model.replicated, model.layers,
                                                      model.forms)]
    model.ffn_client = client
    return model
