"""What a run reports about its MLX backend, and the warm-up that keeps compile time out
of the timed prefill.

On a GPU the first call of every kernel shape compiles it: on an H100 through MLX's
CUDA backend a first 2K-token score took 22-26 s and about 1 s after. On the GPU path a
tiny prefill and one decode step run first, on a throwaway cache, and the ``--json``
summaries report that time as ``warmup_s`` apart from ``ttft_s`` / ``prefill_s``. On
the CPU nothing is compiled: no warm-up, ``warmup_s`` is 0 and the timings are as
before.
"""

from __future__ import annotations

import time
from contextlib import ExitStack

import numpy as np

from ..attention.calibrate import uncounted
from ..runtime.comm import Comm
from ..runtime.device import BackendInfo, Compute
from .engine import Engine

WARMUP_TOKENS_PER_RANK = 4  # every rank gets query rows in both head-tail chunks


def require_same_path(comm: Comm, compute: Compute):
    """Every rank must take the same compute path: it fixes the KV dtype, and with it
    the layout of every ring message and decode partial."""
    from ..runtime.spmd import require_same

    require_same(comm, "compute path (MLX backend, or --device)", compute.path)


def startup_fields(engine: Engine, warmup_s: float) -> dict:
    """A summary's ``warmup_s`` and this rank's ``backend``, ``device``, ``compute_path``,
    ``attention_kernel``, ``kv_dtype`` and ``prefill_chunk`` (0: the whole prompt)."""
    compute = engine.model.compute
    dtype = str(engine.model.kv_dtype).removeprefix("mlx.core.")
    return {"warmup_s": round(warmup_s, 6), **BackendInfo.of(compute).as_dict(),
            "attention_kernel": "fused" if compute.fused else "tiled", "kv_dtype": dtype,
            "prefill_chunk": engine.prefill_chunk}


def warm_up(engine: Engine, enabled: bool | None = None, decode: bool = True) -> float:
    """Seconds spent compiling: a tiny prefill and, where ``decode``, one decode step
    through the same attention, dtype and decode plan as the real work (the plan is made
    here, once, and the run keeps it), on a throwaway cache (on every rank: the
    collectives run too). ``enabled`` None: only on the GPU path. Communication bytes are
    not counted."""
    if not (engine.model.compute.gpu if enabled is None else enabled):
        return 0.0
    comm = engine.comm
    start = time.perf_counter()
    # A twin engine: the real one keeps its algorithm log, probes and calibration state.
    twin = engine.twin("pass-kv" if engine.algo == "auto" else engine.algo)
    with ExitStack() as quiet:
        for each in engine.grid.comms:
            quiet.enter_context(uncounted(each))
        cache = twin.new_cache()
        twin.prefill(cache, np.zeros(WARMUP_TOKENS_PER_RANK * engine.cp.size, np.int64))
        if decode:
            engine.prepare_decode()
            twin.adopt_plan(engine)
            twin.decode_step(cache, 0)
        comm.barrier()
    return time.perf_counter() - start
