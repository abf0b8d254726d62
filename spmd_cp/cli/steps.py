"""Steps every command that runs the model shares, on every rank inside the SPMD runtime.

Order inside each command: validate on rank 0 (cheap, before anything heavy: inputs,
outputs, flags), check the model on every rank (agreeing on errors), load it, tokenize
on rank 0 and broadcast the ids, run the engine, gather per-rank metrics to rank 0, print.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import sys
import time

from ..attention.exp import use_polynomial_exp
from ..blas import describe_blas
from ..config import DecodeConfig, RunConfig
from ..engine.afd_engine import open_afd_engine
from ..engine.afd_load import load_afd_share
from ..engine.engine import Engine
from ..engine.model import CPModel
from ..engine.native_eligibility import flag_obstacle, native_obstacle, upfront_obstacle
from ..models.quantized_shadows import SHADOWS
from ..engine.sharded_model import build_cp_model
from ..engine.tensor_load import load_tensor_share
from ..engine.startup import require_same_path
from ..errors import UserError
from ..models import hub
from ..models.checksum import model_checksum, model_files
from ..models.loader import check_model_path, default_model_path, load_model
from ..models.partial_load import load_rank_share
from ..runtime import allocator, huge_pages, scheduling, spmd
from ..runtime.comm import Comm
from ..runtime.device import Compute, compiled_kernels_work
from ..runtime.faults import layer_hook
from ..runtime.afd import AfdRoles
from ..runtime.grid import Grid
from .grid_checks import check_grid, keep_quantized_hint
from ..run.memory import check_memory, cp_ranks, forecast_algo, memory_limit  # noqa: F401
from ..run.metrics import model_bytes, model_nbytes, rank_metrics  # noqa: F401 (steps.*)
from ..run.prompts import cap_to_context, tokenize_checked  # noqa: F401 (steps.*)
from .outputs import Output
from .retired import honour_retired
from ..run.sharding import wants_sharding

log = spmd.log


def run_spmd(body, run: RunConfig, *settings) -> int:
    """``body(comm, run, *settings)`` on every rank inside ``spmd.run_main`` (MPI, the
    watchdog, agreement on errors, abort); returns the exit code."""
    def main(comm, _):
        if run.quiet:
            log.setLevel(logging.WARNING)
        body(comm, spmd.everywhere(comm, honour_retired, run, comm.rank == 0), *settings)

    # run_main itself reads only these two settings.
    return spmd.run_main(main, {"verbose": run.verbose, "trace": run.trace})


# -- inputs (rank 0) -------------------------------------------------------------------
def read_prompt(prompt: str | None, prompt_file: str | None, run: RunConfig) -> str:
    """The prompt text from --prompt TEXT, --prompt - (stdin) or --prompt-file F (rank 0;
    ``--prompt-file -`` reads stdin too), read with the bound of cli/inputs.py."""
    if (prompt is None) == (prompt_file is None):
        raise UserError("give exactly one of --prompt TEXT, --prompt - or --prompt-file FILE")
    if prompt_file is not None:
        return read_text_file(prompt_file, "prompt file", run)
    if prompt == "-":
        return read_text_file("-", "prompt", run)
    if not prompt.strip():
        raise UserError("the prompt is empty")
    return prompt


def read_text_file(path: str, what: str, run: RunConfig) -> str:
    """A UTF-8 text input (``-``: standard input), bounded by the model's context."""
    from .inputs import input_bound, read_text, read_timeout

    bound = input_bound(run.max_context, run.model_path, run.memory_limit)
    return read_text(path, what, bound, read_timeout(run.comm_timeout))


def model_inputs(run: RunConfig) -> dict[str, list]:
    """The model's files as inputs an output must not replace (rank 0; never fails: a
    missing model is reported by ``check_model`` with its own message)."""
    path = run.model_path or default_model_path()
    try:
        files = model_files(path)
    except UserError:
        files = []
    return {"the model": [path, *files]}


# -- the model (every rank) ------------------------------------------------------------
def compute_of(run: RunConfig) -> Compute:
    """The run's compute path and attention kernel (runtime/device.py), from its flags."""
    return Compute.resolve(run.device, run.attention_kernel)


