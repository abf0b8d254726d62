"""The decode plan: how every decode step of a run is computed, decided once.

A decode step has four independent choices, each with its reason:

    layout     replicated: every rank computes the whole step on its own weights;
               split: each rank 1/N of every matrix (tp_decode.py), --decode-tp
    step       native: a layer as C calls between MPI collectives (native_decode.py);
               graph: one MLX graph a step (graph_step.py), --decode-step
    transport  mpi: mpi4py's collectives; mlx: MLX's graph collectives
               (decode_transport.py), --decode-comm; none on one rank
    requests   the native step's collectives as persistent MPI requests or blocking
               calls; none for the graph step
    merge      how the ranks' attention partials merge (the native step gathers them)

The KV cache's dtype under ``--kv-dtype auto`` follows from the step and is decided here
too (``choose_kv_dtype``), once the model is loaded and before the engine, the forecast
and any prefill need it.

``open_decode`` decides them in that dependency order on every rank at once (each
obstacle any rank meets is every rank's), builds the step the plan names, and returns
both: the engine holds that step and calls it, and nothing changes a mode afterwards.
``--decode-tp auto`` decides from the weight read rate and the collective cost measured
again at the decision, ``DECODE_SAMPLES`` times each, their low quantile, and splits
only where the estimated saving beats the added collectives by ``SPLIT_MARGIN``
(decode_choice.py); the samples, quantile, margin and estimate are the plan's ``inputs``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from ...attention.calibrate import (low_quantile, measure_request_collective,
                                   recheck_decode_figures, sample_collective, uncounted)
from ...config import DecodeConfig, RunConfig
from ...errors import UserError
from ...runtime.spmd import first_reason
from .decode_choice import PackedReads, estimate_split, split_matrix_bytes, split_modules
from .decode_transport import choose_transport
from .graph_step import GraphStep
from .native_decode import NativeDecoder
from .native_eligibility import flag_obstacle, loaded_obstacle, native_obstacle
from .tp_decode import TensorParallelDecoder, is_layer_sharded, slicing_obstacle

log = logging.getLogger("spmd_cp")

# --decode-tp auto splits only where the estimated saving exceeds the added collectives'
# cost by this share: near the break-even either layout decodes about as fast, and the
# split one holds copied column slices besides the weights.
SPLIT_MARGIN = 0.25
# Packed reads are timed over the first split matrices (layer order) that make up this
# much float32 and scaled to all: timed whole, an 8B Q4_K_M model's 30 GB made `auto`'s
# decode setup 2.3 s longer than `--decode-tp on`'s at N = 2 (2-core AMD EPYC, by
# hand); a smaller model is timed whole.
READ_SAMPLE_BYTES = 4 << 30

# --kv-dtype auto: a half-precision cache where the native decode step reads it (its
# attention widens keys and values in registers: a step reads half the cache bytes,
# docs/CPU_SPEED.md), float32 elsewhere (MLX's steps and a scoring pass read a half
# cache back into float32 whole, for nothing, and float32's scores are mlx-lm's).
AUTO_KV_HALF = "float16"
AUTO_KV_FALLBACK = "float32"


def choose_kv_dtype(comm, loaded, run: RunConfig, compute,
                    decode: DecodeConfig | None) -> tuple[str, str]:
    """Collective: (the cache dtype ``--kv-dtype auto`` stands for, why), the same on
    every rank: float16 where decode steps follow (``decode``: their flags; None: none
    do) and every rank can run them natively (native_eligibility.py's rules, asked of
    the model as loaded), else float32. Batched steps (--max-batch) follow the same rule:
    they run natively where one sequence's step does, else in MLX, which widens a half
    cache on the CPU each layer (by hand, one rank, 3K keys: their attention 77 vs 23 ms
    a step). The GPU path keeps the model's dtype whatever this says."""
    if compute.gpu:
        return AUTO_KV_FALLBACK, "not read on the GPU path"
    if decode is None:
        return AUTO_KV_FALLBACK, "no decode steps follow"
    if getattr(loaded, "share", None) is not None:
        reason = "layer-sharded weights decode in MLX's step"
    elif run.tp > 1:
        reason = "tensor-parallel slices (--tp) decode in MLX's step"
    elif run.afd is not None:
        reason = "--afd's attention ranks decode in MLX's step"
    else:
        reason = flag_obstacle(decode) or first_reason(
            comm, loaded_obstacle(loaded.model, compute))
    if reason:
        return AUTO_KV_FALLBACK, f"the decode step is MLX's: {reason}"
    return AUTO_KV_HALF, "decode steps run natively"


