"""`spmd-cp doctor`: do all ranks run the same thing, and what do the link and the cores give?

    mpiexec -n 2 spmd-cp doctor
    launch/spmd-cp-run --hostfile hosts -- doctor --json
    mpiexec -n 4 spmd-cp doctor --model ~/models/Qwen3-0.6B --recalibrate

Every rank reports its host, its software versions, the sha256 of its copy of the model and
the BLAS its matmuls run on; rank 0 prints them and names every difference. Then the ranks
measure, together, what ``--cp-algo auto`` decides with (ring bandwidth and latency, attention
FLOP/s; spmd_cp.calibrate, cached on disk) and rank 0 prints the crossover that follows.

Exit status: 0 when the ranks agree, 3 when they do not (a model file differs or is missing
on some rank, or a version differs), 2 for bad arguments. docs/DOCTOR.md explains the output.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import socket
import sys
import time

import click

from ..models.checksum import model_checksum
from ..models.gguf_header import head_counts
from .doctor_checks import (EXIT_MISMATCH, SLOW_RANK_FACTOR, afd_report, find_mismatches,
                            find_warnings, grid_report, grid_warnings)
from .doctor_report import print_report
from .options import device_options, grid_option
from ..errors import UserError  # standard library only: importing this module (cli.py does,
# before the BLAS re-exec) must not load MLX or MPI


# -- the auto crossover (pure) -------------------------------------------------------------
def auto_crossover(num_heads: int, num_kv_heads: int, elem_bytes: int, cp_size: int,
                   measured) -> dict:
    """Where spmd_cp.attention.choose switches between pass-KV and pass-Q.

    Returns ``share_threshold`` (2*NKV/NH: pass-KV whenever T/(T+P) reaches it) and
    ``pass_q_below_tokens``: X such that, below the share threshold, pass-Q is chosen
    exactly for T < X new tokens (1: never; None: for every T). X is found by asking
    ``choose_prefill_algo`` itself (a bisection), so it cannot drift from the rule.
    """
    from ..attention.choose import choose_prefill_algo

    result = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "elem_bytes": elem_bytes,
              "cp_size": cp_size, "share_threshold": 2 * num_kv_heads / num_heads,
              "pass_q_below_tokens": None}
    if cp_size == 1:
        result["pass_q_below_tokens"] = 1
        return result

    def is_pass_kv(tokens: int) -> bool:
        cached = 10**40  # T/(T+P) < 1e-21 for every T tried: below any share threshold
        return choose_prefill_algo(tokens, cached, cp_size, num_heads, num_kv_heads,
                                   elem_bytes, measured)[0] == "pass-kv"

    low, high = 1, 1 << 60
    if is_pass_kv(low):
        result["pass_q_below_tokens"] = 1  # pass-Q for T < 1: never
        return result
    if not is_pass_kv(high):
        return result  # pass-Q for any T below the share threshold
    while high - low > 1:  # invariant: pass-Q at low, pass-KV at high
        mid = (low + high) // 2
        low, high = (low, mid) if is_pass_kv(mid) else (mid, high)
    result["pass_q_below_tokens"] = high
    return result


# -- this rank's facts -----------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def local_report(compute) -> dict:
    """This rank's host, versions and BLAS (no model, no communication); ``compute``: the
    run's path (runtime/device.Compute)."""
    import mlx.core as mx
    import mpi4py
    from mpi4py import MPI

    from ..blas import describe_blas, usable_cpus
    from ..engine.decode import native_eligibility
    from ..models import quantized_shadows
    from ..runtime.allocator import describe as allocator
    from ..runtime.device import BackendInfo
    from ..runtime.huge_pages import describe as huge_pages
    from ..runtime.scheduling import scheduling_of_threads

    blas = describe_blas()
    return {
        "host": socket.gethostname(),
        "processor": MPI.Get_processor_name(),
        "pid": os.getpid(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": _version("mlx-lm"),
        "mpi4py": mpi4py.__version__,
        "spmd_cp": _version("spmd-cp"),
        "mpi_library": " ".join(MPI.Get_library_version().splitlines()[0].split()),
        **BackendInfo.of(compute).as_dict(),  # backend, device (with the GPU's name), path
        "cpus": usable_cpus(),
        "blas": blas["name"],
        "blas_kind": blas["kind"],
        "blas_path": blas["path"],
        "blas_threads": blas["threads"],
        "blas_fast": bool(blas["fast"]),
        "blas_line": blas["line"],
        "gemv_forward": blas["gemv_forward"],
        "gemv_forward_skipped": blas["gemv_forward_skipped"],
        "scheduling": scheduling_of_threads(),
        "allocator": allocator(),
        "huge_pages": huge_pages(),
        "quantized_decode": quantized_shadows.availability(),
        "native_decode": native_eligibility.availability(compute),
    }


# -- the command ---------------------------------------------------------------------------
@click.command()
@click.option("--model", "model_path", default=None, metavar="PATH|ORG/NAME",
              help="GGUF file, MLX/HF model directory, or a Hugging Face repo id in this "
                   "host's cache (default: embedded SmolLM2-135M-Instruct).")
@click.option("--recalibrate", is_flag=True,
              help="Measure link and compute again and replace the cached calibration.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON summary as the last stdout line.")
@device_options
@grid_option
def doctor(**options):
    """Check that all ranks agree (versions, model checksum) and measure link and compute."""
    from ..runtime import spmd
    from ..runtime.comm import Comm

    comm = Comm(spmd.import_mpi().COMM_WORLD)
    spmd.setup_logging(comm)
    outcome = {}
    code = (spmd.run(comm, spmd.check_launcher)  # a launcher of another MPI: exit 2
            or spmd.run(comm, doctor_command, options, outcome))
    sys.exit(code or outcome.get("exit_code", 0))


def doctor_command(comm, options: dict, outcome: dict):
    """The body of `spmd-cp doctor` on every rank; sets ``outcome["exit_code"]``."""
    from ..attention.calibrate import measure_attention_flops
    from ..config import RunConfig, from_options
    from ..runtime import spmd
    from .retired import honour_retired
    from .steps import compute_of

    # Rank 0's flags rule: in an MPMD launch ranks may have been given different ones, and
    # every rank must take part in the same collectives.
    flags = comm.bcast_object({"recalibrate": options.pop("recalibrate"),
                               "as_json": options.pop("as_json")})
    (run,) = from_options(options, RunConfig)
    run = spmd.everywhere(comm, honour_retired, run, comm.rank == 0)
    compute = compute_of(run)
    report = local_report(compute)
    hosts = comm.allgather_object(report["host"])
    report.update(check_model(comm, run.model_path, hosts, report["host"]))
    # Every rank's attention speed now, under the load the ranks put on their hosts together:
    # the best of 6 calls after the warm-ups (a fresh process on jemalloc's huge pages
    # ramps up over its first four; docs/CPU_SPEED.md, "The allocator").
    report["attention_flops"] = measure_attention_flops(repeats=6)
    reports = comm.allgather_object(report)
    measured, calibration = run_calibration(comm, flags["recalibrate"])
    decode_collectives = graph_collectives_report(comm, compute)
    problems = find_mismatches(reports)
    plan = None if problems or report["model_error"] else decode_plan_report(
        comm, dataclasses.replace(run, model_path=report["model_path"]))
    outcome["exit_code"] = EXIT_MISMATCH if problems else 0
    if comm.rank != 0:
        return
    warnings = find_warnings(reports, [r["attention_flops"] for r in reports])
    grid = grid_report(hosts, run.tp)
    warnings.extend(grid_warnings(grid))
    if run.afd is not None:
        grid["afd"] = afd_report(hosts, run.afd)
        warnings.extend([grid["afd"]["error"]] if grid["afd"]["error"] else [])
    crossover = None
    if calibration["source"] == "cache":
        warnings.extend(stale_calibration(reports, measured))
    weights = None
    if reports[0]["model_error"] is None:
        crossover = describe_auto(reports[0]["model_path"], attention_ranks(run, comm.size),
                                  measured, warnings, compute)
        # (--afd: each side holds its part, not one of these layouts)
        weights = None if run.afd else describe_weights(reports[0]["model_path"], comm.size,
                                                        warnings)
    summary = {"ok": not problems, "exit_code": outcome["exit_code"], "ranks": comm.size,
               "hosts": list(dict.fromkeys(hosts)), "problems": problems, "warnings": warnings,
               **{key: [r[key] for r in reports] for key in reports[0]},
               "calibration": calibration, "decode_collectives": decode_collectives,
               "auto": crossover, "weights": weights, "decode_plan": plan, "grid": grid}
    print_report(summary)
    if flags["as_json"]:
        print(json.dumps(summary), flush=True)


def check_model(comm, model_path: str | None, hosts: list[str], host: str) -> dict:
    """This rank's model path, checksum and error (every rank checks its own copy)."""
    from ..models import hub
    from ..models.loader import check_model_path, default_model_path

    # Each rank resolves the default itself: in an MPMD launch ranks may name different
    # files, and a missing model must be reported, not deadlock. A hub repo id is looked
    # up in this host's cache only: doctor checks, it does not download.
    error = None
    try:
        model_path = model_path or default_model_path()
        if hub.is_repo_id(model_path):
            model_path = hub.local_snapshot(model_path, download=False)
        check_model_path(model_path)
    except UserError as failure:
        error = str(failure)
    # Ranks sharing a host hash one after the other: the first fills the on-disk cache, the
    # others then only stat() the file instead of reading it again at the same time.
    first_on_host = hosts.index(host) == comm.rank
    checksum, hash_s = None, 0.0
    for turn in (True, False):
        if turn == first_on_host and error is None:
            start = time.perf_counter()
            try:
                checksum = model_checksum(model_path)
            except UserError as failure:
                error = str(failure)
            hash_s = time.perf_counter() - start
        comm.barrier()
    return {"model_path": model_path and os.path.abspath(model_path),
            "model_checksum": checksum, "model_error": error, "checksum_s": round(hash_s, 3)}


def run_calibration(comm, recalibrate: bool):
    """(the calibration auto decides with, its description for the report)."""
    from ..attention.calibrate import (calibrate, calibration_file, read_calibration,
                                       recheck_decode_figures)

    cache_file = calibration_file(comm)
    cached = comm.bcast_object(cache_file.is_file() if comm.rank == 0 else None)
    start = time.perf_counter()
    measured = calibrate(comm, recalibrate=recalibrate)
    seconds = time.perf_counter() - start
    record = comm.bcast_object(read_calibration(cache_file) if comm.rank == 0 else None) or {}
    # What --decode-tp auto will decide with: the decode figures measured again now (a
    # file more than STALE_FACTOR off is replaced).
    fresh = recheck_decode_figures(comm, measured)
    links = ("ring_bytes_per_s", "ring_latency_s", "collective_s")  # null on one rank
    calibration = {
        **{k: (None if k in links and comm.size == 1 else v) for k, v in vars(measured).items()},
        "source": "cache" if cached and not recalibrate else "measured",
        "seconds": round(seconds, 3),
        "file": str(cache_file),
        "measured_at": record.get("measured_at"),
        "load_average": record.get("load_average"),
        "decode_now": {"stream_bytes_per_s": fresh.stream_bytes_per_s,
                       "collective_s": fresh.collective_s if comm.size > 1 else None},
    }
    return measured, calibration


def graph_collectives_report(comm, compute) -> dict | None:
    """Collective: which MLX backend decode's in-graph collectives take on these ranks
    (`--decode-comm auto`), or why none, and one collective's time through it."""
    from ..attention.calibrate import uncounted
    from ..runtime.graph_comm import open_graph_collectives

    if comm.size == 1:
        return None
    graph, reason = open_graph_collectives(comm, "auto", compute=compute)
    with uncounted(comm):
        latency = graph.latency() if graph is not None else None
    return {"opened": graph is not None, "reason": reason, "latency_s": latency}


def attention_ranks(run, ranks: int) -> int:
    """The ranks that run attention: ``--afd``'s attention ranks, else all of them."""
    from ..runtime.afd import AfdRoles, afd_obstacle

    if run.afd is None or afd_obstacle(run.afd, ranks):
        return ranks
    return AfdRoles.of(run.afd, ranks).attention


def decode_plan_report(comm, run) -> dict:
    """Collective: the decode plan `generate` makes on these ranks for ``run.model_path``
    with the default decode flags (engine/decode/decode_plan.py), whole, and the KV cache's
    dtype it settles on: the model is loaded for it (each rank's slices with ``--tp``;
    None where ``--tp`` cannot form groups: a warning says why)."""
    from ..attention.calibrate import uncounted
    from ..config import DecodeConfig
    from ..engine.weights.tensor_load import load_tensor_share
    from ..models.loader import load_model
    from ..engine.afd.afd_load import load_afd_share
    from ..runtime.afd import AfdRoles, afd_obstacle
    from ..runtime.grid import grid_obstacle
    from ..run.builder import make_engine, settle_run

    if grid_obstacle(run.tp, comm.size) or afd_obstacle(run.afd, comm.size):
        return None
    if run.afd is not None:
        loaded = load_afd_share(run.model_path, AfdRoles.of(run.afd, comm.size), comm.rank)
    elif run.tp > 1:
        loaded = load_tensor_share(run.model_path, comm.rank % run.tp, run.tp)
    else:
        loaded = load_model(run.model_path, weight_cache=run.weight_cache)
    with uncounted(comm):
        run = settle_run(comm, loaded, run, DecodeConfig())
        plan = make_engine(comm, loaded, run).prepare_decode()
    if plan is None:  # an FFN rank's (--afd): rank 0's is the report's
        return None
    return {**plan.as_dict(), "kv_dtype": run.kv_dtype}  # --kv-dtype auto's, settled


def stale_calibration(reports: list[dict], measured) -> list[str]:
    """A warning when the cached attention rate is far from what the ranks measure today."""
    today = min(r["attention_flops"] for r in reports)
    if 1 / SLOW_RANK_FACTOR < today / measured.attention_flops < SLOW_RANK_FACTOR:
        return []
    return [f"the cached attention FLOP/s ({measured.attention_flops / 1e9:.2f} G) is far "
            f"from today's ({today / 1e9:.2f} G): run `spmd-cp doctor --recalibrate`"]


def describe_auto(model_path: str, cp_size: int, measured, warnings: list[str], compute):
    """Where --cp-algo auto switches for this model (None, with a warning, if its header
    cannot be read)."""
    # K/V element size on the wire (engine.model.kv_dtype_for, without loading the
    # model): float32 on the CPU path, the model's half precision on the GPU path.
    elem_bytes = 2 if compute.gpu else 4
    try:
        heads = head_counts(model_path)
    except (OSError, ValueError, KeyError, TypeError) as failure:
        warnings.append(f"cannot read the head counts of {model_path} ({failure!r}): "
                        "no crossover")
        return None
    return auto_crossover(*heads, elem_bytes, cp_size, measured)


def describe_weights(model_path: str, cp_size: int, warnings: list[str]) -> dict | None:
    """The weight bytes one rank holds, replicated and with --shard-weights on these ranks
    (from the file headers; None, with a warning, where they cannot be read)."""
    from ..engine.cache.forecast import default_memory_limit
    from ..engine.weights.weights import PREFETCH_LAYERS
    from ..run.sharding import auto_shards, layout_of

    try:
        layout = layout_of(model_path, False)
    except (OSError, ValueError, KeyError) as failure:
        warnings.append(f"cannot read the weight layout of {model_path} ({failure!r})")
        return None
    limit = default_memory_limit()
    auto = cp_size > 1 and auto_shards(layout.replicated, limit)
    return {"replicated_bytes": layout.replicated, "prefetch_layers": PREFETCH_LAYERS,
            "sharded_bytes": layout.per_rank(cp_size, PREFETCH_LAYERS) if cp_size > 1 else None,
            "memory_limit_bytes": limit, "auto_shards": auto}
