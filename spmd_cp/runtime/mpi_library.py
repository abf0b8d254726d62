"""The MPI library of the launcher that started this process, chosen before MPI starts.

The README's install puts the MPICH wheel in the environment, and mpi4py loads it by
default. MPICH's library joins a job through PMI (MPICH's mpiexec, srun --mpi=pmi2); a
PMIx launcher (Open MPI's mpirun/prterun, srun --mpi=pmix) offers only PMIx, and there
MPICH's MPI_Init aborts every rank with its own error stack. Open MPI's library speaks
PMIx, and mpi4py's wheel carries an Open MPI build of its MPI module too: it loads
whichever library ``MPI4PY_LIBMPI`` names (read when ``mpi4py.MPI`` is imported). So,
launched by a PMIx server, the program looks for that launcher's Open MPI library
(libmpi.so.40): under ``OPAL_PREFIX``, beside the launcher programs on PATH
(prefix/bin/mpirun -> prefix/lib...), then in the system's library folders, and names it
in ``MPI4PY_LIBMPI``. Where none is found and mpi4py would load an MPICH-family library,
it stops with one line that says so.

A user's own ``MPI4PY_LIBMPI`` or ``MPI4PY_MPIABI`` always wins. Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

from .launcher import LauncherMismatch, launched_as
from .library_paths import library_dirs

OPEN_MPI_LIBRARY = "libmpi.so.40"  # Open MPI's soname since 3.0 (MPICH's: libmpi.so.12)
LAUNCHER_PROGRAMS = ("prterun", "mpirun", "orterun", "mpiexec")
USER_CHOICE = ("MPI4PY_LIBMPI", "MPI4PY_MPIABI")


def pmix_server(environ) -> str | None:
    """The variable that shows a PMIx server launched this process and no PMI one did
    (MPICH's mpiexec sets PMI_RANK / PMI_FD), or None."""
    if "PMI_RANK" in environ or "PMI_FD" in environ:
        return None
    return next((name for name in sorted(environ) if name.startswith("PMIX_SERVER_URI")),
                None)


def prefix_lib_dirs(prefix: Path) -> list[Path]:
    multiarch = Path(library_dirs()[0]).name  # e.g. x86_64-linux-gnu
    return [prefix / "lib", prefix / "lib64", prefix / "lib" / multiarch]


def candidates(environ, system_dirs: list[str]) -> list[Path]:
    """Where the launcher's Open MPI library may be, most specific first."""
    folders = []
    if environ.get("OPAL_PREFIX"):
        folders += prefix_lib_dirs(Path(environ["OPAL_PREFIX"]))
    for folder in environ.get("PATH", "").split(os.pathsep):
        for name in LAUNCHER_PROGRAMS:
            program = Path(folder or ".", name)
            if program.is_file():
                folders += prefix_lib_dirs(program.resolve().parent.parent)
    folders += [Path(folder) for folder in system_dirs]
    unique = dict.fromkeys(folders)
    return [folder / OPEN_MPI_LIBRARY for folder in unique]


def mpi4py_default() -> str | None:
    """The MPI family mpi4py loads when told nothing ("mpich", "openmpi", ...), or None
    where this mpi4py does not say (one built against a single MPI)."""
    try:
        from mpi4py import _mpiabi

        return _mpiabi._get_mpiabi()
    except Exception:  # noqa: BLE001 - a private helper of mpi4py's wheels
        return None


def choose_mpi_library(environ=None, system_dirs: list[str] | None = None) -> str | None:
    """Before ``from mpi4py import MPI``: under a PMIx launcher, set MPI4PY_LIBMPI to its
    Open MPI library. Returns the path set, or None where nothing needed setting. Raises
    LauncherMismatch where no such library is found and mpi4py would load MPICH's.
    ``system_dirs``: the system's library folders (default: runtime/library_paths.py's)."""
    environ = os.environ if environ is None else environ
    evidence = pmix_server(environ)
    if evidence is None or any(name in environ for name in USER_CHOICE):
        return None
    system_dirs = library_dirs() if system_dirs is None else system_dirs
    for library in candidates(environ, system_dirs):
        if library.is_file():
            environ["MPI4PY_LIBMPI"] = str(library)
            return str(library)
    default = mpi4py_default()
    if default in (None, "openmpi", "mpiabi"):
        return None
    launched = launched_as(environ)
    raise LauncherMismatch(
        f"launched by a PMIx launcher ({evidence} is set: Open MPI's mpirun/prterun or srun "
        f"--mpi=pmix), which mpi4py's default MPI library ({default}) cannot join, and no "
        f"Open MPI library ({OPEN_MPI_LIBRARY}) was found under OPAL_PREFIX, beside the "
        "launcher on PATH or in the system's library folders: set MPI4PY_LIBMPI=/path/to/"
        f"{OPEN_MPI_LIBRARY} (mpirun -x MPI4PY_LIBMPI=...), or launch with the mpiexec of "
        "mpi4py's library (`python -m mpi4py --mpi-library` names it)",
        shown=launched is None or launched.rank == 0)