@dataclass(frozen=True)
class DecodePlan:
    layout: str  # "replicated" | "split"
    step: str  # "native" | "graph"
    transport: str  # "mpi" | "mlx" | "none"
    requests: str  # "persistent" | "blocking" | "none"
    merge: str  # "allgather" | "allreduce" | "none"
    reasons: dict = field(default_factory=dict)  # per choice, why
    inputs: dict = field(default_factory=dict)  # what --decode-tp auto measured

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def modes(self) -> dict:
        """The summary's decode_tp ("on" / "off"), decode_comm ("mlx" / "mpi", None on
        one rank) and decode_step ("native" / "mlx")."""
        return {"decode_tp": "on" if self.layout == "split" else "off",
                "decode_comm": None if self.transport == "none" else self.transport,
                "decode_step": "native" if self.step == "native" else "mlx"}

    def describe(self) -> str:
        words = [f"{self.layout} layout ({self.reasons.get('layout')})",
                 f"{self.step} step ({self.reasons.get('step')})"]
        if self.transport != "none":
            words.append(f"{self.transport} collectives ({self.reasons.get('transport')})")
        if self.requests != "none":
            words.append(f"{self.requests} requests")
        if self.merge != "none":
            words.append(f"{self.merge} merge")
        if "head" in self.reasons:
            words.append(f"LM head: {self.reasons['head']}")
        return "; ".join(words)


def open_decode(model, comm, config: DecodeConfig, calibrated, loaded_collective_s=None,
                grid=None):
    """Collective: (the DecodePlan, the step it names: NativeDecoder or GraphStep).
    ``calibrated()``: the calibration (attention/calibrate.py, read or measured once).
    ``loaded_collective_s()``: the calibration's collective cost where one is loaded
    already, else None (the transport's choice times the graph's against it). ``grid``:
    the CP x TP grid (runtime/grid.py) where ``comm`` is its CP group."""
    reasons, inputs = {}, {}
    native_why = _native_obstacle(model, comm, config)
    sharded = is_layer_sharded(model)
    transport = choose_transport(comm, config, native_why is None,
                                 sharded and config.decode_tp != "on",
                                 loaded_collective_s or (lambda: None), model.compute,
                                 grid, model.tensor_group)
    reasons["transport"] = transport.reason
    split = _layout(model, comm, config, transport, calibrated, reasons, inputs,
                    native=native_why is None)
    step, requests = None, "none"
    if native_why is None:
        step, native_why = _native_step(model, comm, split, config.decode_requests)
    native = step is not None
    if native:
        requests = step.requests_kind
        reasons["step"] = "kernels/decode_step.c"
        if split is None and step.vocab_sizes is not None:
            reasons["head"] = f"vocabulary rows divided over {comm.size} ranks"
    elif config.decode_step == "native":
        raise UserError(f"--decode-step native: {native_why}")
    else:
        reasons["step"] = native_why
        step = GraphStep(model, comm, transport.collectives, config.decode_merge, split)
        if step.head is not None:
            reasons["head"] = f"vocabulary rows divided over {comm.size} ranks"
    merge = "none" if comm.size == 1 else ("allgather" if native else config.decode_merge)
    plan = DecodePlan("split" if split is not None else "replicated",
                      "native" if native else "graph", transport.name, requests, merge,
                      reasons, inputs)
    if comm.rank == 0:
        log.info("decode plan: %s", plan.describe())
    return plan, step, split


def _native_obstacle(model, comm, config: DecodeConfig) -> str | None:
    """Why any rank cannot take the native step (the same answer on every rank)."""
    return first_reason(comm, flag_obstacle(config) or native_obstacle(model))


