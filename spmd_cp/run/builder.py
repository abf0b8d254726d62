"""A command's run built on every rank: the model checked and loaded, the run's auto
settings decided once, the engine opened over them.

generate, score, batch and serve build through ``RunBuilder`` in the same order: check
the model on every rank (agreeing on errors, before anything heavy), load it, settle the
auto settings (``--prefill-chunk``, ``--kv-dtype``: the decode plan's rule), open the
engine, whose decode plan decides every decode mode (engine/decode/decode_plan.py). doctor and
the benchmarks call the same steps. Rank 0's own validation (inputs, outputs, flags)
stays with each front end (cli/, server/); this module imports neither.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from dataclasses import dataclass

from ..attention.exp import use_polynomial_exp
from ..blas import describe_blas
from ..config import DecodeConfig, RunConfig
from ..engine.afd.afd_engine import open_afd_engine
from ..engine.afd.afd_load import load_afd_share
from ..engine.decode.decode_plan import AUTO_KV_HALF, choose_kv_dtype
from ..engine.engine import Engine
from ..engine.decode.native_eligibility import native_obstacle, upfront_obstacle
from ..engine.weights.sharded_model import build_cp_model
from ..engine.startup import require_same_path
from ..engine.weights.tensor_load import load_tensor_share
from ..errors import UserError
from ..models import hub
from ..models.checksum import model_checksum
from ..models.loader import check_model_path, default_model_path, load_model
from ..models.partial_load import load_rank_share
from ..models.quantized_shadows import SHADOWS
from ..runtime import allocator, huge_pages, scheduling, spmd
from ..runtime.afd import AfdRoles
from ..runtime.comm import Comm
from ..runtime.device import Compute, compiled_kernels_work
from ..runtime.faults import layer_hook
from ..runtime.grid import Grid
from .grid_checks import check_grid, keep_quantized_hint
from .sharding import wants_sharding

log = logging.getLogger("spmd_cp")


@dataclass(frozen=True)
class ModelIdentity:
    """The model every rank checked: its path on this host and its files' sha256."""
    path: str
    checksum: str


class RunBuilder:
    """One command's run, built in order on every rank: ``check`` (the model found and
    the same everywhere), ``load`` (its weights, then the run's auto settings settled:
    ``run`` is the settled configuration from then on), ``engine``. ``decode``: the
    decode flags where decode steps follow (None: none do, as in ``score``)."""

    def __init__(self, comm: Comm, run: RunConfig, decode: DecodeConfig | None = None):
        self.comm, self.run, self.decode = comm, run, decode
        self.identity: ModelIdentity | None = None
        self.loaded = None

    def check(self) -> ModelIdentity:
        self.identity = ModelIdentity(*check_model(self.comm, self.run, self.decode))
        return self.identity

    def load(self):
        """The checked model loaded (checked first where ``check`` was not called), and
        ``run`` settled against it."""
        identity = self.identity or self.check()
        self.loaded = load_checked_model(self.comm, self.run, identity.path)
        self.run = settle_run(self.comm, self.loaded, self.run, self.decode)
        return self.loaded

    def engine(self) -> Engine:
        """The engine over the loaded model (loaded first where ``load`` was not called)."""
        if self.loaded is None:
            self.load()
        return make_engine(self.comm, self.loaded, self.run, self.decode or DecodeConfig())


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
        kv_dtype = AUTO_KV_HALF if run.kv_dtype == "auto" else run.kv_dtype
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


def load_checked_model(comm: Comm, run: RunConfig, path: str):
    """Load the model ``check_model`` accepted, on every rank: a quantized model's
    matrices held packed (decode reads them so, a prefill a tile at a time; score's
    prefill too), unless ``--no-quantized-decode`` or on the GPU path (``--device gpu`` on
    a CPU too)."""
    # (--tp cuts the matrices MLX computes with: no packed forms)
    decode = run.quantized_decode and not compute_of(run).gpu and run.tp == 1 \
        and run.afd is None
    start = time.perf_counter()
    if run.afd is not None:  # each side reads its part (engine/afd/afd_load.py)
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


# --prefill-chunk auto: mlx-lm's prefill step on the GPU path at one rank. There the
# whole prompt in one fused call peaked at 2.7-3.0x mlx-lm's memory on an H100 (8K and 32K
# tokens, docs/GPU.md); in mlx-lm's steps one rank runs mlx-lm's own shapes. Ranks of a
# larger job hold a shard each (N = 2 measured 0.99-1.02x mlx-lm's peak) and a chunk would
# send the cache around the ring again; the CPU path's tiled attention bounds its
# activations as the forecast models them (engine/cache/forecast.py): both take it whole.
GPU_PREFILL_STEP = 2048


def settle_run(comm: Comm, loaded, run: RunConfig,
               decode: DecodeConfig | None = None) -> RunConfig:
    """``run`` with its auto settings decided once, the same on every rank, before the
    engine, the forecast and any prefill: ``--prefill-chunk``, ``--kv-dtype`` (the
    decode plan's rule, decode_plan.choose_kv_dtype; rank 0 logs it and why)."""
    run = settle_prefill_chunk(comm, run)
    if run.kv_dtype != "auto":
        return run
    compute = compute_of(run)
    chosen, why = choose_kv_dtype(comm, loaded, run, compute, decode)
    if comm.rank == 0 and not compute.gpu:
        log.info("--kv-dtype auto: %s (%s)", chosen, why)
    return dataclasses.replace(run, kv_dtype=chosen)


def settled(run: RunConfig) -> bool:
    """Whether ``settle_run`` has decided ``run``'s auto settings."""
    return run.prefill_chunk is not None and run.kv_dtype != "auto"


def settle_prefill_chunk(comm: Comm, run: RunConfig) -> RunConfig:
    """``run`` with ``--prefill-chunk`` auto decided (GPU_PREFILL_STEP says how)."""
    if run.prefill_chunk is not None:
        return run
    chunk = GPU_PREFILL_STEP if compute_of(run).gpu and comm.size == 1 else 0
    if chunk and comm.rank == 0:
        log.info("--prefill-chunk auto: %d (mlx-lm's prefill step, on the GPU path at one "
                 "rank)", chunk)
    return dataclasses.replace(run, prefill_chunk=chunk)


def refuse_native_decode(obstacle: str | None):
    """``--decode-step native`` where this rank cannot run it: one line naming why."""
    if obstacle:
        raise UserError(f"--decode-step native: {obstacle}")


def make_engine(comm: Comm, loaded, run: RunConfig,
                decode: DecodeConfig = DecodeConfig()) -> Engine:
    """The engine over the loaded model and the CP x TP grid of ``--tp`` (its groups
    split here, once; the model was loaded as this rank's slices); with ``--decode-step
    native``, refused here, before any prompt is prefilled, where any rank's model rules
    the native step out (the same rules the decode plan applies). ``run``: settled
    (``settle_run``), so that the engine, the forecast and the prefill read one answer."""
    if not settled(run):
        raise ValueError("make_engine: settle_run decides the run's auto settings first")
    compiled_kernels_work()  # else compilation is off from here on (runtime/device.py)
    use_polynomial_exp(run.fast_exp)
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


