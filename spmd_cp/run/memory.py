"""The memory forecast a command checks on rank 0 before any prefill (engine/cache/forecast.py
models it): what the busiest rank will hold against ``--memory-limit``."""

from __future__ import annotations

from ..config import RunConfig
from ..engine.cache.forecast import check_fits, default_memory_limit, parse_bytes
from ..engine.model import kv_model_shape
from ..engine.weights.tensor_groups import tensor_share
from ..runtime.afd import AfdRoles
from ..runtime.comm import Comm
from ..runtime.device import Compute
from ..runtime.resident import outside_mlx_bytes
from ..runtime.spmd import log
from .metrics import model_nbytes
from .sharding import weight_plan


def memory_limit(run: RunConfig) -> int:
    return parse_bytes(run.memory_limit) if run.memory_limit else default_memory_limit()


def cp_ranks(run: RunConfig, ranks: int) -> int:
    """The ranks that split the sequence: the attention ranks of ``--afd``, else one a
    TP group."""
    return AfdRoles.of(run.afd, ranks).attention if run.afd else ranks // run.tp


def forecast_algo(run: RunConfig) -> str:
    # auto picks per call; pass-KV's buffers bound what the others need.
    return "pass-kv" if run.cp_algo == "auto" else run.cp_algo


def replicated_bytes(comm: Comm, loaded, run: RunConfig, split_decode: bool) -> int:
    """The weights a rank holds (with --tp, its slices), and the split step's copies
    where it may run: counted once a model and layout (the weights do not change once
    loaded and settled), as serve forecasts every request."""
    from ..engine.decode.decode_choice import split_copy_bytes
    from ..models.quantized_shadows import SHADOWS

    split = split_decode and getattr(loaded, "share", None) is None and run.tp == 1 \
        and run.afd is None
    # A shadow registered or released since changes the count (the split step's
    # copies register when it is first built).
    key = (comm.size, split, SHADOWS.generation)
    if key not in loaded.weight_bytes_by_layout:
        total = model_nbytes(loaded.model)
        if split:
            total += split_copy_bytes(loaded.model.model, comm.size)
        loaded.weight_bytes_by_layout[key] = total
    return loaded.weight_bytes_by_layout[key]


def check_memory(comm: Comm, loaded, run: RunConfig, total_tokens: int, new_tokens: int,
                 score: bool = False, split_decode: bool = False,
                 process_bytes: int | None = None, window_tail: int | None = None,
                 **server_parts) -> dict:
    """Refuse before prefill when the forecast per rank exceeds --memory-limit; else the
    forecast (``--json``'s ``memory_forecast``). ``split_decode``: decode steps follow
    and may run split (``--decode-tp`` on or auto): its copied slices count as weights
    (replicated weights; with sharded ones they are not forecast); the busiest rank's,
    as every one of the forecast's parts. ``process_bytes``: the most any rank holds
    outside MLX (None: this rank's, measured now); ``window_tail``: where sliding-window
    layers drop the keys behind their windows, the tokens after the prompt (None: every
    key is kept); ``server_parts``: forecast_rank_bytes's ``held_kv_tokens`` and
    ``buffer_cache_bytes``."""
    limit = memory_limit(run)
    weights = weight_plan(loaded, replicated_bytes(comm, loaded, run, split_decode),
                          run.keep_quantized)
    compute = Compute.resolve(run.device, run.attention_kernel)
    shape = tensor_share(kv_model_shape(loaded, run.kv_dtype, compute), run.tp)
    need = check_fits(shape, weights,
                      total_tokens, min(run.prefill_chunk or new_tokens, new_tokens),
                      cp_ranks(run, comm.size), limit, forecast_algo(run), score,
                      process_bytes=outside_mlx_bytes() if process_bytes is None
                      else process_bytes, window_tail=window_tail, **server_parts)
    log.info("memory forecast per rank: %.2f GB (KV %.2f GB, %.2f GB outside MLX) of %.2f GB "
             "allowed", need.total / 2**30, need.kv / 2**30, need.process / 2**30,
             limit / 2**30)
    return need.as_dict()
