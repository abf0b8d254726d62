"""Prefill and decode over a sharded cache: the SPMD steps every rank runs in lockstep.

Every rank holds all token ids (rank 0 broadcast them), computes the rows it owns, and
joins the collectives inside attention. Only rank 0 receives logits: the rank that owns
the last prompt position sends that one row of logits, so no hidden states of the
prompt are ever gathered.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

from ..attention import decode_attention, prefill_attention
from .cache import ShardedKVCache
from ..attention.calibrate import calibrate, recheck_decode_figures
from ..errors import UserError
from ..runtime.comm import Comm
from ..runtime.graph_comm import chained_latency, open_graph_collectives
from ..runtime.spmd import first_reason
from .model import CPModel
from .native_decode import NativeDecoder
from .native_eligibility import native_obstacle
from .score_records import ScoreRecords
from ..models.quantized_shadows import SHADOWS
from ..attention.partition import head_tail_positions, owner_of
from .decode_choice import PackedReads, estimate_split, split_matrix_bytes, split_modules
from .tp_decode import TensorParallelDecoder, is_layer_sharded, supports_tensor_parallel
from ..runtime.trace import span

log = logging.getLogger("spmd_cp")

# Rows of vocabulary logits materialised at once when scoring (x vocab x 4 bytes).
SCORE_ROWS = 256


class Engine:
    """Runs prefill chunks and decode steps of one model over one communicator."""

    def __init__(self, model: CPModel, comm: Comm, algo: str = "auto",
                 prefill_chunk: int = 0, on_layer=None, kv_interleave: int = 1,
                 decode_merge: str = "allgather", decode_tp: str = "off",
                 decode_comm: str = "mpi", make_prefill_attention=prefill_attention):
        """``on_layer(phase, index)``, if given, runs before every layer ("prefill" or
        "decode"): the watchdog's context and test-only fault injection use it.
        ``make_prefill_attention``: returns each prefill call's (attend, algo, reason),
        with ``attention.prefill_attention``'s arguments (a profiler may wrap it).
        ``decode_comm``: "mlx" / "auto" run the decode step's collectives inside MLX's
        graph (runtime/graph_comm.py; "auto" falls back to MPI where a rank cannot)."""
        self.model = model
        self.make_prefill_attention = make_prefill_attention
        self.comm = comm
        self.algo = algo
        self.prefill_chunk = prefill_chunk
        self.on_layer = on_layer
        self.kv_interleave = kv_interleave
        self.decode_merge = decode_merge
        # "on", "off" or "auto" (decided once before the first decode step, from calibrated
        # measurements: decode_choice.py). One rank has nothing to split.
        self.decode_tp = decode_tp if comm.size > 1 else "off"
        self.tp_decoder = None
        self.decode_comm = decode_comm
        self.collectives = None  # the decode step's: graph collectives or the Comm itself
        self._mpi_collective_s = None  # mpi4py's chained collective, where auto timed it
        self.algos_used = []
        self.measured = None
        self._native = {}  # split step or not -> its NativeDecoder, or None (MLX's step)
        self._native_reason = None  # why decode steps stay MLX's ("" : they need not)

    def _layer_hook(self, phase: str):
        if self.on_layer is None:
            return None
        return lambda index: self.on_layer(phase, index)

    def calibration(self):
        """Link and compute figures for the auto choice, measured once (lazily)."""
        if self.algo != "auto" or self.comm.size == 1:
            return None
        return self._calibrated()

    def _calibrated(self):
        """The calibration of these ranks (on-disk cache, else measured), read once."""
        if self.measured is None:
            self.measured = calibrate(self.comm)
        return self.measured

    def new_cache(self) -> ShardedKVCache:
        return ShardedKVCache(self.model.num_layers, self.comm.rank, self.comm.size,
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
        for begin in range(0, total, chunk):
            ids = token_ids[begin:begin + chunk]
            start = cache.num_tokens
            rank_positions = head_tail_positions(len(ids), self.comm.size, start,
                                                 cache.shard_sizes)
            positions = rank_positions[self.comm.rank]
            cache.add_positions(rank_positions, ids)
            attend, algo, reason = self.make_prefill_attention(
                self.algo, self.comm, rank_positions, cache, self.model, self.calibration())
            if algo not in self.algos_used:
                log.info("prefill attention: %s (%s)", algo, reason)
            self.algos_used.append(algo)
            with span(self.comm.tracer, "prefill chunk", "prefill", tokens=len(ids),
                      cached=start, algo=algo):
                hidden = self.model.forward(ids[positions - start], positions, cache, attend,
                                            on_layer=self._layer_hook("prefill"),
                                            tracer=self.comm.tracer)
                mx.eval(hidden)
            if score:
                parts = self.comm.gather_object(
                    self._score_rows(hidden, positions, token_ids, begin, start,
                                     rank_positions))
                if records is not None:
                    records.extend(parts)
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
        """The last position's logits, moved to rank 0 from whichever rank owns it."""
        owner = owner_of(last_position, rank_positions)
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
        next step's graph while this one computes (mlx-lm's async decode). The token's
        id is recorded in the cache as -1 until the caller calls ``cache.set_token``.
        """
        owner = cache.place_decode_token(self.kv_interleave)
        position = np.array([cache.num_tokens], np.int64)
        rank_positions = [position if r == owner else position[:0]
                          for r in range(self.comm.size)]
        lazy = isinstance(token, mx.array)
        if lazy and self.comm.size > 1:
            raise ValueError("a lazy token needs one rank: the others must receive its id")
        cache.add_positions(rank_positions, [-1 if lazy else token])
        store, hook = self.comm.rank == owner, self._layer_hook("decode")
        split = self._use_tensor_parallel()
        tracer = self.comm.tracer
        native = None if lazy else self._native_decoder(split)
        if native is not None:
            with span(tracer, "decode step", "decode", tensor_parallel=split, native=True), \
                    self.comm.bounded("decode step"):
                return native.step(int(token), int(position[0]), cache, store, hook, tracer)
        attend = decode_attention(self._decode_collectives(), self.decode_merge)
        with span(tracer, "decode step", "decode", tensor_parallel=split):
            if split:
                hidden = self.tp_decoder.forward(token, position, cache, attend, store, hook,
                                                 tracer)
                logits = self.tp_decoder.logits(hidden)
            else:
                ids = token.reshape(1) if lazy else np.array([token])
                hidden = self.model.forward(ids, position, cache, attend,
                                            store=store, on_layer=hook, tracer=tracer)
                # Ranks > 0 need no logits (they join a vocabulary-parallel head with
                # no rows); evaluating finishes the layers' collectives.
                logits = self.model.logits(hidden if self.comm.rank == 0 else hidden[:0])
                if self.comm.rank != 0:
                    logits = (logits, hidden)
            if wait:
                with self.comm.bounded("decode step"):  # may run graph collectives
                    mx.eval(logits)
        return logits[0] if self.comm.rank == 0 else None

    def _native_wanted(self) -> bool:
        """Whether decode steps run natively (native_decode.py) where the weights allow:
        every rank can (collective, asked once), and ``--decode-comm mlx`` did not ask
        for MLX's step with its graph collectives. Says why not (rank 0's log)."""
        if self._native_reason is None:
            reason = native_obstacle(self.model)
            if self.decode_comm == "mlx":
                reason = "--decode-comm mlx"
            self._native_reason = reason = first_reason(self.comm, reason) or ""
            if reason and self.comm.rank == 0:
                log.info("decode step: MLX's graph (%s)", reason)
        return not self._native_reason

    def _native_decoder(self, split: bool) -> NativeDecoder | None:
        """The native step for the split step or the replicated one, built at its first
        use, or None where any rank could not build it (collective: all run one step)."""
        if not self._native_wanted():
            return None
        if split not in self._native:
            decoder, reason = None, None
            try:
                decoder = NativeDecoder(self.model, self.comm, self.tp_decoder if split else None)
            except (TypeError, ValueError) as error:
                reason = str(error)
            reason = first_reason(self.comm, reason)
            if reason and decoder is not None:
                decoder.free()
                decoder = None
            if self.comm.rank == 0:
                log.info("decode step: %s", "native (kernels/decode_step.c)" if decoder is not None
                         else f"MLX's graph ({reason})")
            self._native[split] = decoder
        return self._native[split]

    def prepare_decode(self):
        """Collective: what the first decode step would otherwise do before computing
        (open its collectives, decide ``--decode-tp auto``, cut the split step's slices,
        build the native step),
        for callers that time it apart (generation.generate). Idempotent."""
        with span(self.comm.tracer, "decode setup", "decode"):
            if self.comm.size > 1:
                self._decode_collectives()
            self._native_decoder(self._use_tensor_parallel())

    @property
    def decode_modes(self) -> dict:
        """What decode ran with, for --json: the split step or not ("on" / "off"; "auto"
        before it is decided) and the collectives ("mlx" / "mpi"; None on one rank or
        before decode was readied)."""
        used = None
        if self.collectives is not None and self.comm.size > 1:
            used = self.decode_comm
        native = any(decoder is not None for decoder in self._native.values())
        return {"decode_tp": self.decode_tp, "decode_comm": used,
                "decode_step": "native" if native else "mlx"}

    def _decode_collectives(self):
        """The decode step's collectives, chosen once (every rank at once)."""
        if self.collectives is None and self.comm.size == 1:
            self.collectives = self.comm  # nothing to communicate
        if self.collectives is None:
            if self.decode_comm == "auto" and self._native_wanted():
                graph, reason = None, "the native decode step's, persistent MPI requests"
            elif self.decode_comm == "auto" and self._replicated_over_shards():
                graph, reason = None, ("replicated steps over layer-sharded weights: each "
                                       "collective evaluates the layers before it, so the "
                                       "layers received for a step are freed one by one")
            else:
                graph, reason = open_graph_collectives(self.comm, self.decode_comm)
            if graph is not None and self.decode_comm == "auto":
                graph, reason = self._faster_of(graph, reason)
            if graph is None and self.decode_comm == "mlx":
                raise UserError(f"--decode-comm mlx: {reason}")
            log.info("decode collectives: %s (%s)", "in MLX's graph" if graph else "MPI",
                     reason)
            self.collectives = graph or self.comm
            self.decode_comm = "mlx" if graph else "mpi"
        return self.collectives

    def _faster_of(self, graph, reason: str):
        """``--decode-comm auto``: the graph collectives, unless one costs more than
        mpi4py's does with its host round trip. Through MLX's MPI backend a collective is
        the MPI call mpi4py would make, without the round trip: kept untimed. Over the
        ring on oversubscribed cores one took 7.7-9.2 ms (N = 4 on 2 cores, whose mpi4py
        collectives decoded 3-4x faster), so there the ring's is timed and, where it
        exceeds a bare MPI call (the calibration's, where one is loaded: ``--cp-algo
        auto`` loads it for the prefill), mpi4py's too (tens of ms, in the decode setup;
        the probes' bytes are counted like any others), and the faster kept. Collective:
        every rank decides on the same timings."""
        if graph.backend == "mpi":
            return graph, reason
        graph_s = graph.latency()
        if self.measured is not None and graph_s <= self.measured.collective_s:
            return graph, reason
        mpi_s = chained_latency(self.comm, self.comm)
        if graph_s <= mpi_s:
            return graph, reason
        self._mpi_collective_s = mpi_s
        return None, (f"{1e6 * mpi_s:.0f} us per collective through mpi4py against "
                      f"{1e6 * graph_s:.0f} us in MLX's graph ({reason})")

    def _replicated_over_shards(self) -> bool:
        """Whether decode steps will run replicated over a layer-sharded store. Their
        collectives then stay MPI's: a step built as one MLX graph would keep every layer
        received (and dequantized) for it until the step is evaluated, the whole model at
        once, where MPI's evaluate layer by layer (SmolLM2 Q4_1, N = 2: resident peak 354
        vs 295 MiB, MLX peak 148 vs 120; decode 3.80 vs 3.79 tok/s)."""
        return is_layer_sharded(self.model) and self.decode_tp != "on"

    def _packed_reads(self) -> PackedReads | None:
        """The split matrices decode reads packed and their measured time (every rank at
        once), or None where none is (decode_choice.py). Collective: a rank without
        shadows (another CPU) takes part, and every rank gets the same answer."""
        if not any(self.comm.allgather_object(SHADOWS.active)):
            return None
        matrices = [m["weight"] for m in split_modules(self.model) if "weight" in m]
        float32_bytes, seconds = SHADOWS.timed_reads(matrices, self.comm)
        return PackedReads(float32_bytes, seconds) if float32_bytes else None

    # -- tensor-parallel decode: on, off, or decided from measurements -----------------
    def _use_tensor_parallel(self) -> bool:
        """Whether this decode step splits the weights' work across ranks (tp_decode.py).

        ``auto`` decides once (``prepare_decode``, else the first step), from the calibrated
        weight read rate and collective cost (decode_choice.py; measured once per set of
        hosts and cached on disk): no decode step is spent measuring, and the weight
        slices are only built when the split is chosen.
        """
        if self.decode_tp == "off":
            return False
        if self.tp_decoder is None:
            if not supports_tensor_parallel(self.model, self.comm):
                self.decode_tp = "off"
                return False
            if self.decode_tp == "auto" and is_layer_sharded(self.model):
                log.info("decode: replicated (layer-sharded weights: the split step would "
                         "hold 1/%d of every layer besides this rank's layers; --decode-tp "
                         "on splits)", self.comm.size)
                self.decode_tp = "off"
                return False
            if self.decode_tp == "auto":
                # Measured again now (a file taken under another load must not decide
                # every later run); graph collectives are timed as the step issues them.
                measured = self.measured = recheck_decode_figures(self.comm, self._calibrated())
                collectives = self._decode_collectives()
                collective_s = (collectives.latency() if collectives is not self.comm
                                else self._mpi_collective_s or measured.collective_s)
                estimate = estimate_split(split_matrix_bytes(self.model), self.comm.size,
                                          self.model.num_layers, measured.stream_bytes_per_s,
                                          collective_s, self._packed_reads())
                self.decode_tp = "on" if estimate.split else "off"
                log.info("decode: %s (%s)", "tensor-parallel" if estimate.split else
                         "replicated", estimate.reason)
                if not estimate.split:
                    return False
            try:
                self.tp_decoder = TensorParallelDecoder(self.model, self.comm,
                                                        self._decode_collectives())
            except (TypeError, ValueError) as error:  # a sharded layer that cannot be cut
                # (every rank reads the same layer at the same point, so all fall back)
                log.info("decode: replicated (the weights cannot be split over %d ranks: %s)",
                         self.comm.size, error)
                self.decode_tp = "off"
                return False
        return True
