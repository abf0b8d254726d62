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
from .errors import UserError

EXIT_USER_ERROR = 2

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


def run(comm: Comm, main, *args, **kwargs) -> int:
    """Run ``main(comm, ...)`` with the guarantees above; returns the exit code."""
    try:
        main(comm, *args, **kwargs)
        return 0
    except UserError as error:
        if comm.rank == 0:
            print(f"spmd-cp: error: {error}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
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
