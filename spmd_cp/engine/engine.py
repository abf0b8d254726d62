"""Prefill and decode over a sharded cache: the SPMD steps every rank runs in lockstep.

Every rank holds all token ids (rank 0 broadcast them), computes the rows it owns, and
joins the collectives inside attention. Only rank 0 receives logits: the rank that owns
the last prompt position sends that one row of logits, so no hidden states of the
prompt are ever gathered.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import mlx.core as mx
import numpy as np

from ..attention import model_windows, prefill_attention
from ..attention.calibrate import calibrate
from ..attention.partition import head_tail_positions, owner_of
from ..config import DecodeConfig
from ..runtime.comm import Comm
from ..runtime.graph_comm import open_graph_collectives
from ..runtime.grid import Grid
from ..runtime.trace import span
from .cache.cache import ShardedKVCache
from .decode.decode_plan import DecodePlan, open_decode
from .decode.graph_step import GraphStep
from .model import CPModel
from .score_records import ScoreRecords

log = logging.getLogger("spmd_cp")

# Rows of vocabulary logits materialised at once when scoring (x vocab x 4 bytes).
SCORE_ROWS = 256


class Engine:
    """Runs prefill chunks and decode steps of one model over one grid of ranks.

    ``comm`` is the world: rank 0 gets the logits and every rank the tokens. Attention,
    the cache's placement and the decode plan run over ``cp``, the ranks of this rank's
    TP index (all of them without ``--tp``, runtime/grid.py); the ranks of one TP group
    hold the same positions and compute them together (tensor_groups.py)."""

    def __init__(self, model: CPModel, comm: Comm, algo: str = "auto",
                 prefill_chunk: int = 0, on_layer=None, decode: DecodeConfig = DecodeConfig(),
                 make_prefill_attention=prefill_attention, grid: Grid | None = None):
        """``on_layer(phase, index)``, if given, runs before every layer ("prefill" or
        "decode"): the watchdog's context and test-only fault injection use it.
        ``make_prefill_attention``: returns each prefill call's (attend, algo, reason),
        with ``attention.prefill_attention``'s arguments (a profiler may wrap it).
        ``decode``: the settings the decode plan is made from (decode_plan.py).
        ``grid``: the CP x TP grid (None: one CP group of every rank)."""
        self.model = model
        self.grid = grid or Grid(comm, comm, None)
        self.cp = self.grid.cp
        self.make_prefill_attention = make_prefill_attention
        self.comm = comm
        self.algo = algo
        self.prefill_chunk = prefill_chunk
        self.on_layer = on_layer
        self.decode = decode
        self.kv_interleave = decode.kv_interleave
        self.algos_used = []
        self.measured = None
        # Made once, before the first decode step (prepare_decode): the plan, the step it
        # names (native_decode.NativeDecoder or graph_step.GraphStep), the split
        # layout's slices (tp_decode.TensorParallelDecoder) or None.
        self.plan = self.decoder = self.tp_decoder = None
        self._lazy_step = None
        self._batched_collectives = None

    def layer_hook(self, phase: str):
        if self.on_layer is None:
            return None
        return lambda index: self.on_layer(phase, index)

    def calibration(self):
        """Link and compute figures for the auto choice, measured once (lazily)."""
        if self.algo != "auto" or self.cp.size == 1:
            return None
        return self._calibrated()

    def _calibrated(self):
        """The calibration of these ranks (on-disk cache, else measured), read once."""
        if self.measured is None:
            self.measured = calibrate(self.cp)
        return self.measured

    def new_cache(self) -> ShardedKVCache:
        return ShardedKVCache(self.model.num_layers, self.cp.rank, self.cp.size,
                              self.model.kv_dtype)

    # -- prefill -----------------------------------------------------------------
    def prefill(self, cache: ShardedKVCache, token_ids: np.ndarray, score: bool = False,
                progress=None):
        """Prefill ``token_ids`` (all ranks pass the same ids) after what ``cache`` holds.

        Returns (logits of the last token on rank 0 else None, ScoreRecords on rank 0
        when ``score`` else None). With ``score``, record i predicts the token at
        global position ``pos`` from everything before it.
        """
        token_ids = np.asarray(token_ids, np.int64)
        total = len(token_ids)
        chunk = self.prefill_chunk if self.prefill_chunk > 0 else max(total, 1)
        records = ScoreRecords() if score and self.comm.rank == 0 else None
        last_logits = None
        # sliding-window layers drop what no later query sees, where the owner allows it
        trim = cache.rewinds_to > 0 and bool(model_windows(self.model))
        for begin in range(0, total, chunk):
            ids = token_ids[begin:begin + chunk]
            start = cache.num_tokens
            rank_positions = head_tail_positions(len(ids), self.cp.size, start,
                                                 cache.shard_sizes)
            positions = rank_positions[self.cp.rank]
            cache.add_positions(rank_positions, ids)
            attend, algo, reason = self.make_prefill_attention(
                self.algo, self.cp, rank_positions, cache, self.model, self.calibration())
            if algo not in self.algos_used:
                log.info("prefill attention: %s (%s)", algo, reason)
            self.algos_used.append(algo)
            with span(self.comm.tracer, "prefill chunk", "prefill", tokens=len(ids),
                      cached=start, algo=algo), self.crossing(replicated=False):
                hidden = self.model.forward(ids[positions - start], positions, cache, attend,
                                            on_layer=self.layer_hook("prefill"),
                                            tracer=self.comm.tracer, trim_windows=trim)
                mx.eval(hidden)
            if score:
                rows = self._score_rows(hidden, positions, token_ids, begin, start,
                                        rank_positions)
                # a TP group's ranks score the same rows: its first sends them
                parts = self.comm.gather_object(rows if self.grid.tp_rank == 0 else None)
                if records is not None:
                    records.extend(p for p in parts if p is not None)
            if begin + chunk >= total:
                last_logits = self._last_logits(hidden, positions, rank_positions,
                                                start + len(ids) - 1)
            if progress is not None:
                progress(begin + len(ids), total)
        if records is not None:
            records.sort()
        return last_logits, records

    def _score_rows(self, hidden, positions, token_ids, begin, start, rank_positions):
        """Log-probabilities of the next token for this rank's rows of one chunk."""
        # Global position p predicts the token at p + 1; the prompt's offset in the
        # cache (start - begin) maps global positions back to indices of token_ids.
        offset = start - begin
        keep = np.flatnonzero(positions + 1 - offset < len(token_ids))
        result = {name: np.zeros(0, dtype) for name, dtype in
                  (("pos", np.int64), ("token", np.int64), ("logprob", np.float64),
                   ("argmax", np.int64))}
        pieces = []
        # Every rank runs as many rounds as the busiest (a vocabulary-parallel head is
        # collective); a rank out of rows computes empty ones.
        busiest = max(int(np.sum(p + 1 - offset < len(token_ids))) for p in rank_positions)
        for r0 in range(0, busiest, SCORE_ROWS):
            rows = keep[r0:r0 + SCORE_ROWS]
            targets = token_ids[positions[rows] + 1 - offset]
            logits = self.model.logits(hidden[mx.array(rows)])
            if rows.size == 0:  # joined the (maybe collective) head; nothing to score
                continue
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            picked = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)[:, 0]
            argmax = mx.argmax(logits, axis=-1)
            mx.eval(picked, argmax)
            pieces.append({"pos": positions[rows] + 1 - offset, "token": targets,
                           "logprob": np.asarray(picked, np.float64),
                           "argmax": np.asarray(argmax, np.int64)})
        for name in result:
            if pieces:
                result[name] = np.concatenate([p[name] for p in pieces])
        return result

    def _last_logits(self, hidden, positions, rank_positions, last_position):
        """The last position's logits, moved to rank 0 from whichever rank owns it (the
        first rank of the owner's TP group: every rank of it has them)."""
        owner = self.grid.world_rank(owner_of(last_position, rank_positions))
        logits = None
        row = np.flatnonzero(positions == last_position)[:1]  # empty off the owner
        rows = self.model.logits(hidden[int(row[0]):int(row[0]) + 1] if row.size
                                 else hidden[:0])  # every rank: the head may be collective
        if self.comm.rank == owner:
            logits = rows[0]
            mx.eval(logits)
        if owner == 0:
            return logits if self.comm.rank == 0 else None
        if self.comm.rank == owner:
            self.comm.send_array(logits, dest=0)
            return None
        if self.comm.rank == 0:
            return self.comm.recv_array(source=owner)
        return None

    # -- decode --------------------------------------------------------------------
    def decode_step(self, cache: ShardedKVCache, token, wait: bool = True):
        """Feed one generated token; return the next logits on rank 0 (None elsewhere).

        ``token`` is an int, or on a single rank an unevaluated mx.array scalar: then
        ``wait=False`` returns the logits unevaluated too, so the caller can build the
        next step's graph while this one computes (mlx-lm's async decode: MLX's graph
        step, whatever the plan's step). The token's id is recorded in the cache as -1
        until the caller calls ``cache.set_token``.
        """
        owner = cache.place_decode_token(self.kv_interleave)
        position = np.array([cache.num_tokens], np.int64)
        rank_positions = [position if r == owner else position[:0]
                          for r in range(self.cp.size)]
        lazy = isinstance(token, mx.array)
        if lazy and self.comm.size > 1:
            raise ValueError("a lazy token needs one rank: the others must receive its id")
        cache.add_positions(rank_positions, [-1 if lazy else token])
        store, hook = self.cp.rank == owner, self.layer_hook("decode")
        plan, tracer = self.prepare_decode(), self.comm.tracer
        with span(tracer, "decode step", "decode", layout=plan.layout, step=plan.step), \
                self.crossing(replicated=True):
            if lazy:
                return self._overlapped_step().step(token, position, cache, store, hook,
                                                    tracer, wait)
            if plan.step == "native":
                with self.cp.bounded("decode step"):
                    return self.decoder.step(int(token), int(position[0]), cache, store,
                                             hook, tracer)
            return self.decoder.step(token, position, cache, store, hook, tracer)

    def crossing(self, replicated: bool):
        """Around one forward pass: ``--afd``'s exchanges with the FFN ranks (every rank
        computes a decode step's token: ``replicated``)."""
        client = self.model.ffn_client
        return client.forward(replicated) if client is not None else nullcontext()

    def batched_decoder(self, cache: ShardedKVCache, prefix_tokens: int):
        """Collective: the batched decode steps after ``cache``'s prefix: the native
        step's batched form where the decode plan runs the native step
        (native_batched.py), else MLX's (batched_decode.BatchedDecoder)."""
        from .decode.batched_decode import BatchedDecoder
        from .decode.native_batched import NativeBatchedDecoder

        if self.batched_native():
            return NativeBatchedDecoder(self, cache, prefix_tokens)
        return BatchedDecoder(self, cache, prefix_tokens)

    def batched_native(self) -> bool:
        """Whether batched steps run natively (collective where it asks the decode plan:
        no grid, no --afd)."""
        if self.grid.tp is not None or self.grid.afd is not None:
            return False
        return self.prepare_decode().step == "native"

    def twin(self, algo: str) -> "Engine":
        """An engine over the same model, grid and decode settings (startup.warm_up)."""
        return Engine(self.model, self.comm, algo=algo, decode=self.decode, grid=self.grid)

    def _overlapped_step(self) -> GraphStep:
        """One rank's overlapped loop feeds unevaluated tokens: MLX's graph step."""
        if isinstance(self.decoder, GraphStep):
            return self.decoder
        if self._lazy_step is None:
            self._lazy_step = GraphStep(self.model, self.cp, self.cp, self.decode.decode_merge)
        return self._lazy_step

    def batched_collectives(self):
        """Collective, opened once: what batched decode steps (batched_decode.py) gather
        through: MLX's graph collectives where every rank can open them (unless
        ``--decode-comm mpi``), else the communicator."""
        if self._batched_collectives is None:
            graph = None
            # (a grid's MLX group opens over the world, split by the decode plan: its
            # batched steps keep mpi4py's; --afd's spans the FFN ranks: mpi4py's)
            if self.cp.size > 1 and self.grid.tp is None and self.grid.afd is None:
                graph, _ = open_graph_collectives(self.cp, self.decode.decode_comm,
                                                  self.decode.graph_backend, self.model.compute)
            self._batched_collectives = graph or self.cp
        return self._batched_collectives

    def prepare_decode(self) -> DecodePlan:
        """Collective: the decode plan (decode_plan.py), made once and kept: its
        collectives opened, ``--decode-tp auto`` decided, the split step's slices cut, the
        step built. The first decode step does this where no caller did before (callers
        that time it apart call it first: generation.generate)."""
        if self.plan is None:
            with span(self.comm.tracer, "decode setup", "decode"):
                self.plan, self.decoder, self.tp_decoder = open_decode(
                    self.model, self.cp, self.decode, self._calibrated,
                    lambda: self.measured and self.measured.collective_s, self.grid)
        return self.plan

    def adopt_plan(self, other: "Engine"):
        """Take ``other``'s decode plan and step (made already): a twin engine over the
        same model runs the steps the run will run (startup.warm_up)."""
        self.plan, self.decoder, self.tp_decoder = other.plan, other.decoder, other.tp_decoder

    @property
    def decode_modes(self) -> dict:
        """What decode ran with, for --json: decode_tp ("on" / "off"; the configured mode
        before a plan is made), decode_comm ("mlx" / "mpi"; None on one rank or before the
        plan), decode_step ("native" / "mlx"), and the whole plan (None before one)."""
        if self.plan is None:
            configured = self.decode.decode_tp if self.cp.size > 1 else "off"
            return {"decode_tp": configured, "decode_comm": None, "decode_step": "mlx",
                    "decode_plan": None}
        return {**self.plan.modes, "decode_plan": self.plan.as_dict()}