def check_model(comm: Comm, run: RunConfig,
                decode: DecodeConfig | None = None) -> tuple[str, str]:
    """(path, sha256) of the model, the same on every rank, before anything is loaded.

    Each rank checks its own copy (it may be missing or differ on one host).
    ``decode``: the decode flags, where decode steps follow (``--decode-step native``
    is refused here where the settings alone rule it out).
    """
    spmd.everywhere(comm, check_grid, run, comm.size, decode)
    spmd.require_same(comm, "package versions", spmd.software_versions())
    require_same_path(comm, compute_of(run))
    spmd.everywhere(comm, scheduling.requested)
    spmd.everywhere(comm, huge_pages.requested)
    spmd.everywhere(comm, allocator.requested)
    path = model_location(comm, run.model_path)
    spmd.everywhere(comm, check_model_path, path)
    if decode is not None and decode.decode_step == "native":
        sharded = spmd.on_root(comm, wants_sharding, run, path, comm.size, run.quantized_decode)
        # auto never settles on a dtype the native step cannot read
        kv_dtype = AUTO_KV_FALLBACK if run.kv_dtype == "auto" else run.kv_dtype
        spmd.everywhere(comm, lambda: refuse_native_decode(upfront_obstacle(
            decode, compute_of(run), kv_dtype, sharded)))
    checksum = spmd.everywhere(comm, model_checksum, path)
    spmd.require_same(comm, "model file checksum", checksum)
    return path, checksum


def model_location(comm: Comm, spec: str | None) -> str:
    """Every rank: where --model is on its host. A path is used as it is; a Hugging Face
    repo id (``org/name``) is fetched into the hub's cache by the first rank of each host
    while the others wait, then every rank reads that cache (one download per host)."""
    if spec is None:
        return spmd.on_root(comm, default_model_path)
    if not spmd.on_root(comm, hub.is_repo_id, spec):
        return spec
    hosts = comm.allgather_object(socket.gethostname())
    first_on_host = hosts.index(hosts[comm.rank]) == comm.rank
    spmd.everywhere(comm, lambda: hub.local_snapshot(spec, download=True)
                    if first_on_host else None)
    path = spmd.everywhere(comm, hub.local_snapshot, spec, download=False)
    if comm.rank == 0:
        log.info("model %s: %s", spec, path)
    return path


def load_checked_model(comm: Comm, run: RunConfig, path: str, decode: bool = True):
    """Load the model ``check_model`` accepted, on every rank. ``decode``: hold a
    quantized model's matrices packed (decode reads them so, a prefill a tile at a time:
    generate, batch, serve and score do), unless ``--no-quantized-decode`` or on the GPU
    path (``--device gpu`` on a CPU too)."""
    # (--tp cuts the matrices MLX computes with: no packed forms)
    decode = decode and run.quantized_decode and not compute_of(run).gpu and run.tp == 1 \
        and run.afd is None
    start = time.perf_counter()
    if run.afd is not None:  # each side reads its part (engine/afd_load.py)
        hint = keep_quantized_hint(run, path) if comm.rank == 0 else None
        if hint:
            log.info(hint)
        loaded = spmd.everywhere(comm, load_afd_share, path, AfdRoles.of(run.afd, comm.size),
                                 comm.rank, run.keep_quantized)
    elif run.tp > 1:  # world rank r is TP rank r % T of its group (runtime/grid.py)
        hint = keep_quantized_hint(run, path) if comm.rank == 0 else None
        if hint:
            log.info(hint)
        loaded = spmd.everywhere(comm, load_tensor_share, path, comm.rank % run.tp, run.tp,
                                 run.keep_quantized)
    elif spmd.on_root(comm, wants_sharding, run, path, comm.size, decode):
        log.info("--shard-weights: each rank loads layers i mod %d and 1/%d of the vocabulary",
                 comm.size, comm.size)
        loaded = spmd.everywhere(comm, load_rank_share, path, comm.rank, comm.size,
                                 run.keep_quantized)
    else:
        # packed_only: a quantized model's matrices held as the file stores them
        # (models/packed_load.py), where decode reads them packed
        loaded = spmd.everywhere(comm, load_model, path, run.keep_quantized, decode,
                                 run.weight_cache, True)
    # From here on every rank is in lockstep: a long wait means a peer is gone.
    spmd.hot_phase(comm, run.comm_timeout)
    allocator.release_free_memory()  # the load's copies, before the forecast measures
    blas_info = describe_blas()
    packed = f"; {SHADOWS.describe()}" if SHADOWS.active else ""
    log.info("model %s loaded in %.1fs; %s%s; malloc: %s; huge pages: %s", loaded.path,
             time.perf_counter() - start, blas_info.get("summary", blas_info), packed,
             allocator.describe(), huge_pages.describe())
    return loaded


