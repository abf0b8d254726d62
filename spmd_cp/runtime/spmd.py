"""The SPMD runtime every command runs inside: logging, agreement on errors, abort.

Two guarantees (an MPI job is N processes that block on each other):
- bad input is found before heavy work, and *every* rank learns of it and exits with
  the same one-line message (printed once, by rank 0), so no rank waits forever for a
  peer that already gave up;
- any other exception on any rank prints that rank's traceback and calls MPI_Abort,
  which ends the whole job non-zero (mpiexec kills the other ranks). ``python -m
  mpi4py`` gives scripts this; a console-script entry point has to do it itself.
"""

from __future__ import annotations

import logging
import sys
import traceback

from .comm import Comm
from ..errors import UserError
from .launcher import LauncherMismatch, check_launch
from .trace import Tracer
from .watchdog import EXIT_INTERRUPTED, Watchdog

EXIT_USER_ERROR = 2

# Blocking-call limit while loading (ranks may load at very different speeds) and once
# every rank is in the lockstep prefill/decode loop (--comm-timeout's default).
STARTUP_TIMEOUT_S = 900.0
DEFAULT_COMM_TIMEOUT_S = 45.0

log = logging.getLogger("spmd_cp")


def setup_logging(comm: Comm, verbose: bool = False):
    """stderr logging with a ``[rank r/N]`` prefix; ranks > 0 stay quiet unless verbose."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {comm.rank}/{comm.size}] %(message)s"))
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO if comm.rank == 0 or verbose else logging.WARNING)


def on_root(comm: Comm, fn, *args, **kwargs):
    """Run ``fn`` on rank 0 only and broadcast its result, or its UserError, to all."""
    outcome = None
    if comm.rank == 0:
        try:
            outcome = ("ok", fn(*args, **kwargs))
        except UserError as error:
            outcome = ("error", str(error))
    status, value = comm.bcast_object(outcome)
    if status == "error":
        raise UserError(value)
    return value


def everywhere(comm: Comm, fn, *args, **kwargs):
    """Run ``fn`` on every rank; if it fails with UserError on any rank, fail on all.

    For checks whose answer can differ between hosts (a model file missing on one).
    """
    try:
        outcome = ("ok", fn(*args, **kwargs))
    except UserError as error:
        outcome = ("error", str(error))
    outcomes = comm.allgather_object(outcome[0] == "error" and outcome[1])
    for rank, message in enumerate(outcomes):
        if message:
            suffix = f" (on rank {rank})" if comm.size > 1 and rank != 0 else ""
            raise UserError(message + suffix)
    return outcome[1]


def first_reason(comm: Comm, reason: str | None) -> str | None:
    """Collective: the first rank's reason, "rank r: ...", or None where no rank has one
    (every rank gets the same answer, so all take the same way)."""
    reasons = [f"rank {r}: {why}" for r, why in enumerate(comm.allgather_object(reason)) if why]
    return reasons[0] if reasons else None


def require_same(comm: Comm, what: str, value):
    """Fail on every rank, naming the ranks, unless all ranks hold the same ``value``."""
    values = comm.allgather_object(value)
    if all(v == values[0] for v in values):
        return
    groups = {}
    for rank, v in enumerate(values):
        groups.setdefault(repr(v), []).append(rank)
    described = "; ".join(f"ranks {','.join(map(str, ranks))}: {v}" if len(ranks) > 1
                          else f"rank {ranks[0]}: {v}" for v, ranks in groups.items())
    raise UserError(f"ranks disagree on {what} ({described})")


def software_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("spmd-cp", "mlx", "mlx-lm", "mpi4py"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    return versions


def import_mpi():
    """mpi4py.MPI, which initialises MPI: only after the BLAS re-exec in cli.main.

    First the launcher's own MPI library where the default one cannot join its job
    (runtime/mpi_library.py: Open MPI's under Open MPI's mpirun), or one line and exit 2.
    Without mpi4py's several-line warning about a launcher of another MPI:
    ``check_launcher`` turns the case that matters into one line and exit 2.
    """
    import warnings

    from .mpi_library import choose_mpi_library

    try:
        chosen = choose_mpi_library()
    except LauncherMismatch as error:
        if error.shown:
            print(f"spmd-cp: error: {error}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    if chosen:
        log.debug("MPI library of the launcher: %s (MPI4PY_LIBMPI)", chosen)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="suspicious MPI execution environment")
        from mpi4py import MPI
    return MPI


def check_launcher(comm: Comm):
    """Refuse a launcher of another MPI (runtime/launcher.py), before any work."""
    check_launch(comm.size, import_mpi().Get_library_version())


def run_main(main, options: dict) -> int:
    """Set up MPI, the communicator and its watchdog, then ``run`` ``main(comm, options)``."""
    world = import_mpi().COMM_WORLD
    watchdog = Watchdog(world.Get_rank(), world.Get_size(), world.Abort, STARTUP_TIMEOUT_S)
    watchdog.start(world)
    try:
        comm = Comm(world, watchdog)
    except UserError as error:  # the MPI's thread level: the same on every rank
        if world.Get_rank() == 0:
            print(f"spmd-cp: error: {error}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    setup_logging(comm, options.get("verbose", False))
    differ = arguments_differ(comm.allgather_object(sys.argv[1:]))
    if differ:  # ranks started with different commands (mpiexec A : B): nothing agrees
        if comm.rank == 0:
            print(f"spmd-cp: error: {differ}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    if options.get("trace"):
        comm.tracer = Tracer(comm.rank)
        comm.tracer.align(comm)

    def main_then_trace(comm, options):
        check_launcher(comm)
        main(comm, options)
        if comm.tracer is not None:
            comm.tracer.write(comm, options["trace"])
            log.info("trace of %d ranks written to %s", comm.size, options["trace"])

    return run(comm, main_then_trace, options)


def arguments_differ(arguments: list[list[str]]) -> str | None:
    """Why the ranks' command lines (rank order) are not one SPMD job, or None."""
    for rank, theirs in enumerate(arguments):
        if theirs == arguments[0]:
            continue
        ours = arguments[0]
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                  min(len(ours), len(theirs)))
        show = lambda args: repr(args[at]) if at < len(args) else "nothing"  # noqa: E731
        return (f"the ranks' arguments differ: argument {at + 1} is {show(ours)} on rank 0 "
                f"and {show(theirs)} on rank {rank}; start every rank with the same "
                f"command (one spmd-cp program, not mpiexec A : B)")
    return None