def _native_step(model, comm, split, requests: str):
    """(NativeDecoder, None), or (None, why) where any rank could not build it."""
    decoder, reason = None, None
    try:
        decoder = NativeDecoder(model, comm, split, persistent=requests == "persistent")
    except (TypeError, ValueError) as error:
        reason = str(error)
    reason = first_reason(comm, reason)
    if reason and decoder is not None:
        decoder.free()
        decoder = None
    return decoder, reason


def _layout(model, comm, config, transport, calibrated, reasons, inputs, native: bool):
    """The split step's slices (tp_decode.TensorParallelDecoder), or None for the
    replicated layout; its reason in ``reasons["layout"]``. ``native``: the native step
    will run the layout (its collectives are bare MPI requests)."""
    mode = config.decode_tp
    obstacle = None
    if comm.size == 1:
        obstacle = "one rank"
    elif model.tensor_group is not None:
        obstacle = "--tp cut the weights already: each rank computes with its slices"
    elif mode == "off":
        obstacle = "--decode-tp off"
    else:
        obstacle = first_reason(comm, slicing_obstacle(model, comm.size))
        if obstacle:
            obstacle = f"the weights cannot be split over {comm.size} ranks: {obstacle}"
        elif mode == "auto" and is_layer_sharded(model):
            obstacle = (f"layer-sharded weights: the split step would hold 1/{comm.size} "
                        "of every layer besides this rank's layers; --decode-tp on splits")
    if obstacle is None and mode == "auto":
        estimate = _estimate(model, comm, transport, calibrated(), inputs, native)
        if not estimate.split:
            obstacle = f"auto: {estimate.reason}"
        reasons["layout"] = f"auto: {estimate.reason}"
    if obstacle is not None:
        reasons["layout"] = obstacle
        return None
    reasons.setdefault("layout", "--decode-tp on")
    try:
        return TensorParallelDecoder(model, comm, transport.collectives)
    except (TypeError, ValueError) as error:  # a sharded layer that cannot be cut
        # (every rank reads the same layer at the same point, so all fall back)
        reasons["layout"] = f"the weights cannot be split over {comm.size} ranks: {error}"
        return None


def _estimate(model, comm, transport, calibration, inputs: dict, native: bool):
    """--decode-tp auto's estimate from figures measured now (``inputs`` records them).
    Each added collective is costed as the step that runs it pays: the native step's as
    a bare MPI request (measured now, as the other figures), the graph step's as MLX's
    graph collective or mpi4py's with its host round trip."""
    samples = {}
    measured = recheck_decode_figures(comm, calibration, samples)
    if native:
        with uncounted(comm):
            samples["request_collective_s"] = sample_collective(
                comm, measure=measure_request_collective)
        collective_s = low_quantile(samples["request_collective_s"])
    elif transport.name == "mlx":
        collective_s = transport.collectives.latency()
    else:
        collective_s = transport.mpi_collective_s or measured.collective_s
    packed = _packed_reads(model, comm)
    estimate = estimate_split(split_matrix_bytes(model), comm.size, model.num_layers,
                              measured.stream_bytes_per_s, collective_s, packed,
                              margin=SPLIT_MARGIN)
    inputs.update(stream_bytes_per_s=measured.stream_bytes_per_s, collective_s=collective_s,
                  samples=samples, margin=SPLIT_MARGIN, saved_s=estimate.saved_s,
                  cost_s=estimate.cost_s, calibration_file={
                      "stream_bytes_per_s": calibration.stream_bytes_per_s,
                      "collective_s": calibration.collective_s},
                  packed_s=packed.seconds if packed else None)
    return estimate


def _packed_reads(model, comm) -> PackedReads | None:
    """The split matrices decode reads packed and their measured time (every rank at
    once), or None where none is (decode_choice.py). Collective: a rank without
    shadows (another CPU) takes part, and every rank gets the same answer."""
    from ...models.quantized_shadows import SHADOWS

    if not any(comm.allgather_object(SHADOWS.active)):
        return None
    matrices = [m["weight"] for m in split_modules(model) if "weight" in m]
    float32_bytes, seconds = SHADOWS.timed_reads(matrices, comm, READ_SAMPLE_BYTES)
    return PackedReads(float32_bytes, seconds) if float32_bytes else None