def resolve_model(comm: Comm, run: RunConfig, decode: DecodeConfig | None = None):
    """Check the model on every rank, then load it. ``decode``: the decode flags where
    decode steps follow (None: none do, as in ``score``)."""
    path, _ = check_model(comm, run, decode)
    return load_checked_model(comm, run, path, decode is not None)


# --kv-dtype auto: a half-precision cache where the native decode step reads it (its
# attention widens keys and values in registers: a step reads half the cache bytes,
# docs/CPU_SPEED.md), float32 elsewhere (MLX's steps and a scoring pass read a half
# cache back into float32 whole, for nothing, and float32's scores are mlx-lm's).
AUTO_KV_HALF = "float16"
AUTO_KV_FALLBACK = "float32"


# --prefill-chunk auto: mlx-lm's prefill step on the GPU path at one rank. There the
# whole prompt in one fused call peaked at 2.7-3.0x mlx-lm's memory on an H100 (8K and 32K
# tokens, docs/GPU.md); in mlx-lm's steps one rank runs mlx-lm's own shapes. Ranks of a
# larger job hold a shard each (N = 2 measured 0.99-1.02x mlx-lm's peak) and a chunk would
# send the cache around the ring again; the CPU path's tiled attention bounds its
# activations as the forecast models them (engine/forecast.py): both take it whole.
GPU_PREFILL_STEP = 2048


def settle_run(comm: Comm, loaded, run: RunConfig,
               decode: DecodeConfig | None = None) -> RunConfig:
    """``run`` with its auto settings decided once, the same on every rank, before the
    engine, the forecast and any prefill: ``--prefill-chunk``, ``--kv-dtype``."""
    return settle_kv_dtype(comm, loaded, settle_prefill_chunk(comm, run), decode)


def settle_prefill_chunk(comm: Comm, run: RunConfig) -> RunConfig:
    """``run`` with ``--prefill-chunk`` auto decided (GPU_PREFILL_STEP says how)."""
    if run.prefill_chunk is not None:
        return run
    chunk = GPU_PREFILL_STEP if compute_of(run).gpu and comm.size == 1 else 0
    if chunk and comm.rank == 0:
        log.info("--prefill-chunk auto: %d (mlx-lm's prefill step, on the GPU path at one "
                 "rank)", chunk)
    return dataclasses.replace(run, prefill_chunk=chunk)


def settle_kv_dtype(comm: Comm, loaded, run: RunConfig,
                    decode: DecodeConfig | None = None) -> RunConfig:
    """``run`` with ``--kv-dtype auto`` decided once, the same on every rank (collective
    where it is auto), before the engine, the forecast and any prefill: float16 where
    decode steps follow (``decode``: their flags; None: none do) and every rank can run
    them natively (the rules the decode plan applies, native_eligibility.py), else
    float32 (batched steps (--max-batch) follow the same rule: they run natively where
    one sequence's step does, else in MLX, which widens a half cache on the CPU each
    layer; by hand, one rank, 3K keys: their attention 77 vs 23 ms a step). Rank 0 logs the choice
    and its reason. The GPU path keeps the model's dtype whatever this says."""
    if run.kv_dtype != "auto":
        return run
    compute = compute_of(run)
    if compute.gpu:
        return dataclasses.replace(run, kv_dtype=AUTO_KV_FALLBACK)  # not read there
    if decode is None:
        reason = "no decode steps follow"
    elif getattr(loaded, "share", None) is not None:
        reason = "layer-sharded weights decode in MLX's step"
    elif run.tp > 1:
        reason = "tensor-parallel slices (--tp) decode in MLX's step"
    elif run.afd is not None:
        reason = "--afd's attention ranks decode in MLX's step"
    else:
        reason = flag_obstacle(decode) or spmd.first_reason(comm, native_obstacle(
            CPModel(loaded.model, None, AUTO_KV_FALLBACK, compute)))
    chosen = AUTO_KV_FALLBACK if reason else AUTO_KV_HALF
    if comm.rank == 0:
        log.info("--kv-dtype auto: %s (%s)", chosen,
                 f"the decode step is MLX's: {reason}" if reason and decode is not None
                 else reason or "decode steps run natively")
    return dataclasses.replace(run, kv_dtype=chosen)


