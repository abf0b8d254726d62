"""MLX's MPI backend over the job's MPICH, through a small ABI adapter built on first use.

MLX's MPI backend runs a graph collective on MLX's compute thread as one MPI call; over
MPICH's shared memory that is a few microseconds (576 floats at N = 2: 8 us for an
all_sum including the graph's own node, against 32-47 us through MLX's ring backend,
whose every message crosses a thread pool, a socket thread and TCP). But MLX speaks Open
MPI's ABI only (pointer handles, ``ompi_mpi_*`` objects, a version check), and the MPI
wheels users install from pip are MPICH (int handles). ``mpi_abi_adapter.c`` translates:
this module has it compiled once per cache directory (runtime/native.py) and binds it to
the MPICH library mpi4py loaded and to a duplicate of the job's communicator;
runtime/graph_comm.py then opens MLX's MPI backend with ``MLX_MPI_LIBNAME`` naming it.

Every step that can fail says why (``local_obstacle``'s reason: an MPI with pointer
handles such as Open MPI, no compiler; or a RuntimeError: a failed build, bind or init),
and runtime/graph_comm.py falls back to the ring backend.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from . import native

SOURCE = Path(__file__).with_name("mpi_abi_adapter.c")

_bound: dict = {}  # the duplicate communicator the adapter serves, once per process


def _predefined(MPI, duplicate) -> list:
    """MPICH's handles in the order of ``predefined`` in mpi_abi_adapter.c."""
    objects = [duplicate, MPI.SUM, MPI.MAX, MPI.MIN, MPI.C_BOOL, MPI.INT8_T, MPI.UINT8_T,
               MPI.INT16_T, MPI.UINT16_T, MPI.INT32_T, MPI.UINT32_T, MPI.INT64_T,
               MPI.UINT64_T, MPI.FLOAT, MPI.DOUBLE, MPI.C_FLOAT_COMPLEX]
    return [handle.py2f() for handle in objects]  # MPICH: the Fortran handle is the C one


def local_obstacle() -> str | None:
    """Why this process's MPI cannot serve the adapter, or None (no side effects)."""
    from mpi4py import MPI

    if MPI._sizeof(MPI.Comm) != ctypes.sizeof(ctypes.c_int):
        return (f"{MPI.Get_library_version().splitlines()[0].strip()} has pointer handles "
                "(the adapter is for MPICH-family libraries)")
    # Not mx.distributed.is_available("mpi"): MLX looks for its MPI library once per
    # process, and must first see MLX_MPI_LIBNAME name the adapter.
    try:
        built = _target().exists()
    except RuntimeError as error:  # the C source is missing from the install
        return str(error)
    if not built and native.compiler() is None:
        return "no C compiler to build the adapter (cc, or $CC)"
    return None


def adapter_library() -> Path:
    """The compiled adapter (runtime/native.py builds it on first use). Raises
    RuntimeError naming what failed."""
    try:
        return native.build(SOURCE, _target())
    except RuntimeError as error:
        raise RuntimeError(f"building the MPI ABI adapter failed: {error}") from error


def _target() -> Path:
    return native.built_path(SOURCE, "mpi-abi", "adapter")


def bind(mpi_comm, library: Path):
    """Bind the built adapter ``library`` to the MPICH library mpi4py loaded and to a
    duplicate of ``mpi_comm``, MLX's "MPI_COMM_WORLD" from then on (once per process;
    MLX's group over it is cached by runtime/graph_comm.py). Collective (the duplicate):
    every rank must have its library first. Raises RuntimeError where it cannot bind."""
    from mpi4py import MPI

    if _bound:
        return
    duplicate = mpi_comm.Dup()  # MLX's messages never meet the Python side's
    # MLX does not check what its MPI calls return: an error there must end the job
    # (MPI aborts every rank), not leave a rank computing on a buffer never filled.
    duplicate.Set_errhandler(MPI.ERRORS_ARE_FATAL)
    adapter = ctypes.CDLL(str(library))
    handles = _predefined(MPI, duplicate)
    status = adapter.spmd_cp_bind(str(MPI.__file__).encode(),
                                  ctypes.c_ssize_t(int(MPI.IN_PLACE)),
                                  (ctypes.c_int * len(handles))(*handles))
    if status != 0:
        raise RuntimeError(f"the MPI ABI adapter could not bind to MPICH (status {status})")
    _bound["comm"] = duplicate  # kept: the adapter holds its handle