def hot_phase(comm: Comm, timeout: float | None):
    """Every rank is now in lockstep: bound each blocking call by ``timeout`` seconds."""
    if comm.watchdog is not None:
        comm.watchdog.timeout = DEFAULT_COMM_TIMEOUT_S if timeout is None else timeout


def run(comm: Comm, main, *args, **kwargs) -> int:
    """Run ``main(comm, ...)`` with the guarantees above; returns the exit code."""
    try:
        main(comm, *args, **kwargs)
        return 0
    except UserError as error:
        if comm.rank == 0 and getattr(error, "shown", True):
            print(f"spmd-cp: error: {error}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        sys.stderr.write(f"[rank {comm.rank}/{comm.size}] spmd-cp: interrupted; stopping all ranks\n")
        sys.stderr.flush()
        if comm.size > 1:
            comm.abort(EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    except BaseException as error:  # noqa: BLE001 - any failure must end every rank
        if isinstance(error, SystemExit) and not error.code:
            return 0
        prefix = f"[rank {comm.rank}/{comm.size}] "
        text = "".join(traceback.format_exception(error))
        sys.stderr.write("".join(prefix + line + "\n" for line in text.splitlines()))
        sys.stderr.write(f"{prefix}spmd-cp: rank {comm.rank} failed; aborting all ranks\n")
        sys.stderr.flush()
        sys.stdout.flush()
        if comm.size > 1:
            comm.abort(1)
        return 1