def refuse_native_decode(obstacle: str | None):
    """``--decode-step native`` where this rank cannot run it: one line naming why."""
    if obstacle:
        raise UserError(f"--decode-step native: {obstacle}")


def make_engine(comm: Comm, loaded, run: RunConfig,
                decode: DecodeConfig = DecodeConfig()) -> Engine:
    """The engine over the loaded model and the CP x TP grid of ``--tp`` (its groups
    split here, once; the model was loaded as this rank's slices); with ``--decode-step
    native``, refused here, before any prompt is prefilled, where any rank's model rules
    the native step out (the same rules the decode plan applies)."""
    compiled_kernels_work()  # else compilation is off from here on (runtime/device.py)
    use_polynomial_exp(run.fast_exp)
    run = settle_run(comm, loaded, run, decode)  # where the command has not yet
    if run.afd is not None:
        return open_afd_engine(comm, loaded, run, decode, compute_of(run),
                               layer_hook(comm.rank, comm.watchdog, run.fault))
    grid = Grid.of(comm, run.tp)
    model = build_cp_model(loaded, comm, run.kv_dtype, compute_of(run), grid.tp,
                           getattr(loaded, "vocab_rows", None))
    if grid.tp is not None and comm.rank == 0:
        log.info("--tp %d: %s; each rank holds its slices of every matrix", run.tp,
                 grid.describe())
    if decode.decode_step == "native":
        refuse_native_decode(spmd.first_reason(comm, native_obstacle(model)))
    return Engine(model, comm, algo=run.cp_algo, prefill_chunk=run.prefill_chunk,
                  on_layer=layer_hook(comm.rank, comm.watchdog, run.fault), decode=decode,
                  grid=grid)


# -- results ---------------------------------------------------------------------------
def algos_used(engine: Engine) -> str:
    return ",".join(sorted(set(engine.algos_used)))


def throughput(tokens: int, seconds: float) -> float:
    return round(tokens / seconds, 3) if tokens and seconds > 0 else 0.0


def write_stdout(text: str):
    sys.stdout.write(text)
    sys.stdout.flush()


def trace_output(run: RunConfig) -> Output:
    return Output("--trace", run.trace)


# -- conversations (rank 0; generate and batch build the same text) --------------------
def new_conversation(system: str | None) -> dict:
    """What a prompt cache remembers of the exchange so far."""
    return {"messages": [{"role": "system", "content": system}] if system else [], "text": ""}


def prompt_text_for(loaded, conversation: dict, prompt: str, chat: bool) -> str:
    """The full text to tokenize: the conversation so far plus the new user prompt."""
    return prompt_parts_for(loaded, conversation, prompt, chat)[0]


def prompt_parts_for(loaded, conversation: dict, prompt: str, chat: bool) -> tuple[str, list]:
    """(the full text to tokenize, where each message's content lies in it)."""
    from ..run.prompts import render

    return render(loaded, conversation, prompt, chat)


def extend_conversation(conversation: dict, prompt: str, answer: str) -> dict:
    messages = conversation["messages"] + [{"role": "user", "content": prompt.strip()},
                                           {"role": "assistant", "content": answer}]
    return {"messages": messages, "text": conversation["text"] + prompt + answer}
