"""What the launcher says this process is, against what the MPI library made of it.

The most common MPI installation mistake: mpi4py loads one MPI library (Open MPI from the
system or Homebrew, a cluster module) while the `mpiexec` on PATH belongs to another (the
MPICH wheel). The library cannot talk to that launcher, so every process initialises as a
singleton: `mpiexec -n 2` runs two independent one-rank jobs, each writing the same
outputs, and exits 0. Every launcher tells its processes their place in the
environment; when that says "one of N > 1" but COMM_WORLD has one rank, the job refuses.

Standard library only; the caller passes COMM_WORLD's size and the library's version.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import UserError


@dataclass(frozen=True)
class Launcher:
    kind: str
    size_var: str | None  # the job's size, if this launcher says it
    rank_var: str


# The first launcher with a variable present decides, so the order matters. MPI launchers
# come before Slurm: inside an allocation, mpiexec (Hydra) and mpirun (Open MPI) start
# their proxies or daemons with srun, one per node, and the ranks inherit that step's
# SLURM_STEP_NUM_TASKS / SLURM_PROCID, which count nodes, not ranks.
# Slurm: SLURM_NTASKS is no evidence, because the batch script itself (and an salloc
# shell) has it, and a one-rank run from there is legitimate; only srun sets the
# per-step SLURM_STEP_NUM_TASKS and a task's SLURM_PROCID, i.e. "started as task i of
# this N-task step". PMIx gives no size in the environment (a rank only), so it comes
# last: under srun --mpi=pmix the Slurm variables say more.
LAUNCHERS = (
    Launcher("Open MPI's mpirun/prterun", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    Launcher("a PMI launcher (MPICH/Intel MPI mpiexec, srun --mpi=pmi2)", "PMI_SIZE",
             "PMI_RANK"),
    Launcher("MVAPICH's mpirun_rsh", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"),
    Launcher("Slurm's srun", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID"),
    Launcher("a PMIx launcher", None, "PMIX_RANK"),
)


# What a launcher that really started this process leaves beside the rank variables: its
# server's address or its job's id. A process with rank variables and none of these was
# started by hand (or by a script) with a launcher's variables set.
LAUNCHER_SERVICES = ("PMIX_SERVER_URI", "OMPI_MCA_orte_hnp_uri", "OMPI_MCA_ess_base_jobid",
                     "PMI_FD", "PMI_PORT", "SLURM_STEP_ID", "MPISPAWN_")


def launcher_present(environ) -> bool:
    return any(name.startswith(LAUNCHER_SERVICES) for name in environ)


@dataclass(frozen=True)
class LaunchedAs:
    kind: str
    size: int | None  # None: the launcher gives only this process's rank
    rank: int
    evidence: str  # "OMPI_COMM_WORLD_SIZE=2"


def _int(environ, name: str | None) -> int | None:
    try:
        return int(environ[name]) if name else None
    except (KeyError, ValueError):
        return None


def launched_as(environ=None) -> LaunchedAs | None:
    """Where the launcher's variables place this process, or None outside any launcher."""
    environ = os.environ if environ is None else environ
    for launcher in LAUNCHERS:
        size, rank = _int(environ, launcher.size_var), _int(environ, launcher.rank_var)
        if size is None and rank is None:
            continue
        shown = launcher.size_var if size is not None else launcher.rank_var
        return LaunchedAs(launcher.kind, size, rank or 0, f"{shown}={environ[shown]}")
    return None


class LauncherMismatch(UserError):
    """A launcher/library mismatch. Every process of the would-be job finds it alone
    (each thinks it is rank 0): ``shown`` is True only in the one the launcher made rank
    0, so the line is printed once."""

    def __init__(self, message: str, shown: bool):
        super().__init__(message)
        self.shown = shown


def check_launch(world_size: int, library_version: str, environ=None):
    """Raise LauncherMismatch when the launcher started N > 1 ranks but the MPI library
    sees a job of one (``library_version``: MPI.Get_library_version())."""
    launched = launched_as(environ)
    if world_size != 1 or launched is None or ((launched.size or 0) <= 1 and launched.rank == 0):
        return
    library = " ".join(library_version.strip().splitlines()[0].split()) if library_version else "?"
    place = (f"one of {launched.size} ranks" if launched.size is not None
             else f"rank {launched.rank} of a larger job")
    if not launcher_present(environ if environ is not None else os.environ):
        # No launcher is there to have started the others: every such process speaks.
        raise LauncherMismatch(
            f"{launched.evidence} says this process is rank {launched.rank} of "
            f"{launched.size or 'a larger job'} started by {launched.kind}, "
            f"but none of that launcher's own variables ({', '.join(LAUNCHER_SERVICES)}...) "
            f"is set and the MPI library ({library}) sees a job of 1 rank: it was started "
            "alone with a launcher's variables set; unset them to run one rank, or start "
            "the job with its launcher", shown=True)
    raise LauncherMismatch(
        f"launched as {place} by {launched.kind} ({launched.evidence}), but the MPI library "
        f"mpi4py loaded ({library}) sees a job of 1 rank: launcher and library belong to "
        "different MPI installations. Launch with the mpiexec of that library (`python -m "
        "mpi4py --mpi-library` names it), or make mpi4py load the launcher's MPI "
        "(MPI4PY_LIBMPI=/path/to/its/libmpi.so, or reinstall mpi4py against it)",
        shown=launched.size is None or launched.rank == 0)
