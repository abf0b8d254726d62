"""Measure, on the actual ranks, the numbers the auto choices need (slowest rank wins).

For ``--cp-algo auto`` (choose.py):
- attention FLOP/s: block attention of a representative tile on every rank;
- ring bandwidth: a bulk Sendrecv around the ring;
- ring latency: one ring step of a tiny array as the ring algorithms take it (the
  communication thread, the wire conversions), not only the link's;
- copy rate: bytes/s of the host copies around every transfer (a fresh wire buffer in,
  an MLX array out);
- transfer drag: the share of attention compute a concurrent ring transfer costs.
For ``--decode-tp auto`` (engine.py), with every rank working at once as in decode:
- weight streaming rate: bytes/s of a matrix-vector product over a large matrix;
- one small collective as the split decode step issues it (evaluate, Allreduce, convert).

Measured once per set of hosts and rank count and cached on disk with the time and the
load average it was taken under, so later runs pay nothing; ``spmd-cp doctor
--recalibrate`` measures again. A cached file is not trusted forever: the two decode
figures, the ones a ``--decode-tp auto`` decision hinges on, are cheap (about 30 ms) and
``recheck_decode_figures`` measures them again before each decision. The fresh figures
decide, and a file more than ``STALE_FACTOR`` off is replaced. A file written while the
machine was busy once made every later run choose the slower decode step: it held 1,541
us per collective, where an idle measurement gives 95.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np

from .block import block_attention
from .choose import LinkAndCompute
from .exp import polynomial_exp_enabled
from ..runtime.paths import cache_dir
from ..runtime.comm import Comm, from_wire, to_wire


def _attention_probe(num_heads=8, num_kv_heads=2, head_dim=64, tq=256, tk=1024):
    """(one evaluated call of block attention on a full tile, its FLOPs: QK^T and PV,
    4 * NH * Tq * Tk * d)."""
    q = mx.random.normal((num_heads, tq, head_dim))
    k = mx.random.normal((num_kv_heads, tk, head_dim))
    v = mx.random.normal((num_kv_heads, tk, head_dim))
    q_pos = np.full(tq, tk, np.int64)  # every key visible: a full tile of work
    k_pos = np.arange(tk, dtype=np.int64)
    mx.eval(q, k, v)

    def call():
        mx.eval(block_attention(q, k, v, q_pos, k_pos, 0.125))

    return call, 4 * num_heads * tq * tk * head_dim


def measure_attention_flops(repeats=3) -> float:
    """FLOP/s of block attention (the best of ``repeats`` calls after two warm-ups: in a
    fresh process the first calls fault in their buffers, 5-30 against 55-59 GFLOP/s
    on the 2-core test machine, over up to four calls on jemalloc's huge pages)."""
    call, flop = _attention_probe()
    call()  # warm-ups
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return flop / best


def measure_ring(comm: Comm, nbytes=8 << 20, repeats=3) -> tuple[float, float]:
    """(bytes/s per direction, one ring step's latency in s); slowest rank's.

    The bandwidth is the raw Sendrecv's; the latency is a tiny array's trip through
    ``Comm.sendrecv_start`` (thread hand-off and wire conversions included): that fixed
    cost is what every ring step of pass-KV and pass-Q pays.
    """
    if comm.size == 1:
        return float("inf"), 0.0
    send_to, recv_from = comm.ring_next, comm.ring_prev
    small = mx.ones((8,), mx.float32)
    comm.sendrecv_start(small, send_to, recv_from, (8,)).wait()  # starts the thread
    send = np.ones(nbytes // 4, np.float32)
    recv = np.empty_like(send)
    times = {"latency": float("inf"), "bulk": float("inf")}
    comm.barrier()
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(comm.sendrecv_start(small, send_to, recv_from, (8,)).wait())
        times["latency"] = min(times["latency"], time.perf_counter() - start)
        start = time.perf_counter()
        comm.mpi.Sendrecv(send, send_to, 0, recv, recv_from, 0)
        times["bulk"] = min(times["bulk"], time.perf_counter() - start)
    latency, bulk = (max(comm.allgather_object(times[k])) for k in ("latency", "bulk"))
    return nbytes / max(bulk, 1e-9), latency


def measure_transfer_drag(comm: Comm, bandwidth: float, seconds: float = 0.15) -> float:
    """Fraction of attention compute lost while a ring transfer runs on the
    communication thread (slowest rank): 1 - C(during) / C(alone).

    A transfer that compute "hides" still runs MPI's progress loop and, over TCP, the
    kernel's network stack on the host's cores; where a rank has no core to spare for
    them (two ranks on two cores) the attention slows for as long as the transfer lasts.
    About ``seconds`` of attention run while a transfer sized to outlast them moves."""
    if comm.size == 1:
        return 0.0
    call, _ = _attention_probe()
    start = time.perf_counter()
    call()  # warm-up, and the size of the probe
    calls = max(2, round(seconds / (time.perf_counter() - start)))

    def mean_call() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            call()
        return (time.perf_counter() - start) / calls

    comm.barrier()
    alone = mean_call()
    # Back-to-back Sendrecvs of one 4 MiB buffer for about 1.5x the probe's time (the
    # same count on every rank: ``bandwidth`` is the slowest link's, as everywhere).
    send = np.ones(1 << 20, np.float32)
    recv = np.empty_like(send)
    rounds = max(1, math.ceil(1.5 * seconds * bandwidth / send.nbytes))

    def transfers():
        for _ in range(rounds):
            comm.mpi.Sendrecv(send, comm.ring_next, 0, recv, comm.ring_prev, 0)

    comm.barrier()
    mover = threading.Thread(target=transfers, name="spmd-cp-calibrate")
    mover.start()
    during = mean_call()
    mover.join()
    return max(comm.allgather_object(max(0.0, 1.0 - alone / during)))


def measure_copy(nbytes=8 << 20, repeats=3) -> float:
    """Bytes/s of one host copy as transfers make them (into a fresh buffer, pages
    faulted in as they would be for a received message)."""
    source = mx.ones((nbytes // 4,), mx.float32)
    mx.eval(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(from_wire(to_wire(source) + 0, mx.float32))  # numpy copy, then MLX's
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def measure_stream(comm: Comm, nbytes=64 << 20, repeats=3) -> float:
    """Bytes/s a matrix-vector product reads weights at, every rank at once (slowest).

    In the form decode multiplies one row by a weight on this device
    (engine/weight_slices.times_transposed: W @ x on the CPU, x @ W.T elsewhere)."""
    return max(stream_samples(comm, nbytes, repeats))


def stream_samples(comm: Comm, nbytes=64 << 20, samples=3) -> list[float]:
    """``samples`` timings of ``measure_stream``'s product on one matrix: each the
    slowest rank's bytes/s (the ranks start together)."""
    cols = 1024
    weight = mx.ones((nbytes // (4 * cols), cols))  # values do not change the read rate
    x = mx.ones((1, cols))
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    product = (lambda: weight @ x.reshape(-1, 1)) if on_cpu else (lambda: x @ weight.T)
    mx.eval(weight, x, product())
    rates = []
    for _ in range(samples):
        comm.barrier()
        start = time.perf_counter()
        mx.eval(product())
        rates.append(weight.nbytes / (time.perf_counter() - start))
    return [min(rank) for rank in zip(*comm.allgather_object(rates))]


def measure_collective(comm: Comm, width=1024, repeats=20) -> float:
    """Seconds of one small Allreduce of a freshly computed array (the best of
    ``repeats``: a shared machine's other load must not settle in the cached figure)."""
    if comm.size == 1:
        return 0.0
    x = mx.ones((1, width), mx.float32)
    comm.allreduce(x * 1.0, "sum")
    best = float("inf")
    comm.barrier()
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(comm.allreduce(x * 1.0, "sum"))
        best = min(best, time.perf_counter() - start)
    return max(comm.allgather_object(best))


@contextmanager
def uncounted(comm: Comm):
    """Measurements are not the job's traffic: keep them out of ``comm_bytes`` and waits."""
    sent, waited = comm.bytes_sent, comm.wait_seconds
    try:
        yield
    finally:
        comm.bytes_sent, comm.wait_seconds = sent, waited


def calibration_file(comm: Comm) -> Path:
    """One file per set of hosts, rank count and compute setup: every rank's BLAS line
    (the library, its threads, whether the matrix-vector forward is preloaded), whether
    its attention takes the compiled exp, its allocator and whether its buffers are on huge
    pages are in the key, since the rates measured depend on them (the forward triples
    decode's read rate, the exp doubles attention's, huge pages change how fast weights
    stream)."""
    from ..blas import describe_blas
    from ..runtime.allocator import describe as allocator
    from ..runtime.huge_pages import describe as huge_pages

    hosts = comm.allgather_object(socket.gethostname())
    blas = comm.allgather_object([describe_blas()["line"], polynomial_exp_enabled(),
                                  allocator(), huge_pages()])
    key = hashlib.sha256(json.dumps([hosts, comm.size, blas]).encode()).hexdigest()[:16]
    # "v5": the time and load average of the measurement beside the figures; "v4":
    # transfer_drag added; "v3": the stream rate of decode's W @ x on the CPU (v2
    # timed x @ W.T, 1.5x slower). Versions before v2 read calibration-<key>.json and
    # fail on unknown fields, so the formats keep apart (hosts running either version
    # can share one cache).
    return cache_dir() / f"calibration-v5-{key}.json"


FIELDS = {f.name for f in dataclasses.fields(LinkAndCompute)}
# A re-measured decode figure this many times off the file's replaces the file.
STALE_FACTOR = 2.0
log = logging.getLogger("spmd_cp")


def read_calibration(path: Path) -> dict | None:
    """The file's record (the figures, ``measured_at``, ``load_average``), or None when
    it is missing, unreadable or written by another version."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not FIELDS <= set(record):
        return None
    return record


def write_calibration(path: Path, measured: LinkAndCompute):
    """Rank 0: the figures with when and under what load they were taken, replaced
    atomically (ranks of other jobs may read it meanwhile)."""
    record = {**measured.__dict__,
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "load_average": round(os.getloadavg()[0], 2)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.name}.{os.getpid()}")
        scratch.write_text(json.dumps(record))
        os.replace(scratch, path)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time


def calibrate(comm: Comm, recalibrate: bool = False) -> LinkAndCompute:
    """The measurements for these ranks: from the on-disk cache, else measured now."""
    path = calibration_file(comm)
    cached = None
    if comm.rank == 0 and not recalibrate:
        record = read_calibration(path)
        cached = record and {k: record[k] for k in FIELDS}
    cached = comm.bcast_object(cached)
    if cached is not None:
        return LinkAndCompute(**cached)
    with uncounted(comm):
        flops = min(comm.allgather_object(measure_attention_flops()))
        bandwidth, latency = measure_ring(comm)
        copy = min(comm.allgather_object(measure_copy()))
        measured = LinkAndCompute(flops, bandwidth, latency, copy, measure_stream(comm),
                                  measure_collective(comm),
                                  measure_transfer_drag(comm, bandwidth))
    if comm.rank == 0:
        write_calibration(path, measured)
    return measured


# --decode-tp auto's figures at the decision: this many samples of each, and the low
# quantile of them that decides (a moment's load on a shared machine lifts some samples,
# never lowers them; the quantile, not the minimum, so that one lucky sample does not
# decide either).
DECODE_SAMPLES = 9
DECODE_QUANTILE = 0.25


def low_quantile(samples: list[float], q: float = DECODE_QUANTILE) -> float:
    """The ``q`` quantile of ``samples`` (linear between the order statistics)."""
    ordered = sorted(samples)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (at - low) * (ordered[high] - ordered[low])


def sample_stream(comm: Comm, samples: int = DECODE_SAMPLES, nbytes=64 << 20) -> list[float]:
    """``samples`` weight read rates (bytes/s), each the slowest rank's, every rank at
    once (``measure_stream``'s product)."""
    return stream_samples(comm, nbytes, samples)


def measure_request_collective(comm: Comm, width=1024, repeats=20) -> float:
    """Seconds of one small Allreduce as the native decode step runs its collectives
    (engine/decode/native_decode.py): a persistent MPI request on host buffers, started and
    waited, or the blocking call where the library has no persistent collectives. No
    MLX array crosses to the host, so this is a bare MPI latency: over shared memory a
    few microseconds where ``measure_collective``'s round trip takes about 100. The best
    of ``repeats`` on a rank, the slowest rank's of those."""
    if comm.size == 1:
        return 0.0
    from mpi4py import MPI

    send = np.ones(width, np.float32)
    receive = np.empty_like(send)
    try:
        request = comm.mpi.Allreduce_init(send, receive, op=MPI.SUM)
    except NotImplementedError:  # MPI before 4: no persistent collectives
        request = None

    def once():
        if request is None:
            comm.mpi.Allreduce(send, receive, op=MPI.SUM)
        else:
            request.Start()
            request.Wait()

    once()
    comm.barrier()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - start)
    if request is not None:
        request.Free()
    return max(comm.allgather_object(best))


def sample_collective(comm: Comm, samples: int = DECODE_SAMPLES, width=1024,
                      repeats: int = 4, measure=measure_collective) -> list[float]:
    """``samples`` costs of one small collective (seconds), each the best of ``repeats``
    on a rank and the slowest rank's of those; ``measure``: ``measure_collective`` (an
    MLX array's round trip) or ``measure_request_collective`` (the native step's)."""
    if comm.size == 1:
        return [0.0]
    return [measure(comm, width, repeats) for _ in range(samples)]


def recheck_decode_figures(comm: Comm, measured: LinkAndCompute,
                           samples: dict | None = None) -> LinkAndCompute:
    """Collective: ``measured`` with the weight read rate and the collective cost
    measured again now, ``DECODE_SAMPLES`` times each, their ``DECODE_QUANTILE``
    (the high quantile of the rates: a loaded machine reads slower) deciding; the file
    replaced when either is more than ``STALE_FACTOR`` off. Every rank gets the same
    figures. ``samples``, if given, receives the samples (the decode plan records them)."""
    path = calibration_file(comm)  # collective: every rank, before rank 0 alone writes
    with uncounted(comm):
        streams = sample_stream(comm)
        collectives = sample_collective(comm)
    stream = low_quantile(streams, 1 - DECODE_QUANTILE)
    collective = low_quantile(collectives)
    if samples is not None:
        samples.update(stream_bytes_per_s=streams, collective_s=collectives,
                       quantile=DECODE_QUANTILE)
    fresh = dataclasses.replace(measured, stream_bytes_per_s=stream, collective_s=collective)
    off = [name for name, old, new in (("weight read rate", measured.stream_bytes_per_s, stream),
                                       ("collective", measured.collective_s, collective))
           if min(old, new) > 0 and max(old, new) / min(old, new) > STALE_FACTOR]
    if off and comm.rank == 0:
        log.info("calibration: the cached %s differed from what the ranks measure now by "
                 "over %gx (collective %.0f us, was %.0f us; weight reads %.1f GB/s, were "
                 "%.1f GB/s): the file is replaced", " and ".join(off), STALE_FACTOR,
                 1e6 * collective, 1e6 * measured.collective_s, stream / 1e9,
                 measured.stream_bytes_per_s / 1e9)
        write_calibration(path, fresh)
    return fresh
