"""Which BLAS libraries exist on this machine, which family each is, and how many threads
each rank should give one. Standard library only."""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.metadata
import importlib.util
import os

from ..runtime.library_paths import library_dirs
from ..runtime.switches import startup_value, thread_count

ENV_CHOICE = "SPMD_CP_BLAS"  # unset/"auto", "reference", a family name, or a library path
ENV_GUARD = "SPMD_CP_BLAS_REEXEC"  # pid of the process that re-executed itself
OPT_OUT = ("reference", "off", "none", "0")
INSTALL_HINT = "apt-get install libopenblas0-pthread"

# Launchers' "ranks on this node" variables: MPICH Hydra, Open MPI, MVAPICH, Cray PALS, Slurm.
LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
                   "PALS_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")

# Variables each family reads for its thread count, in the library's own precedence order
# (OpenBLAS: OPENBLAS_NUM_THREADS > GOTO_NUM_THREADS > OMP_NUM_THREADS). If the user set any
# of them we leave the count alone.
THREAD_VARS = {
    "openblas": ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"),
    "mkl": ("MKL_NUM_THREADS", "OMP_NUM_THREADS"),
    "blis": ("BLIS_NUM_THREADS", "OMP_NUM_THREADS"),
}
FAST_KINDS = tuple(THREAD_VARS)

# Where distributions put them, best first, relative to each library directory. The pthreads
# builds come before OpenMP ones (MLX does not use OpenMP; one runtime fewer), serial last.
_RELATIVE_CANDIDATES = (
    "openblas-pthread/libopenblas.so.0",  # Debian / Ubuntu libopenblas0-pthread
    "openblas-openmp/libopenblas.so.0",   # Debian / Ubuntu libopenblas0-openmp
    "libopenblasp.so.0",                  # Fedora / RHEL openblas-threads
    "libopenblas.so.0",                   # Debian alternative link, Arch, conda, source builds
    "libopenblaso.so.0",                  # Fedora / RHEL openblas-openmp
    "libopenblas.so",
    "blis-pthread/libblis.so.4", "blis-pthread/libblis.so.3",  # Debian libblis4-pthread
    "blis-openmp/libblis.so.4", "blis-openmp/libblis.so.3",
    "libblis-mt.so.4", "libblis.so.4", "libblis.so.3",
    "libmkl_rt.so.2", "libmkl_rt.so",     # conda / oneAPI MKL
    "openblas-serial/libopenblas.so.0",   # single-threaded, still ~30x the reference
)


# Names the kernels a DYNAMIC_ARCH OpenBLAS runs whatever the CPU (set where an old
# OpenBLAS computes wrongly on a new CPU). By hand, on an AVX-512 AMD EPYC, forcing
# Haswell's in place of the Cooperlake ones it picks cost prefill 2-7%.
FORCED_CORE = "OPENBLAS_CORETYPE"


def blas_kind(path: str) -> str | None:
    """Family of a BLAS library from its (resolved) path: openblas, mkl, blis, reference, ..."""
    real = os.path.realpath(path).lower()
    name = os.path.basename(real)
    if "scipy_openblas" in name:
        return "numpy-private"  # numpy's copy: every symbol is renamed (scipy_cblas_sgemm)
    for kind in ("mkl", "blis", "openblas", "atlas"):
        if kind in real:
            return kind
    if name.startswith(("libblas", "libcblas", "liblapack")):
        return "reference"
    return None


def _mkl_wheel_libraries() -> list[str]:
    """libmkl_rt from PyPI's `mkl` wheel (installed as data files under <prefix>/lib)."""
    try:
        files = importlib.metadata.distribution("mkl").files or ()
    except importlib.metadata.PackageNotFoundError:
        return []
    return sorted(str(f.locate()) for f in files if f.name.startswith("libmkl_rt.so"))


def candidate_paths() -> list[str]:
    """Existing files that may be an optimized BLAS, best first (not yet verified)."""
    seen, found = set(), []
    paths = [os.path.join(d, rel) for d in library_dirs() for rel in _RELATIVE_CANDIDATES]
    for path in paths + _mkl_wheel_libraries():
        real = os.path.realpath(path)
        if os.path.isfile(real) and real not in seen and blas_kind(real) in FAST_KINDS:
            seen.add(real)
            found.append(path)
    return found


@functools.lru_cache(maxsize=None)
def exports_cblas(path: str) -> bool:
    """True if the library loads and exports the standard `cblas_sgemm` that MLX calls."""
    try:
        return hasattr(ctypes.CDLL(path), "cblas_sgemm")
    except OSError:
        return False


def find_fast_blas(kind: str | None = None) -> str | None:
    """Path of an optimized BLAS with standard cblas symbols on this machine, or None.

    Args:
        kind: only consider this family ("openblas", "mkl" or "blis").
    """
    for path in candidate_paths():
        if (kind is None or blas_kind(path) == kind) and exports_cblas(path):
            return path
    return None


def mlx_bundles_fast_blas() -> bool | None:
    """None if MLX is not installed; True if its wheel carries an optimized BLAS itself."""
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        site = os.path.dirname(root)
        libs = glob.glob(os.path.join(root, "lib", "*.so*"))
        libs += glob.glob(os.path.join(site, "mlx*.libs", "*.so*"))
        if any(blas_kind(p) in FAST_KINDS for p in libs):
            return True
    return False


def usable_cpus() -> int:
    """CPUs this process may run on: affinity mask, capped by a cgroup v2 CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def local_ranks() -> int:
    """Ranks the MPI launcher started on this node (1 outside a launcher)."""
    for var in LOCAL_SIZE_VARS:
        try:
            return max(1, int(os.environ[var]))
        except (KeyError, ValueError):
            continue
    return 1


def default_threads() -> int:
    """BLAS threads per rank: the ranks on this node share its cores without oversubscribing."""
    return max(1, usable_cpus() // local_ranks())


# The BLAS's thread settings, the first one set: the native kernels' threads follow them
THREAD_SETTINGS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                   "BLIS_NUM_THREADS")


def rank_threads() -> int:
    """Threads of a rank's native kernels (the decode step, prefill attention): as many
    as its BLAS may use (the first of THREAD_SETTINGS set to a positive number: the
    re-exec sets one to the rank's share of the host's cores unless the user did,
    blas/reexec.py), else that share itself; never more than the CPUs the process may
    run on."""
    threads = thread_count(THREAD_SETTINGS)
    return min(threads, usable_cpus()) if threads else default_threads()


def thread_env(path: str, threads: int) -> dict:
    """The variables to set for `threads` BLAS threads, or {} if the user set any already."""
    kind = blas_kind(path)
    names = THREAD_VARS.get(kind, ())
    if not names or any(startup_value(v) for v in names):
        return {}
    env = {names[0]: str(threads)}
    if "openmp" in os.path.realpath(path) or os.path.basename(path).startswith("libopenblaso"):
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def preloaded_libraries() -> list[str]:
    return [p for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split() if p]
