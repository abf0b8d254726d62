"""Measure, on the actual ranks, the two numbers the auto algorithm choice needs.

- attention FLOP/s: block attention of a representative tile on every rank (slowest wins);
- ring bandwidth and latency: a Sendrecv around the ring (slowest link wins).

Measured once per set of hosts and rank count and cached on disk, so later runs pay
nothing; ``spmd-cp doctor --recalibrate`` measures again.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from .block import block_attention
from .choose import LinkAndCompute
from ..runtime.paths import cache_dir
from ..runtime.comm import Comm



def measure_attention_flops(num_heads=8, num_kv_heads=2, head_dim=64, tq=256, tk=1024,
                            repeats=3) -> float:
    """FLOP/s of block attention (QK^T and PV: 4 * NH * Tq * Tk * d FLOPs per call)."""
    q = mx.random.normal((num_heads, tq, head_dim))
    k = mx.random.normal((num_kv_heads, tk, head_dim))
    v = mx.random.normal((num_kv_heads, tk, head_dim))
    q_pos = np.full(tq, tk, np.int64)  # every key visible: a full tile of work
    k_pos = np.arange(tk, dtype=np.int64)
    mx.eval(block_attention(q, k, v, q_pos, k_pos, 0.125))  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(block_attention(q, k, v, q_pos, k_pos, 0.125))
        best = min(best, time.perf_counter() - start)
    return 4 * num_heads * tq * tk * head_dim / best


def measure_ring(comm: Comm, nbytes=8 << 20, repeats=3) -> tuple[float, float]:
    """(bytes/s per direction, one-step latency in s) of a ring Sendrecv; slowest rank's."""
    if comm.size == 1:
        return float("inf"), 0.0
    results = []
    for size in (8, nbytes):
        send = np.ones(size // 4, np.float32)
        recv = np.empty_like(send)
        comm.barrier()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            comm.mpi.Sendrecv(send, comm.ring_next, 0, recv, comm.ring_prev, 0)
            best = min(best, time.perf_counter() - start)
        results.append(max(comm.allgather_object(best)))
    latency, bulk = results
    return nbytes / max(bulk - latency, 1e-9), latency


def calibration_file(comm: Comm) -> Path:
    hosts = comm.allgather_object(socket.gethostname())
    key = hashlib.sha256(json.dumps([hosts, comm.size]).encode()).hexdigest()[:16]
    return cache_dir() / f"calibration-{key}.json"


def calibrate(comm: Comm, recalibrate: bool = False) -> LinkAndCompute:
    """The measurements for these ranks: from the on-disk cache, else measured now."""
    path = calibration_file(comm)
    cached = None
    if comm.rank == 0 and not recalibrate and path.is_file():
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError):
            cached = None  # unreadable: measure again
    cached = comm.bcast_object(cached)
    if cached is not None:
        return LinkAndCompute(**cached)
    flops = min(comm.allgather_object(measure_attention_flops()))
    bandwidth, latency = measure_ring(comm)
    measured = LinkAndCompute(flops, bandwidth, latency)
    if comm.rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(measured.__dict__))
        except OSError:
            pass  # a read-only home only costs a re-measurement next time
    return measured
